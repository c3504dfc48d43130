"""Decode tokens/s: localllm's `run` path (engine + backend + the streaming writer of `localllm run`)
against raw llama-cpp-python ``Llama.generate`` on the same GGUF file, context, batch and threads, with
llama.cpp's own ``llama-bench`` (tg, same file and threads) as the ceiling.

Each side runs in its own process (two threads driving llama.cpp in one process slow each other: each
calling thread gets its own OpenMP team), and the rounds alternate: ours, raw, llama-bench, ours, raw, ...
so that the load of a shared machine hits all of them alike. Greedy sampling with the same penalties on
both Python sides; each side's rate is the wall-clock rate between its first and its last generated token,
so load and prompt time are left out. ``llama-bench`` reports its own tg rate (one repetition per round,
after its warm-up), once with its default flash attention (auto) and once with ``-fa off`` (what our
backend used before it left flash attention to llama.cpp); pp512 is measured once at the end for reference.
The raw side gets the flash-attention setting llama.cpp chose for ours (auto), and ours keeps its default
slots (its KV pool is n_ctx × slots cells; one sequence decodes) unless ``--num-parallel`` sets them.

    python benchmarks/decode_vs_raw.py                       # default model, 5 rounds of 128 tokens
    python benchmarks/decode_vs_raw.py --rounds 10 --tokens 128 --threads 2
    python benchmarks/decode_vs_raw.py --model ./x.gguf --no-llama-bench

Reported: median of each side, ratio of medians, best vs best, and the median of the per-round ratios.
Targets: ours / raw >= 0.97; ours / llama-bench tg (auto) >= 0.97 (issue 11).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from _common import ClockWriter, Side, default_threads, engine_and_model, load_average, median, spread

PROMPT = ("The following is a long, detailed essay about the history of the bicycle, from the first "
          "draisine of 1817 to modern carbon racing frames.\n\n")
SAMPLING = dict(temperature=0.0, top_k=40, top_p=0.9, min_p=0.0, repeat_penalty=1.1, repeat_last_n=64)


class Ours:
    """The engine and `localllm run`'s streaming path, in its own process."""

    def __init__(self, model: str, num_ctx: int, threads: int, num_parallel: int | None = None):
        from localllm.loader import LoadOptions

        self.engine, self.name, _ = engine_and_model(model)
        self.options = LoadOptions(num_ctx=num_ctx, draft="none", num_thread=threads, kv_cache_type="f16",
                                   num_parallel=num_parallel)
        self.running = self.engine.load(self.name, self.options)

    def info(self) -> dict[str, Any]:
        """What the raw side must match: context, batch, threads, GPU layers and whether llama.cpp turned flash
        attention on (our backend leaves it on auto; the raw ``Llama`` takes a bool)."""
        src = self.running.model.source  # the token source of the model's decode loop
        spec = src.spec
        return {"n_ctx": self.running.info.n_ctx, "n_batch": spec.n_batch,
                "n_threads": spec.n_threads or getattr(src, "n_threads", None),
                "flash_attn": bool(getattr(src, "flash_attn", spec.flash_attn)), "n_gpu_layers": spec.n_gpu_layers}

    def slots(self) -> int:
        return int(self.running.metrics.slots)

    def run(self, tokens: int) -> dict[str, Any]:
        from localllm.api import GenerateRequest, Sampling
        from localllm.cli.answer import stream_answer

        req = GenerateRequest(prompt=PROMPT, sampling=Sampling(max_tokens=tokens, seed=0, **SAMPLING))
        clock = ClockWriter()
        answer = stream_answer(self.engine, self.name, req, self.options, out=clock)
        n = answer.done.stats.eval_count
        assert clock.first is not None and clock.last is not None
        return {"rate": (n - 1) / (clock.last - clock.first), "stats_rate": answer.done.stats.eval_rate, "n": n,
                "finish": answer.done.finish_reason}

    def close(self) -> None:
        self.engine.close()


class Raw:
    """llama-cpp-python's own ``Llama.generate``, driven from the main thread of its own process."""

    def __init__(self, path: str, n_ctx: int, n_batch: int, n_threads: int, flash_attn: bool, n_gpu_layers: int):
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads,
                                   n_threads_batch=n_threads, flash_attn=flash_attn, n_gpu_layers=n_gpu_layers,
                                   verbose=False)
        self.tokens = self.llm.tokenize(PROMPT.encode(), add_bos=True, special=False)

    def run(self, tokens: int) -> dict[str, Any]:
        t_first = t_last = 0.0
        i = 0
        for i, _tok in enumerate(self.llm.generate(self.tokens, temp=0.0, top_k=40, top_p=0.9, min_p=0.0,
                                                   repeat_penalty=1.1, reset=True)):
            now = time.perf_counter()
            if i == 0:
                t_first = now
            t_last = now
            if i + 1 >= tokens:
                break
        return {"rate": i / (t_last - t_first), "n": i + 1}

    def close(self) -> None:
        self.llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="default: physical cores (the backend's default)")
    ap.add_argument("--num-ctx", type=int, default=2048)
    ap.add_argument("--num-parallel", type=int, default=None, help="our slots (default: the planner's)")
    ap.add_argument("--no-llama-bench", action="store_true", help="skip the llama-bench ceiling")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    threads = args.threads or default_threads()

    _engine, name, path = engine_and_model(args.model)  # pulls an alias if missing, before any side starts
    del _engine
    print(f"load average at start: {load_average()}", flush=True)
    ours = Side("localllm", Ours, model=args.model, num_ctx=args.num_ctx, threads=threads,
                num_parallel=args.num_parallel)
    info = ours.call("info")
    slots = ours.call("slots")
    raw = Side("raw Llama.generate", Raw, path=str(path), **info)
    bench = None
    if not args.no_llama_bench:
        import llama_tools

        llama_tools.build()  # before the timed rounds: building is minutes of both cores
        bench = llama_tools
    results: dict[str, list[float]] = {"ours": [], "ours_stats": [], "raw": [], "lb_auto": [], "lb_off": []}
    try:
        ours.call("run", tokens=8)  # warm-up
        raw.call("run", tokens=8)
        for r in range(args.rounds):
            o = ours.call("run", tokens=args.tokens)
            if o["finish"] != "length":
                print(f"note: our run stopped early ({o['finish']}, {o['n']} tokens)")
            w = raw.call("run", tokens=args.tokens)
            results["ours"].append(o["rate"])
            results["ours_stats"].append(o["stats_rate"])
            results["raw"].append(w["rate"])
            line = (f"round {r + 1}: localllm {o['rate']:7.2f} tok/s (stats {o['stats_rate']:7.2f})   "
                    f"raw {w['rate']:7.2f}   ours/raw {o['rate'] / w['rate']:.3f}")
            if bench is not None:
                recs = bench.llama_bench(path, threads=threads, flash_attn="auto,off", n_prompt=0,
                                         n_gen=args.tokens, reps=1)
                by_fa = {int(rec["flash_attn"]): rec["avg_ts"] for rec in recs}  # -1 auto, 0 off, 1 on
                lb_auto, lb_off = by_fa.get(-1, float("nan")), by_fa.get(0, float("nan"))
                results["lb_auto"].append(lb_auto)
                results["lb_off"].append(lb_off)
                line += f"   llama-bench tg{args.tokens} fa auto {lb_auto:7.2f}, fa off {lb_off:7.2f}"
            print(line, flush=True)
    finally:
        ours.close()
        raw.close()
    pp = None
    if bench is not None:
        pp = {rec["flash_attn"]: (rec["avg_ts"], rec["stddev_ts"])
              for rec in bench.llama_bench(path, threads=threads, flash_attn="auto,off", n_prompt=512, n_gen=0,
                                           reps=3)}

    mo, mr = median(results["ours"]), median(results["raw"])
    print(f"\nmodel {name} ({Path(path).name}), {threads} threads, n_ctx {info['n_ctx']} (ours: {slots} slots), "
          f"flash attention {'on' if info['flash_attn'] else 'off'} (ours and raw), {args.tokens} tokens, "
          f"{args.rounds} rounds, each side in its own process, alternating")
    print(f"load average at end: {load_average()}")
    print(f"localllm run path : median {mo:7.2f} tok/s   per round {spread(results['ours'])}")
    print(f"raw Llama.generate: median {mr:7.2f} tok/s   per round {spread(results['raw'])}")
    pair = [o / r for o, r in zip(results["ours"], results["raw"], strict=True)]
    print(f"ours / raw        : ratio of medians {mo / mr:.3f}   best vs best "
          f"{max(results['ours']) / max(results['raw']):.3f}   per-round ratios {spread(pair)}   (target >= 0.97)")
    out: dict[str, Any] = {"model": name, "threads": threads, "tokens": args.tokens, **results,
                           "ratio_medians": mo / mr, "ratio_best": max(results["ours"]) / max(results["raw"])}
    if bench is not None:
        for key, label in (("lb_auto", "fa auto (llama.cpp default)"), ("lb_off", "fa off")):
            ml = median(results[key])
            print(f"llama-bench tg{args.tokens} {label:28}: median {ml:7.2f} tok/s   ours / it: ratio of medians "
                  f"{mo / ml:.3f}, best vs best {max(results['ours']) / max(results[key]):.3f}")
            out[f"ratio_{key}"] = mo / ml
        if pp:
            print("llama-bench pp512 (once, -r 3): " + ", ".join(
                f"fa {'auto' if int(k) == -1 else 'off'} {v[0]:.1f} ± {v[1]:.1f} tok/s" for k, v in pp.items()))
            out["pp512"] = {str(k): v for k, v in pp.items()}
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
