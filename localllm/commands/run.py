"""``localllm run MODEL [PROMPT...]``: like ``ollama run``.

One-shot when a prompt is given or stdin is piped (stdin first, then the prompt words, joined by a
space, as Ollama does); otherwise the interactive ``>>>`` prompt (:mod:`localllm.interactive`).
A missing model is pulled first, with the same progress display as ``localllm pull``.

    $ localllm run smollm2:135m "Why is the sky blue?"
    $ echo "Some text" | localllm run smollm2:135m "Summarise:" --verbose
    $ localllm run ./model.gguf --draft ngram --kv-cache q8_0

Output: the answer streams to stdout as it arrives; when stdout is not a terminal it is just the
text. ``--verbose`` prints Ollama's stats block to stderr, plus the prompt-cache and draft lines.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any

import click

from localllm.errors import LocalLLMError

BACKENDS = ("auto", "llamacpp", "mlx")


# ------------------------------------------------------------------------------------------ formatting


def go_duration(ns: int | float) -> str:
    """Format nanoseconds the way Go's ``time.Duration.String`` does (Ollama prints its stats so).

    >>> go_duration(0), go_duration(5_000_000), go_duration(130_869_000), go_duration(1_234_567_891)
    ('0s', '5ms', '130.869ms', '1.234567891s')
    >>> go_duration(62_500_000_000), go_duration(3_600_000_000_000), go_duration(999), go_duration(1500)
    ('1m2.5s', '1h0m0s', '999ns', '1.5µs')
    """
    ns = int(ns)
    if ns == 0:
        return "0s"
    sign = "-" if ns < 0 else ""
    u = abs(ns)

    def frac(value: int, digits: int) -> str:
        whole, rest = divmod(value, 10**digits)
        tail = f"{rest:0{digits}d}".rstrip("0")
        return f"{whole}.{tail}" if tail else str(whole)

    if u < 1_000:
        return f"{sign}{u}ns"
    if u < 1_000_000:
        return f"{sign}{frac(u, 3)}µs"
    if u < 1_000_000_000:
        return f"{sign}{frac(u, 6)}ms"
    hours, rem = divmod(u, 3_600_000_000_000)
    minutes, rem = divmod(rem, 60_000_000_000)
    out = frac(rem, 9) + "s"
    if hours or minutes:
        out = f"{minutes}m" + out
    if hours:
        out = f"{hours}h" + out
    return sign + out


def stats_lines(stats: Any) -> list[str]:
    """Ollama's ``--verbose`` block (``api.Metrics.Summary``) plus our prompt-cache and draft lines.

    Ollama prints a line only when its value is non-zero; so do we. The prompt eval rate counts the
    tokens actually evaluated (cached ones excluded), which is what the duration measured.
    """
    lines: list[str] = []
    if stats.total_duration > 0:
        lines.append(f"total duration:       {go_duration(stats.total_duration)}")
    if stats.load_duration > 0:
        lines.append(f"load duration:        {go_duration(stats.load_duration)}")
    if stats.prompt_eval_count > 0:
        lines.append(f"prompt eval count:    {stats.prompt_eval_count} token(s)")
    if stats.prompt_eval_duration > 0:
        lines.append(f"prompt eval duration: {go_duration(stats.prompt_eval_duration)}")
        lines.append(f"prompt eval rate:     {stats.prompt_eval_rate:.2f} tokens/s")
    if stats.eval_count > 0:
        lines.append(f"eval count:           {stats.eval_count} token(s)")
    if stats.eval_duration > 0:
        lines.append(f"eval duration:        {go_duration(stats.eval_duration)}")
        lines.append(f"eval rate:            {stats.eval_rate:.2f} tokens/s")
    lines.append(f"prompt cache:         {stats.prompt_cached_tokens} token(s) reused")
    if stats.draft_proposed:
        lines.append(
            f"draft acceptance:     {stats.draft_accepted / stats.draft_proposed:.2%} "
            f"({stats.draft_accepted}/{stats.draft_proposed} token(s))"
        )
    return lines


def print_stats(stats: Any, err: IO[str] | None = None) -> None:
    err = err or sys.stderr
    err.write("\n".join(stats_lines(stats)) + "\n")
    err.flush()


def overflow_note(stats: Any) -> str | None:
    """The stderr line for turns dropped to fit the context, or None."""
    n = getattr(stats, "dropped_messages", 0)
    if not n:
        return None
    return (f"Note: the conversation no longer fits the {stats.n_ctx}-token context; "
            f"the {n} oldest message(s) were left out of this answer.")


# ------------------------------------------------------------------------------------------ streaming


@dataclass
class Answer:
    """What one generation produced."""

    text: str = ""
    done: Any = None  # engine.Done
    cancelled: bool = False
    first_token_s: float | None = None  # seconds from the call to the first text
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


_END = object()


def stream_answer(
    engine: Any,
    name: str,
    request: Any,
    options: Any = None,
    *,
    out: IO[str] | None = None,
    cancel: threading.Event | None = None,
    keep_alive: float | None = None,
) -> Answer:
    """Run one generation, writing text to ``out`` as it arrives (flushed per piece).

    The generation runs in a worker thread so that Ctrl+C (KeyboardInterrupt in the main thread)
    is seen at once: it sets ``cancel``, the backend stops at its next token, and the partial
    answer comes back with ``cancelled=True``. Errors raised by the engine are re-raised here.

    >>> # answer = stream_answer(engine, "smollm2:135m", GenerateRequest(prompt="Hi"), out=sys.stdout)
    """
    from localllm.engine import Done, TextChunk, ToolCalls

    cancel = cancel or threading.Event()
    q: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def work() -> None:
        gen = engine.generate(name, request, options, cancel=cancel, keep_alive=keep_alive)
        try:
            for event in gen:
                q.put(event)
        except BaseException as e:  # delivered to the caller's thread
            q.put(e)
        finally:
            gen.close()
            q.put(_END)

    answer = Answer()
    parts: list[str] = []
    t0 = time.perf_counter()
    worker = threading.Thread(target=work, name="localllm-run", daemon=True)
    worker.start()
    error: BaseException | None = None
    while True:
        try:
            item = q.get()
            if item is _END:
                break
            if isinstance(item, BaseException):
                error = item
            elif isinstance(item, TextChunk):
                if answer.first_token_s is None:
                    answer.first_token_s = time.perf_counter() - t0
                parts.append(item.text)
                if out is not None:
                    out.write(item.text)
                    out.flush()
            elif isinstance(item, ToolCalls):
                answer.tool_calls.extend(item.calls)
            elif isinstance(item, Done):
                answer.done = item
        except KeyboardInterrupt:
            cancel.set()
            answer.cancelled = True
    while worker.is_alive():
        try:
            worker.join()
        except KeyboardInterrupt:
            cancel.set()
            answer.cancelled = True
    answer.text = "".join(parts)
    if answer.done is not None and answer.done.finish_reason == "cancelled":
        answer.cancelled = True
    if error is not None:
        raise error
    return answer


# ------------------------------------------------------------------------------------------ models


def ensure_model(store: Any, name: str) -> Any:
    """The installed model for ``name``; a missing catalog/Hub model is pulled first (with the pull
    command's progress display). A local path is never pulled: it is read in place or refused, and
    an unknown alias fails in pull with its suggestions."""
    from localllm.errors import ModelNotFoundError

    try:
        return store.get(name)
    except ModelNotFoundError:
        from localllm.names import parse_name

        if parse_name(name, allow_path=True).kind == "path":
            raise
    from localllm.commands.pull import pull_with_progress

    pull_with_progress(store, name)
    return store.get(name)


# ------------------------------------------------------------------------------------------ options


@dataclass
class RunSettings:
    """Everything ``run`` and the REPL need beyond the model name."""

    sampling: Any  # engine.Sampling
    load: Any  # engine.LoadOptions
    system: str | None = None
    format: str | None = None
    verbose: bool = False
    keep_alive: float | None = None


def build_settings(
    *,
    temperature: float | None = None,
    seed: int | None = None,
    num_predict: int | None = None,
    num_ctx: int | None = None,
    system: str | None = None,
    fmt: str | None = None,
    draft: str | None = None,
    num_draft: int | None = None,
    kv_cache: str | None = None,
    backend: str = "auto",
    verbose: bool = False,
    keepalive: str | None = None,
) -> RunSettings:
    """Validate the flags (one sentence per mistake) and turn them into engine options.

    >>> s = build_settings(temperature=0, seed=1, kv_cache="q8_0")
    >>> s.sampling.temperature, s.sampling.seed, s.load.kv_cache_type
    (0, 1, 'q8_0')
    """
    from localllm.engine import KV_CACHE_TYPES, LoadOptions, Sampling, parse_keep_alive

    if kv_cache is not None and kv_cache.lower() not in KV_CACHE_TYPES:
        raise LocalLLMError(f"Unknown KV cache type {kv_cache!r}: choose one of {', '.join(KV_CACHE_TYPES)}.")
    if backend not in BACKENDS:
        raise LocalLLMError(f"Unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}.")
    if fmt is not None and fmt != "json":
        raise LocalLLMError(f"Unknown format {fmt!r}: only 'json' is supported.")
    if num_ctx is not None and num_ctx < 1:
        raise LocalLLMError(f"--num-ctx must be a positive number of tokens, got {num_ctx}.")
    if num_draft is not None and num_draft < 1:
        raise LocalLLMError(f"--num-draft must be at least 1, got {num_draft}.")
    if temperature is not None and temperature < 0:
        raise LocalLLMError(f"--temperature must be 0 or more, got {temperature}.")
    sampling = Sampling()
    if temperature is not None:
        sampling.temperature = temperature
    if seed is not None:
        sampling.seed = seed
    if num_predict is not None:
        sampling.max_tokens = num_predict
    load = LoadOptions(
        num_ctx=num_ctx,
        kv_cache_type=kv_cache.lower() if kv_cache else None,
        backend=backend,
        draft=(draft or "auto").strip() or "auto",
        num_draft=num_draft or 4,
    )
    ka = parse_keep_alive(keepalive) if keepalive not in (None, "") else None
    return RunSettings(sampling=sampling, load=load, system=system, format=fmt, verbose=verbose, keep_alive=ka)


# ------------------------------------------------------------------------------------------ command


@click.command("run", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model")
@click.argument("prompt", nargs=-1)
@click.option("--temperature", type=float, default=None, help="Sampling temperature (0 = greedy).")
@click.option("--seed", type=int, default=None, help="Random seed: the same seed gives the same answer.")
@click.option("--num-predict", type=int, default=None, help="Most tokens to generate (-1 = no limit).")
@click.option("--num-ctx", type=int, default=None, help="Context size in tokens (default: the planner's).")
@click.option("--system", default=None, help="System prompt.")
@click.option("--format", "fmt", default=None, metavar="json", help="Response format: json.")
@click.option("--draft", default=None, metavar="NAME|PATH|ngram|none",
              help="Speculative decoding: a draft model, prompt-lookup (ngram), or none.")
@click.option("--num-draft", type=int, default=None, help="Most tokens the draft proposes per step (default 4).")
@click.option("--kv-cache", default=None, metavar="f16|q8_0|q4_0",
              help="KV cache type (default: LOCALLLM_KV_CACHE_TYPE).")
@click.option("--backend", default="auto", metavar="auto|llamacpp|mlx", help="Inference backend.")
@click.option("--verbose", is_flag=True, help="Print timings and token counts after each answer.")
@click.option("--host", default=None, metavar="URL",
              help="Talk to a localllm or Ollama server there instead of in-process.")
@click.option("--keepalive", default=None, metavar="DURATION",
              help="How long the model stays loaded after an answer (e.g. 5m).")
def command(model: str, prompt: tuple[str, ...], temperature: float | None, seed: int | None,
            num_predict: int | None, num_ctx: int | None, system: str | None, fmt: str | None,
            draft: str | None, num_draft: int | None, kv_cache: str | None, backend: str,
            verbose: bool, host: str | None, keepalive: str | None) -> None:
    """Run MODEL: answer PROMPT (or piped stdin) once, else chat interactively.

    \b
    Examples:
      localllm run smollm2:135m "Why is the sky blue?"
      cat notes.txt | localllm run smollm2:135m "Summarise this:"
      localllm run ./model.gguf --draft ngram --verbose
    """
    settings = build_settings(
        temperature=temperature, seed=seed, num_predict=num_predict, num_ctx=num_ctx, system=system,
        fmt=fmt, draft=draft, num_draft=num_draft, kv_cache=kv_cache, backend=backend, verbose=verbose,
        keepalive=keepalive,
    )
    prompts = list(prompt)
    piped = not _isatty(sys.stdin)
    if piped:
        data = sys.stdin.read()
        if data:
            prompts.insert(0, data)
    # Ollama: interactive only with nothing to answer and a terminal on both ends
    interactive = not prompts and not piped and _isatty(sys.stdout)

    from localllm.client import RemoteEngine, connect

    client = connect(host)
    if client is not None:
        engine: Any = RemoteEngine(client)
    else:
        from localllm.commands.convert import ConversionDisplay
        from localllm.engine import Engine

        engine = Engine(keep_alive=settings.keep_alive, on_convert=ConversionDisplay())
    try:
        installed = ensure_model(engine.store, model)
        name = getattr(installed, "name", model)
        if interactive:
            from localllm.interactive import Repl

            Repl(engine, name, settings).run()
            return
        text = " ".join(prompts)
        if not text.strip():  # nothing to answer (empty stdin, or stdout redirected): load, as Ollama does
            engine.load(name, settings.load, keep_alive=settings.keep_alive)
            return
        code = one_shot(engine, name, text, settings)
        if code:
            sys.exit(code)
    finally:
        engine.close()


def one_shot(engine: Any, name: str, text: str, settings: RunSettings,
             out: IO[str] | None = None, err: IO[str] | None = None) -> int:
    """Answer ``text`` once; returns the exit status (0, or 130 after Ctrl+C)."""
    from localllm.engine import GenerateRequest

    out = out or sys.stdout
    err = err or sys.stderr
    messages: list[dict[str, Any]] = []
    if settings.system:
        messages.append({"role": "system", "content": settings.system})
    messages.append({"role": "user", "content": text})
    request = GenerateRequest(messages=messages, sampling=settings.sampling, format=settings.format)
    answer = stream_answer(engine, name, request, settings.load, out=out, keep_alive=settings.keep_alive)
    done = answer.done
    if done is not None and done.finish_reason == "error":
        raise LocalLLMError(done.error or "The model stopped with an error.")
    if answer.text and not answer.text.endswith("\n"):
        out.write("\n")
    out.flush()
    if done is not None:
        note = overflow_note(done.stats)
        if note:
            err.write(note + "\n")
        if settings.verbose:
            print_stats(done.stats, err)
    return 130 if answer.cancelled else 0


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
