"""Where one decode step's time goes, in-process (no HTTP), at B streams: the steady steps (all B streams decoding
one token each, none evaluating a prompt) split into ``evaluate`` (the batch filled + ``llama_decode``), sampling,
the streams' token handling (stops, UTF-8, tools, thinking, events) and the rest of the loop (the step's
bookkeeping, handing tokens to the consumers and waiting for them to settle), by wrapping those calls with a clock;
the step is the median time from one steady step's start to the next's. Then cProfile on the loop thread for the
same workload (its own run: cProfile's hooks slow Python ~2x, so its numbers are shares, not times); and
``llama-batched-bench`` at the same B beside (the C ceiling).

    python benchmarks/step_profile.py                       # B = 1, 4, 8; 128 tokens each
    python benchmarks/step_profile.py --streams 1,8 --tokens 96 --top 25

Greedy sampling, EOG kept out by ``logit_bias`` (every stream runs its full length), distinct prompts.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import threading
import time
from collections.abc import Callable
from typing import Any

from _common import default_threads
from _serve import Tokens, load_avg, model_path, story_prompt


def _timed(obj: Any, name: str, acc: dict[str, Any]) -> Callable[[], None]:
    """Wrap ``obj.name`` with a clock; only calls made during steady steps count (``acc["steady"]``: every one of
    ``acc["b"]`` streams decoding one token, no prompt). ``evaluate`` also notes each call's start and whether it
    was steady (``acc["calls"]``), for the time from one steady step to the next."""
    real = getattr(obj, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        t = time.perf_counter_ns()
        if name == "evaluate":
            feeds = a[-1]
            acc["steady"] = len(feeds) == acc["b"] and all(len(f.tokens) == 1 for f in feeds)
            acc["calls"].append((t, acc["steady"]))
        try:
            return real(*a, **k)
        finally:
            if acc.get("steady"):
                acc[name] = acc.get(name, 0.0) + time.perf_counter_ns() - t

    setattr(obj, name, wrapper)
    return lambda: setattr(obj, name, real)


def steady_steps(calls: list[tuple[int, bool]]) -> list[float]:
    """Seconds from each steady step's start to the next's, where both are steady."""
    return [(b[0] - a[0]) / 1e9 for a, b in zip(calls, calls[1:], strict=False) if a[1] and b[1]]


def run(m: Any, b: int, tokens: int, bias: dict[int, float], salt: int) -> float:
    """B streams of ``tokens`` tokens at once; the steps' wall time (first to last token of the run)."""
    from backends.contract.events import TextChunk
    from backends.contract.specs import GenerateRequest, Sampling

    reqs = [GenerateRequest(prompt=story_prompt(salt + i), sampling=Sampling(temperature=0.0, max_tokens=tokens,
                                                                              logit_bias=bias)) for i in range(b)]
    stamps: list[float] = []
    lock = threading.Lock()

    def consume(r: GenerateRequest) -> None:
        for ev in m.generate(r):
            if isinstance(ev, TextChunk):
                with lock:
                    stamps.append(time.perf_counter())

    threads = [threading.Thread(target=consume, args=(r,)) for r in reqs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return max(stamps) - min(stamps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--streams", default="1,4,8")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--flash-attn", choices=("auto", "on", "off"), default="off",
                    help="both sides' flash attention (off: what localllm plans on the CPU)")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from backends.contract.specs import LoadSpec
    from backends.registry import load

    threads = args.threads or default_threads()
    gguf = model_path(args.model)
    bias = {t: -100.0 for t in Tokens(gguf).eog()}
    streams = [int(x) for x in args.streams.split(",")]
    out: dict[str, Any] = {"threads": threads, "flash_attn": args.flash_attn, "load_before": load_avg(), "rows": {}}
    fa = {"auto": None, "on": True, "off": False}[args.flash_attn]
    m = load("llamacpp", LoadSpec(str(gguf), n_ctx=2048, slots=max(streams), n_threads=threads,
                                  n_threads_batch=threads, flash_attn=fa))
    try:
        run(m, 1, 8, bias, 900)  # warm-up
        for b in streams:
            acc: dict[str, Any] = {"b": b, "calls": []}
            src = m.source
            undo = [_timed(src, "evaluate", acc)]
            steps0 = m.metrics().steps

            def patch(_s: Any, acc: dict[str, Any] = acc, undo: list[Callable[[], None]] = undo) -> None:
                from backends.core import stream as stream_mod
                from backends.llamacpp.sampling import ChainSampler

                undo.append(_timed(ChainSampler, "sample", acc))
                undo.append(_timed(stream_mod.RequestStream, "push", acc))

            m.call(patch)
            wall = run(m, b, args.tokens, bias, 100 * b)
            m.call(lambda _s, undo=undo: [u() for u in reversed(undo)])
            steps = m.metrics().steps - steps0
            gaps = sorted(steady_steps(acc["calls"]))
            n_steady = max(1, sum(1 for _, st in acc["calls"] if st))
            per = {k: acc.get(k, 0.0) / n_steady / 1e6 for k in ("evaluate", "sample", "push")}  # ms a steady step
            step_ms = 1e3 * gaps[len(gaps) // 2] if gaps else float("nan")
            row = {"steps": steps, "steady_steps": n_steady, "step_ms": step_ms, "tok_s": 1e3 * b / step_ms,
                   "wall_tok_s": b * args.tokens / wall, "decode_ms": per["evaluate"], "sample_ms": per["sample"],
                   "push_ms": per["push"]}
            row["rest_ms"] = step_ms - row["decode_ms"] - row["sample_ms"] - row["push_ms"]
            prof = cProfile.Profile()
            m.call(lambda _s, p=prof: p.enable())
            run(m, b, args.tokens, bias, 100 * b + 50)
            m.call(lambda _s, p=prof: p.disable())
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
            row["profile"] = s.getvalue()
            out["rows"][b] = row
    finally:
        m.close()
    if not args.no_bench:
        import llama_tools

        recs = llama_tools.llama_batched_bench(gguf, threads=threads, n_prompt=32, n_gen=args.tokens,
                                               parallel=tuple(streams), n_ctx=2048 * max(streams),
                                               flash_attn=args.flash_attn)
        for r in recs:
            if r["pl"] in out["rows"]:
                out["rows"][r["pl"]]["batched_bench_tok_s"] = r["speed_tg"]
                out["rows"][r["pl"]]["batched_bench_step_ms"] = 1e3 * r["pl"] / r["speed_tg"]
    out["load_after"] = load_avg()
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"{threads} threads, flash attention {args.flash_attn}; load {out['load_before']} -> {out['load_after']}; "
          "ms a steady step (all B streams decoding):")
    print(f"{'B':>3}{'step ms':>9}{'decode':>8}{'sample':>8}{'stream':>8}{'rest':>7}{'tok/s':>8}"
          f"{'bb step':>9}{'bb tok/s':>9}{'ratio':>7}")
    for b, r in out["rows"].items():
        bb = r.get("batched_bench_step_ms", float("nan"))
        print(f"{b:>3}{r['step_ms']:>9.3f}{r['decode_ms']:>8.3f}{r['sample_ms']:>8.3f}{r['push_ms']:>8.3f}"
              f"{r['rest_ms']:>7.3f}{r['tok_s']:>8.1f}{bb:>9.3f}{r.get('batched_bench_tok_s', float('nan')):>9.1f}"
              f"{r['tok_s'] / r.get('batched_bench_tok_s', float('nan')):>7.3f}")
    for b, r in out["rows"].items():
        print(f"\n--- cProfile, B={b} (loop thread) ---\n{r['profile']}")


if __name__ == "__main__":
    main()
