"""Where one decode step's time goes, in-process (no HTTP), at B streams: the loop's step split into
``llama_decode`` (C), sampling, the streams' token handling (stops, UTF-8, tools, thinking, events) and the
rest of the loop, by wrapping those calls with a clock; then cProfile on the loop thread for the same
workload (its own run: cProfile's hooks slow Python ~2x, so its numbers are shares, not times); and
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


def _timed(obj: Any, name: str, acc: dict[str, float]) -> Callable[[], None]:
    """Wrap ``obj.name`` with a clock; only calls made during decode-only steps count (``acc["decoding"]``)."""
    real = getattr(obj, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        if name == "evaluate":  # a step of one token per sequence (no prompt chunk): a decode step
            acc["decoding"] = float(all(len(f.tokens) == 1 for f in a[-1]))
            acc["decode_steps"] = acc.get("decode_steps", 0.0) + acc["decoding"]
        t = time.perf_counter_ns()
        try:
            return real(*a, **k)
        finally:
            if acc.get("decoding"):
                acc[name] = acc.get(name, 0.0) + time.perf_counter_ns() - t

    setattr(obj, name, wrapper)
    return lambda: setattr(obj, name, real)


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
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from backends.contract.specs import LoadSpec
    from backends.registry import load

    threads = args.threads or default_threads()
    gguf = model_path(args.model)
    bias = {t: -100.0 for t in Tokens(gguf).eog()}
    streams = [int(x) for x in args.streams.split(",")]
    out: dict[str, Any] = {"threads": threads, "load_before": load_avg(), "rows": {}}
    m = load("llamacpp", LoadSpec(str(gguf), n_ctx=2048, slots=max(streams), n_threads=threads,
                                  n_threads_batch=threads))
    try:
        run(m, 1, 8, bias, 900)  # warm-up
        for b in streams:
            acc: dict[str, float] = {}
            src = m.source
            undo = [_timed(src, "evaluate", acc)]
            steps0 = m.metrics().steps

            def patch(_s: Any, acc: dict[str, float] = acc, undo: list[Callable[[], None]] = undo) -> None:
                from backends.core import stream as stream_mod
                from backends.llamacpp.sampling import ChainSampler

                undo.append(_timed(ChainSampler, "sample", acc))
                undo.append(_timed(stream_mod.RequestStream, "push", acc))

            m.call(patch)
            wall = run(m, b, args.tokens, bias, 100 * b)
            m.call(lambda _s, undo=undo: [u() for u in reversed(undo)])
            steps = m.metrics().steps - steps0
            n_dec = max(1.0, acc.get("decode_steps", 1.0))
            per = {k: v / n_dec / 1e6 for k, v in acc.items()}  # ms per decode step
            step_ms = wall * 1e3 / max(1, args.tokens - 1)  # (each stream's tokens: one per step)
            row = {"steps": steps, "step_ms": step_ms, "tok_s": b * args.tokens / wall,
                   "decode_ms": per.get("evaluate", 0.0), "sample_ms": per.get("sample", 0.0),
                   "push_ms": per.get("push", 0.0)}
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
                                               parallel=tuple(streams), n_ctx=2048 * max(streams))
        for r in recs:
            if r["pl"] in out["rows"]:
                out["rows"][r["pl"]]["batched_bench_tok_s"] = r["speed_tg"]
                out["rows"][r["pl"]]["batched_bench_step_ms"] = 1e3 * r["pl"] / r["speed_tg"]
    out["load_after"] = load_avg()
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"{threads} threads; load {out['load_before']} -> {out['load_after']}")
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
