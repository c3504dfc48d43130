"""What the HTTP layer costs: streamed decode tokens/s and time to first token through ``/api/chat``
(``localllm serve`` in a subprocess) versus the same engine in-process, same model, threads, prompt
and sampling. Targets: tokens/s ratio ≥ 0.95, added TTFT ≤ 10 ms.

    python benchmarks/server_overhead.py [--model smollm2:135m] [--tokens 128] [--reps 5] [--threads 2] [--fake]

``--fake`` swaps the backend (server and in-process alike) for the instant fake one, one character per
token: what is left is the server's own cost per token and per request, free of the model's speed
and of the noise of a busy machine.

Client-side clocks on both sides: TTFT = request sent → first text; decode tokens/s = (chunks − 1) /
(last text − first text). Reps alternate server / in-process; medians are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = "Write a long story about a dragon who learns to bake bread."


_local = threading.local()


def _client():
    """One keep-alive connection pool per thread, as a real client keeps (and not httpx's per-call setup)."""
    import httpx

    if not hasattr(_local, "client"):
        _local.client = httpx.Client(timeout=600)
    return _local.client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FAKE_SERVER = """
import sys
sys.path.insert(0, {root!r})
from benchmarks.server_overhead import fake_backend_class
from localllm.engine import Engine
from localllm.server.run import serve
serve({addr!r}, engine=Engine(keep_alive=float('inf'), backend_class=fake_backend_class), log_level='warning')
"""


def fake_backend_class(name: str):
    from tests.fakes import FakeSource

    class Instant(FakeSource):
        def __init__(self, spec):
            super().__init__(spec, reply="x" * 100_000, chunk=1)

    return Instant


def start_server(port: int, threads: int, fake: bool = False) -> subprocess.Popen:
    env = {**os.environ, "LOCALLLM_HOST": f"127.0.0.1:{port}", "LOCALLLM_KEEP_ALIVE": "-1"}
    cmd = [sys.executable, "-m", "localllm", "serve"]
    if fake:
        cmd = [sys.executable, "-c", FAKE_SERVER.format(root=str(ROOT), addr=f"127.0.0.1:{port}")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import httpx

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not start")


def via_http(url: str, model: str, tokens: int, threads: int) -> tuple[float, float, int]:

    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}],
            "options": {"temperature": 0, "seed": 1, "num_predict": tokens, "num_thread": threads}}
    first = last = None
    n = 0
    t0 = time.perf_counter()
    with _client().stream("POST", url + "/api/chat", json=body) as r:
        for line in r.iter_lines():
            obj = json.loads(line)
            if obj.get("message", {}).get("content"):
                now = time.perf_counter()
                first = first or now
                last = now
                n += 1
    return first - t0, (n - 1) / (last - first) if last > first else 0.0, n


def in_process(engine, model: str, tokens: int, threads: int) -> tuple[float, float, int]:
    from localllm.api import GenerateRequest, Sampling, TextChunk
    from localllm.loader import LoadOptions

    req = GenerateRequest(messages=[{"role": "user", "content": PROMPT}],
                          sampling=Sampling(temperature=0, seed=1, max_tokens=tokens))
    first = last = None
    n = 0
    t0 = time.perf_counter()
    for ev in engine.generate(model, req, LoadOptions(num_thread=threads)):
        if isinstance(ev, TextChunk) and ev.text:
            now = time.perf_counter()
            first = first or now
            last = now
            n += 1
    return first - t0, (n - 1) / (last - first) if last > first else 0.0, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fake", action="store_true", help="instant fake backend: the server's own overhead only")
    args = ap.parse_args()

    from localllm.engine import Engine

    port = free_port()
    server = start_server(port, args.threads, args.fake)
    url = f"http://127.0.0.1:{port}"
    engine = Engine(keep_alive=float("inf"), backend_class=fake_backend_class if args.fake else None)
    try:
        via_http(url, args.model, 8, args.threads)  # load + warm both
        in_process(engine, args.model, 8, args.threads)
        http, local = [], []
        for _ in range(args.reps):
            http.append(via_http(url, args.model, args.tokens, args.threads))
            local.append(in_process(engine, args.model, args.tokens, args.threads))
        # the fixed cost of a request: many 1-token requests (the prompt is cached: no prompt work)
        short_h = [via_http(url, args.model, 1, args.threads)[0] for _ in range(args.reps * 6)]
        short_l = [in_process(engine, args.model, 1, args.threads)[0] for _ in range(args.reps * 6)]
    finally:
        server.terminate()
        server.wait(10)
        engine.close()

    def med(rows, i):
        return statistics.median(r[i] for r in rows)

    ttft_h, ttft_l = med(http, 0) * 1000, med(local, 0) * 1000
    tps_h, tps_l = med(http, 1), med(local, 1)
    what = "fake backend" if args.fake else "model " + args.model
    print(f"{what}, {args.tokens} tokens, {args.threads} threads, {args.reps} reps (medians)")
    print(f"  chunks per run      http {med(http, 2):.0f}   in-process {med(local, 2):.0f}")
    print(f"  decode tokens/s     http {tps_h:.1f}   in-process {tps_l:.1f}   ratio {tps_h / tps_l:.3f}"
          "  (target >= 0.95)")
    print(f"  TTFT ms             http {ttft_h:.1f}   in-process {ttft_l:.1f}   added {ttft_h - ttft_l:.1f} ms"
          "  (target <= 10)")
    sh, sl = statistics.median(short_h) * 1000, statistics.median(short_l) * 1000
    print(f"  TTFT ms, 1-token    http {sh:.2f}   in-process {sl:.2f}   added {sh - sl:.2f} ms"
          f"  ({len(short_h)} requests each)")
    print("  all http tok/s:", ", ".join(f"{r[1]:.1f}" for r in http))
    print("  all local tok/s:", ", ".join(f"{r[1]:.1f}" for r in local))


if __name__ == "__main__":
    main()
