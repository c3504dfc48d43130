"""Decode tokens/s: localllm's `run` path (engine + backend + the streaming writer of `localllm run`)
against raw llama-cpp-python ``Llama.generate`` on the same GGUF file, context, batch and threads.

Raw generation runs in a fresh thread per round, as ours does (`stream_answer`'s worker): on a busy
2-core machine llama.cpp decoding from Python's main thread was measured 2-4x slower than from a
worker thread (``--raw-in-main-thread`` shows it).

The two are measured interleaved (ours, raw, ours, raw, ...) in one process so that machine noise hits
both alike. Greedy sampling with the same penalties on both sides; each side's rate is the wall-clock
rate between its first and its last generated token, so load and prompt time are left out of both.

    python benchmarks/decode_vs_raw.py                       # default model, 5 rounds of 128 tokens
    python benchmarks/decode_vs_raw.py --model ./x.gguf --tokens 256 --rounds 7 --threads 2

Target: ratio (ours / raw) >= 0.97.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

from _common import ClockWriter, engine_and_model, mean_std

PROMPT = ("The following is a long, detailed essay about the history of the bicycle, from the first "
          "draisine of 1817 to modern carbon racing frames.\n\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--num-ctx", type=int, default=2048)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--raw-in-main-thread", action="store_true",
                    help="run raw Llama.generate on the main thread (slower under CPU contention, see README)")
    args = ap.parse_args()

    import llama_cpp

    from localllm.commands.run import stream_answer
    from localllm.engine import GenerateRequest, LoadOptions, Sampling

    engine, name, path = engine_and_model(args.model)
    options = LoadOptions(num_ctx=args.num_ctx, draft="none", num_thread=args.threads, kv_cache_type="f16")
    running = engine.load(name, options)
    spec = running.backend.spec
    threads = spec.n_threads
    flash = bool(spec.flash_attn) if spec.flash_attn is not None else False
    raw = llama_cpp.Llama(model_path=str(path), n_ctx=running.info.n_ctx, n_batch=spec.n_batch,
                          n_threads=threads, n_threads_batch=threads, flash_attn=flash,
                          n_gpu_layers=spec.n_gpu_layers, verbose=False)
    sampling = dict(temperature=0.0, top_k=40, top_p=0.9, min_p=0.0, repeat_penalty=1.1, repeat_last_n=64)
    raw_tokens = raw.tokenize(PROMPT.encode(), add_bos=True, special=False)

    def ours() -> tuple[float, float, int]:
        req = GenerateRequest(prompt=PROMPT, sampling=Sampling(max_tokens=args.tokens, seed=0, **sampling))
        clock = ClockWriter()
        answer = stream_answer(engine, name, req, options, out=clock)
        n = answer.done.stats.eval_count
        if answer.done.finish_reason != "length":
            print(f"note: our run stopped early ({answer.done.finish_reason}, {n} tokens)")
        wall = (n - 1) / (clock.last - clock.first)
        return wall, answer.done.stats.eval_rate, n

    def theirs() -> float:
        if args.raw_in_main_thread:
            return theirs_here()
        out: list[float] = []  # like ours (stream_answer's worker), a fresh thread per generation
        th = threading.Thread(target=lambda: out.append(theirs_here()))
        th.start()
        th.join()
        return out[0]

    def theirs_here() -> float:
        t_first = t_last = 0.0
        i = 0
        for i, _tok in enumerate(raw.generate(raw_tokens, temp=0.0, top_k=40, top_p=0.9, min_p=0.0,
                                              repeat_penalty=1.1, reset=True)):
            now = time.perf_counter()
            if i == 0:
                t_first = now
            t_last = now
            if i + 1 >= args.tokens:
                break
        return i / (t_last - t_first)

    ours()  # warm-up both
    theirs()
    ours_wall: list[float] = []
    ours_stats: list[float] = []
    raw_wall: list[float] = []
    for r in range(args.rounds):
        w, s, n = ours()
        rw = theirs()
        ours_wall.append(w)
        ours_stats.append(s)
        raw_wall.append(rw)
        print(f"round {r + 1}: localllm {w:7.2f} tok/s (stats {s:7.2f})   raw Llama.generate {rw:7.2f} tok/s   "
              f"ratio {w / rw:.3f}", flush=True)
    ratio = statistics.fmean(ours_wall) / statistics.fmean(raw_wall)
    print(f"\nmodel {name} ({path.name}), {threads} threads, n_ctx {running.info.n_ctx}, {args.tokens} tokens, "
          f"{args.rounds} rounds")
    print(f"localllm run path : {mean_std(ours_wall)} tok/s (backend stats: {mean_std(ours_stats)})")
    print(f"raw Llama.generate: {mean_std(raw_wall)} tok/s")
    ratios = [o / r for o, r in zip(ours_wall, raw_wall, strict=True)]
    print(f"ratio of means    : {ratio:.3f}  (target >= 0.97)")
    print(f"median round ratio: {statistics.median(ratios):.3f}   best vs best: {max(ours_wall) / max(raw_wall):.3f}"
          "   (robust to other jobs on the machine)")
    if args.json:
        print(json.dumps({"model": name, "threads": threads, "tokens": args.tokens, "ours": ours_wall,
                          "ours_stats": ours_stats, "raw": raw_wall, "ratio": ratio,
                          "median_ratio": statistics.median(ratios), "best_ratio": max(ours_wall) / max(raw_wall)}))
    raw.close()
    engine.close()


if __name__ == "__main__":
    main()
