"""A raw llama-cpp-python decode loop of B sequences (no localllm code): what a step costs with work on another
Python thread beside ``llama_decode``, with the batch's sequences out of id order, and in one unified KV pool
against a stream per sequence. Each case runs in its own process (two llama.cpp users in one process slow each
other); cases alternate over ``--rounds``.

    python benchmarks/beside_decode.py                         # B=8: the work, order and layout cases
    python benchmarks/beside_decode.py --batch 4 --rounds 3

Each case: a 32-token prompt per sequence, then 128 decode steps of one token a sequence; the median ms a step.
"Work" is a thread woken after each step (``--wakes`` times) that spins for ``us`` microseconds while the next
step runs: what the server's asyncio thread does with a step's tokens (benchmarks/README.md, issue 47).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import subprocess
import sys
import threading
import time

from _common import default_threads
from _serve import model_path


def case(path: str, batch: int, threads: int, unified: bool, shuffle: bool, work_us: float, wakes: int) -> float:
    """Median seconds a decode step of ``batch`` sequences, in this process."""
    import llama_cpp

    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 2048 * batch, 2048, 512, batch
    cp.kv_unified, cp.n_threads, cp.n_threads_batch, cp.no_perf = unified, threads, threads, True
    ctx = llama_cpp.llama_init_from_model(model, cp)
    b = llama_cpp.llama_batch_init(2048, 0, 1)

    def decode(toks: list[tuple[int, int, int]]) -> None:
        for i, (s, p, t) in enumerate(toks):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, p, 1, True
            b.seq_id[i][0] = s
        b.n_tokens = len(toks)
        if llama_cpp.llama_decode(ctx, b) != 0:
            raise SystemExit("llama_decode failed")

    jobs: queue.SimpleQueue[int | None] = queue.SimpleQueue()

    def beside() -> None:
        while jobs.get() is not None:
            t = time.perf_counter()
            while time.perf_counter() - t < work_us / 1e6:
                pass

    worker = threading.Thread(target=beside, daemon=True)
    worker.start()
    order = list(range(batch))
    if shuffle:
        random.Random(1).shuffle(order)
    decode([(s, p, 100 + p) for s in range(batch) for p in range(32)])
    steps = []
    for step in range(128):
        t0 = time.perf_counter()
        decode([(s, 32 + step, 200 + step) for s in order])
        steps.append(time.perf_counter() - t0)
        for _ in range(wakes if work_us else 0):
            jobs.put(1)
    jobs.put(None)
    return sorted(steps)[len(steps) // 2]


CASES = {  # name: (unified, shuffle, work_us, wakes)
    "streams": (False, False, 0.0, 0),
    "streams, 100 us beside": (False, False, 100.0, 1),
    "streams, 1 ms beside": (False, False, 1000.0, 1),
    "streams, 8 x 1 ms beside": (False, False, 1000.0, 8),
    "streams, out of order": (False, True, 0.0, 0),
    "unified": (True, False, 0.0, 0),
    "unified, out of order": (True, True, 0.0, 0),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one case, in a child process
    args = ap.parse_args()
    threads = args.threads or default_threads()
    path = str(model_path(args.model))
    if args.case is not None:
        print(json.dumps(case(path, args.batch, threads, *CASES[args.case])))
        return
    out: dict[str, list[float]] = {name: [] for name in CASES}
    for rnd in range(args.rounds):
        names = list(CASES) if rnd % 2 == 0 else list(CASES)[::-1]
        for name in names:
            r = subprocess.run([sys.executable, __file__, "--model", args.model, "--batch", str(args.batch),
                                "--threads", str(threads), "--case", name], capture_output=True, text=True,
                               check=True)
            out[name].append(1e3 * json.loads(r.stdout.strip().splitlines()[-1]))
    print(f"B={args.batch}, {threads} threads, median ms a decode step (rounds alternated):")
    for name, ms in out.items():
        print(f"  {name:26} {' / '.join(f'{x:.1f}' for x in ms)}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
