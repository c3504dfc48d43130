"""Across two RPC workers on loopback: decode and prefill through localllm vs ``llama-bench --rpc ... -ngl 99`` on
the same build (the ceiling), and vs the local CPU; the planner's estimate vs llama.cpp's allocation per device.

    CMAKE_ARGS="... -DGGML_RPC=on" LOCALLLM_BENCH_TOOLS=~/.cache/localllm-bench/llama.cpp-0.3.36-rpc \\
        python benchmarks/rpc.py [--model smollm2:135m] [--pp 64] [--tg 32] [-r 3]

Absolute figures on loopback mean little (every op crosses a socket); the ratios and the memory are the point.
Each measurement runs in its own process, one after the other (two llama.cpp drivers in one process slow each
other); the workers run with 1 thread each, the local CPU runs with the default threads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_tools  # noqa: E402
from _common import ROOT, default_threads, load_average  # noqa: E402
from _serve import rpc_workers  # noqa: E402


def _localllm_bench(model: str, pp: int, tg: int, reps: int, rpc: str | None) -> dict:
    cmd = [sys.executable, "-m", "localllm", "bench", model, "--pp", str(pp), "--tg", str(tg), "-r", str(reps),
           "--json"] + (["--rpc", rpc] if rpc else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    return dict(json.loads(out.stdout)["results"][0])


def _tps(v: dict, key: str) -> float:
    return float(v[key]["mean"])


_ALLOC = textwrap.dedent("""
    import json, os, sys
    from localllm import devices
    devices.use_workers(sys.argv[2])
    from localllm.engine import Engine
    from localllm.loader import LoadOptions
    e = Engine()
    rm = e.load(sys.argv[1], LoadOptions(num_ctx=int(sys.argv[3]), num_parallel=int(sys.argv[4])))
    alloc = rm.model.info.allocations
    print(json.dumps([{"name": d.name, "layers": d.layers, "estimate": d.total,
                       "allocated": sum(alloc.get(d.name, {}).values())} for d in rm.plan.devices]))
    os._exit(0)
""")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--pp", type=int, default=64)
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    args = ap.parse_args()
    from localllm.cli.answer import ensure_model
    from localllm.local import LocalModels
    from localllm.store import Store

    path = ensure_model(LocalModels(Store()), args.model).path
    threads = default_threads()
    print(f"model {args.model} ({path}), local threads {threads}, load {load_average()}")
    procs, rpc = rpc_workers(2)
    try:
        rows = []
        for label, extra, our_rpc in (("2 RPC workers (loopback)", ["-ngl", "99", "--rpc", rpc], rpc),
                                      ("local CPU", ["-ngl", "0"], None)):
            ref = llama_tools.llama_bench(path, threads=threads, n_prompt=args.pp, n_gen=args.tg,
                                          reps=args.repetitions, extra=extra)
            ref_pp = next(r["avg_ts"] for r in ref if r["n_prompt"] and not r["n_gen"])
            ref_tg = next(r["avg_ts"] for r in ref if r["n_gen"] and not r["n_prompt"])
            ours = _localllm_bench(args.model, args.pp, args.tg, args.repetitions, our_rpc)
            rows.append((label, _tps(ours, "pp_tps"), ref_pp, _tps(ours, "tg_tps"), ref_tg))
        print(f"{'where':28} {'pp ours':>9} {'pp llama':>9} {'ratio':>6} {'tg ours':>9} {'tg llama':>9} {'ratio':>6}")
        for label, opp, rpp, otg, rtg in rows:
            print(f"{label:28} {opp:9.1f} {rpp:9.1f} {opp / rpp:6.2f} {otg:9.1f} {rtg:9.1f} {otg / rtg:6.2f}")
        remote, local = rows
        print(f"remote vs local CPU through localllm: pp {remote[1] / local[1]:.2f}x, tg {remote[3] / local[3]:.2f}x")
        for ctx, slots in ((512, 1), (512, 4), (2048, 1)):
            out = subprocess.run([sys.executable, "-c", _ALLOC, args.model, rpc, str(ctx), str(slots)],
                                 capture_output=True, text=True, check=True, cwd=ROOT)
            for d in json.loads(out.stdout.strip().splitlines()[-1]):
                print(f"num_ctx {ctx} × {slots} slots  {d['name']}: {d['layers']} layers, estimate "
                      f"{d['estimate'] / 2**20:.1f} MiB, allocated {d['allocated'] / 2**20:.1f} MiB "
                      f"({d['estimate'] / d['allocated'] - 1:+.1%})")
    finally:
        for p in procs:
            p.kill()


if __name__ == "__main__":
    os.environ.setdefault("LOCALLLM_PROMPT_CACHE_SIZE", "0")
    main()
