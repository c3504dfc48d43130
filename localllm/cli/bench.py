"""``localllm bench MODEL``: prompt processing (pp) and generation (tg) tokens/s and time to first
token, each repeated with mean ± std, for every KV cache type × draft variant asked for.

    $ localllm bench smollm2:135m
    $ localllm bench smollm2:135m --kv-cache f16,q8_0,q4_0 --draft none,ngram --repetitions 5
    $ localllm bench smollm2:135m --pp 128 --tg 32 --repetitions 2 --json

Method (like ``llama-bench``): one warm-up generation per variant, then per repetition

* **pp**: a fresh raw prompt of about ``--pp`` tokens (each repetition starts with a different word,
  so nothing is reused from the KV cache), one token generated; rate = evaluated prompt tokens /
  prompt eval duration as the backend reports it.
* **TTFT**: wall time from the engine call to the first event of that same request.
* **tg**: ``--tg`` tokens generated at temperature 0 after a short prompt; rate = eval count / eval
  duration. Draft variants also report the acceptance rate.

The KV cache size is what the loaded model reports (``ModelInfo.kv_bytes`` when the
backend sets it, else layers × KV heads × head size × context for the type): ``Loaded.kv_cache_bytes``.
The benchmark runs in-process (:class:`~localllm.local.LocalRunner`: it sizes prompts with the model's
tokenizer, which a server does not offer).
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import click

from localllm.errors import LocalLLMError

if TYPE_CHECKING:
    from localllm.api import Done, GenerateRequest
    from localllm.loader import LoadOptions
    from localllm.local import LocalRunner

_WORDS = (
    "river mountain garden window silver morning history engine market planet orange doctor winter "
    "forest letter island summer bridge candle castle school ocean travel science music village "
    "paper kitchen thunder animal pencil cloud harbor mirror lantern journey meadow violin desert "
    "signal theory marble rocket stone valley tiger basket cotton feather meadow copper"
).split()

TG_PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


def _split_list(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def summary(values: list[float]) -> dict[str, Any]:
    """Mean, sample standard deviation and the raw values.

    >>> summary([1.0, 3.0])
    {'mean': 2.0, 'std': 1.4142, 'values': [1.0, 3.0]}
    """
    values = [round(v, 4) for v in values]
    mean = statistics.fmean(values) if values else 0.0
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": round(mean, 4), "std": round(std, 4), "values": values}


def make_prompt(runner: LocalRunner, name: str, n_tokens: int, salt: int) -> str:
    """Raw text of about ``n_tokens`` tokens for ``name``; ``salt`` picks the words (and the first one),
    so two salts share no prefix beyond BOS."""
    rng = random.Random(salt)
    words = [f"{_WORDS[salt % len(_WORDS)].capitalize()}{salt}"] + [rng.choice(_WORDS) for _ in range(4 * n_tokens)]
    n_words = max(1, n_tokens)
    for _ in range(4):
        count = len(runner.tokenize(name, " ".join(words[:n_words])))
        if count == n_tokens:
            break
        n_words = max(1, min(len(words), round(n_words * n_tokens / max(count, 1))))
    return " ".join(words[:n_words])


@dataclass
class Variant:
    kv_cache_type: str
    draft: str
    pp_tps: list[float] = field(default_factory=list)
    tg_tps: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    pp_tokens: int = 0
    tg_tokens: list[int] = field(default_factory=list)
    draft_proposed: int = 0
    draft_accepted: int = 0
    kv_cache_bytes: int | None = None
    load_ms: float | None = None
    n_ctx: int | None = None
    plan: str = ""  # the plan it loaded with (localllm.loader.plan_line), as `localllm probe` prints it
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kv_cache_type": self.kv_cache_type, "draft": self.draft}
        if self.error:
            out["error"] = self.error
            return out
        out.update(
            pp_tokens=self.pp_tokens,
            pp_tps=summary(self.pp_tps),
            tg_tokens=self.tg_tokens,
            tg_tps=summary(self.tg_tps),
            ttft_ms=summary(self.ttft_ms),
            draft_acceptance=round(self.draft_accepted / self.draft_proposed, 4) if self.draft_proposed else None,
            draft_proposed=self.draft_proposed,
            draft_accepted=self.draft_accepted,
            kv_cache_bytes=self.kv_cache_bytes,
            n_ctx=self.n_ctx,
            load_ms=round(self.load_ms, 1) if self.load_ms is not None else None,
            plan=self.plan,
        )
        return out


def _timed(runner: LocalRunner, name: str, request: GenerateRequest, options: LoadOptions
           ) -> tuple[Done, float | None]:
    """(Done, seconds to the first event) for one request."""
    from localllm.api import Done

    t0 = time.perf_counter()
    first = None
    done = None
    for event in runner.generate(name, request, options):
        if first is None:
            first = time.perf_counter() - t0
        if isinstance(event, Done):
            done = event
    if done is None:
        raise LocalLLMError("The model ended the stream without its final event.")
    return done, first


def run_variant(runner: LocalRunner, name: str, variant: Variant, *, pp: int, tg: int, repetitions: int,
                num_ctx: int | None, num_thread: int | None, num_draft: int, backend: str,
                tg_prompt: str = TG_PROMPT, progress: Callable[[Variant, int], None] | None = None) -> Variant:
    """Measure one variant in place (errors a user can cause end up in ``variant.error``)."""
    from localllm.api import BackendError, GenerateRequest, Sampling
    from localllm.loader import LoadOptions

    options = LoadOptions(num_ctx=num_ctx, kv_cache_type=variant.kv_cache_type, backend=backend,
                          draft=variant.draft, num_draft=num_draft, num_thread=num_thread)
    try:
        for loaded in runner.ps():  # one variant in memory at a time
            runner.unload(loaded.name)
        t0 = time.perf_counter()
        running = runner.load(name, options)
        variant.load_ms = (time.perf_counter() - t0) * 1000
        variant.kv_cache_bytes = running.kv_cache_bytes
        variant.n_ctx = n_ctx = running.context_length
        variant.plan = running.plan
        if pp + 8 > n_ctx or 16 + tg > n_ctx:
            raise LocalLLMError(f"--pp {pp} / --tg {tg} do not fit the {n_ctx}-token context.")
        greedy = Sampling(temperature=0.0, seed=0, max_tokens=8)
        _timed(runner, name, GenerateRequest(prompt=tg_prompt, sampling=greedy), options)  # warm-up
        for rep in range(repetitions):
            text = make_prompt(runner, name, pp, salt=1000 + rep)
            one = Sampling(temperature=0.0, seed=0, max_tokens=1)
            done, first = _timed(runner, name, GenerateRequest(prompt=text, sampling=one), options)
            s = done.stats
            variant.pp_tokens = s.prompt_eval_count - s.prompt_cached_tokens
            variant.pp_tps.append(s.prompt_eval_rate)
            variant.ttft_ms.append((first or 0.0) * 1000)
            # tg: a short prompt after a long one: the few prompt tokens do not disturb the timing
            gen = Sampling(temperature=0.0, seed=0, max_tokens=tg)
            done, _ = _timed(runner, name, GenerateRequest(prompt=tg_prompt, sampling=gen), options)
            s = done.stats
            variant.tg_tps.append(s.eval_rate)
            variant.tg_tokens.append(s.eval_count)
            variant.draft_proposed += s.draft_proposed
            variant.draft_accepted += s.draft_accepted
            if progress:
                progress(variant, rep)
    except (LocalLLMError, BackendError) as e:
        variant.error = str(e)
    return variant


def _fmt(stat: dict[str, Any], digits: int = 1) -> str:
    return f"{stat['mean']:.{digits}f} ± {stat['std']:.{digits}f}"


def render_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    title = (f"{report['model']} · {report['backend']} · {report['n_threads'] or 'auto'} threads · "
             f"pp{report['pp']} / tg{report['tg']} · {report['repetitions']} repetition(s)")
    table = Table(title=title)
    for col in ("kv cache", "draft", "pp tok/s", "tg tok/s", "TTFT ms", "accepted", "KV cache"):
        table.add_column(col, justify="right" if col not in ("kv cache", "draft") else "left")
    for r in report["results"]:
        if "error" in r:
            table.add_row(r["kv_cache_type"], r["draft"], f"[red]{r['error']}[/red]", "", "", "", "")
            continue
        acc = f"{r['draft_acceptance']:.0%}" if r["draft_acceptance"] is not None else "–"
        kv = f"{r['kv_cache_bytes'] / 2**20:.1f} MiB" if r["kv_cache_bytes"] else "?"
        table.add_row(r["kv_cache_type"], r["draft"], _fmt(r["pp_tps"]), _fmt(r["tg_tps"]),
                      _fmt(r["ttft_ms"]), acc, kv)
    console.print(table)


@click.command("bench", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model")
@click.option("--pp", "pp", type=int, default=512, show_default=True, help="Prompt tokens for the pp test.")
@click.option("--tg", "tg", type=int, default=128, show_default=True, help="Tokens to generate for the tg test.")
@click.option("-r", "--repetitions", type=int, default=3, show_default=True, help="Repetitions of each test.")
@click.option("--kv-cache", default=None, metavar="LIST", help="KV cache types to compare, e.g. f16,q8_0,q4_0.")
@click.option("--draft", default="none", show_default=True, metavar="LIST",
              help="Draft variants to compare: none, ngram, a model NAME or PATH (comma separated).")
@click.option("--num-draft", type=int, default=4, show_default=True, help="Most tokens a draft proposes per step.")
@click.option("--num-ctx", type=int, default=None, help="Context size (default: pp + tg + room, at least 2048).")
@click.option("--threads", type=int, default=None, help="CPU threads (default: the planner's).")
@click.option("--backend", default="auto", metavar="auto|llamacpp|mlx", show_default=True, help="Inference backend.")
@click.option("--tg-prompt", default=TG_PROMPT, help="Prompt the tg test continues (n-gram drafting likes repeats).")
@click.option("--rpc", default=None, metavar="HOST:PORT,...",
              help="Add llama.cpp RPC workers (`localllm worker`) as devices (default: LOCALLLM_RPC).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def command(model: str, pp: int, tg: int, repetitions: int, kv_cache: str | None, draft: str, num_draft: int,
            num_ctx: int | None, threads: int | None, backend: str, tg_prompt: str, rpc: str | None,
            as_json: bool) -> None:
    """Benchmark MODEL: prompt processing and generation tokens/s, time to first token, per
    KV cache type and draft variant."""
    from localllm import config
    from localllm.api import KV_CACHE_TYPES
    from localllm.cli.answer import ensure_model
    from localllm.hardware import BACKEND_CHOICES as BACKENDS

    kvs = [k.lower() for k in _split_list(kv_cache)] or [config.kv_cache_type()]
    for k in kvs:
        if k not in KV_CACHE_TYPES:
            raise LocalLLMError(f"Unknown KV cache type {k!r}: choose from {', '.join(KV_CACHE_TYPES)}.")
    drafts = _split_list(draft) or ["none"]
    if backend not in BACKENDS:
        raise LocalLLMError(f"Unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}.")
    for label, value, low in (("--pp", pp, 1), ("--tg", tg, 1), ("--repetitions", repetitions, 1),
                              ("--num-draft", num_draft, 1)):
        if value < low:
            raise LocalLLMError(f"{label} must be at least {low}, got {value}.")
    if num_ctx is None:
        num_ctx = max(2048, pp + tg + 64)
    import os

    if rpc is not None or os.environ.get("LOCALLLM_RPC"):
        from localllm.devices import use_workers

        use_workers(rpc, say=lambda line: click.echo(line, err=True))

    from localllm.cli.display import ConversionDisplay, isatty
    from localllm.engine import Engine
    from localllm.local import LocalModels, LocalRunner

    engine = Engine(keep_alive=float("inf"), on_convert=ConversionDisplay())
    runner = LocalRunner(engine)
    try:
        name = ensure_model(LocalModels(engine.store), model).name
        err = sys.stderr

        def progress(v: Variant, rep: int) -> None:
            if not as_json and isatty(err):
                err.write(f"\r{v.kv_cache_type}/{v.draft}: repetition {rep + 1}/{repetitions} "
                          f"pp {v.pp_tps[-1]:.1f} tg {v.tg_tps[-1]:.1f} tok/s   ")
                err.flush()

        results = []
        report_backend = "?"
        threads_used = threads
        for kv in kvs:
            for d in drafts:
                v = run_variant(runner, name, Variant(kv, d), pp=pp, tg=tg, repetitions=repetitions,
                                num_ctx=num_ctx, num_thread=threads, num_draft=num_draft, backend=backend,
                                tg_prompt=tg_prompt, progress=progress)
                for running in runner.ps():
                    report_backend = running.backend
                    threads_used = running.n_threads
                results.append(v.as_dict())
                if not as_json:  # a line per finished variant, so a long run shows its progress
                    r = results[-1]
                    line = (f"{kv}/{d}: {r['error']}" if "error" in r else
                            f"{kv}/{d}: pp {_fmt(r['pp_tps'])} tok/s, tg {_fmt(r['tg_tps'])} tok/s, "
                            f"TTFT {_fmt(r['ttft_ms'])} ms")
                    err.write(("\r" if isatty(err) else "") + line + "\n")
                    err.flush()
        if not as_json and isatty(err):
            err.write("\r" + " " * 78 + "\r")
        report = {
            "model": name,
            "backend": report_backend,
            "n_threads": threads_used,
            "pp": pp,
            "tg": tg,
            "repetitions": repetitions,
            "num_draft": num_draft,
            "results": results,
        }
        if as_json:
            click.echo(json.dumps(report, indent=2))
        else:
            render_table(report)
        if all("error" in r for r in results):
            raise LocalLLMError(results[0]["error"])
    finally:
        runner.close()
