"""localllm serve against llama-cpp-python's own server (``python -m llama_cpp.server``), same GGUF file,
same threads and context, both through the OpenAI API (``/v1/chat/completions``, streamed).

    python benchmarks/server_vs_llamacpp.py [--model smollm2:135m] [--threads 2] [--tokens 128]
                                            [--reps 3] [--clients 4] [--requests 2] [--rounds 2]
                                            [--soak SECONDS] [--their-interrupt]

Needs llama_cpp.server's dependencies (not a rebuild of llama-cpp-python):
``pip install uvicorn fastapi pydantic-settings sse-starlette starlette-context PyYAML``.

Reports per server: single-stream decode tokens/s and TTFT (client clocks, medians over reps,
interleaved), then ``--clients`` concurrent clients each sending ``--requests`` requests: total
throughput (completion chunks / wall time), request latency p50/p95 and errors. ``--soak N`` repeats
the concurrent load for N seconds on localllm and prints its RSS at start and end.
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

LOG = "/tmp/localllm-bench-servers.log"  # both servers' stderr (a pipe nobody reads would fill up and block)
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


def wait_ready(url: str, proc: subprocess.Popen, probe: str) -> None:
    import httpx

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {Path(LOG).read_text()[-800:]}")
        try:
            if httpx.get(url + probe, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{url} did not start")


def start_localllm(threads: int, n_ctx: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "LOCALLLM_HOST": f"127.0.0.1:{port}", "LOCALLLM_KEEP_ALIVE": "-1"}
    proc = subprocess.Popen([sys.executable, "-m", "localllm", "serve"], env=env,
                            stdout=subprocess.DEVNULL, stderr=open(LOG, "ab"))  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc, "/")
    return proc, url


def start_llamacpp(path: Path, threads: int, n_ctx: int, interrupt: bool) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(path), "--n_threads",
                             str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx),
                             "--host", "127.0.0.1", "--port", str(port), "--model_alias", "bench",
                             "--interrupt_requests", str(interrupt)],
                            stdout=subprocess.DEVNULL, stderr=open(LOG, "ab"))  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc, "/v1/models")
    return proc, url


def stream_chat(url: str, model: str, tokens: int, extra: dict) -> tuple[float, float, int, float]:
    """(ttft s, decode tokens/s, chunks, total s) for one streamed chat completion."""

    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
            "temperature": 0, "seed": 1, "stream": True, **extra}
    first = last = None
    n = 0
    t0 = time.perf_counter()
    with _client().stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(obj["error"])
            if obj.get("choices") and (obj["choices"][0].get("delta") or {}).get("content"):
                now = time.perf_counter()
                first = first or now
                last = now
                n += 1
    end = time.perf_counter()
    rate = (n - 1) / (last - first) if n > 1 and last > first else 0.0
    return (first or end) - t0, rate, n, end - t0


def concurrent(url: str, model: str, tokens: int, extra: dict, clients: int, requests: int,
               until: float | None = None) -> dict:
    latencies: list[float] = []
    chunks = [0]
    errors: list[str] = []
    lock = threading.Lock()

    def worker() -> None:
        done = 0
        while done < requests or (until is not None and time.monotonic() < until):
            try:
                _, _, n, total = stream_chat(url, model, tokens, extra)
                with lock:
                    latencies.append(total)
                    chunks[0] += n
            except Exception as e:  # noqa: BLE001 - counted
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
            done += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat = sorted(latencies)
    p95 = lat[min(len(lat) - 1, int(0.95 * len(lat)))] if lat else float("nan")
    return {"throughput": chunks[0] / wall, "p50": statistics.median(lat) if lat else float("nan"),
            "p95": p95, "requests": len(lat), "errors": errors, "wall": wall}


def rss_mb(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="concurrent rounds per server, order alternating")
    ap.add_argument("--soak", type=float, default=0.0)
    ap.add_argument("--their-interrupt", action="store_true",
                    help="keep llama_cpp.server's default interrupt_requests=True (a new request cuts the "
                         "running stream); off by default so both servers queue")
    args = ap.parse_args()

    from localllm.store import Store

    path = Path(Store().get(args.model).path)
    ours_extra = {"num_ctx": args.ctx, "options": {"num_thread": args.threads}}
    ours, ours_url = start_localllm(args.threads, args.ctx)
    try:
        theirs, theirs_url = start_llamacpp(path, args.threads, args.ctx, args.their_interrupt)
    except BaseException:
        ours.terminate()
        raise
    servers = {"localllm": (ours_url, args.model, ours_extra), "llama_cpp.server": (theirs_url, "bench", {})}
    try:
        for url, model, extra in servers.values():  # load + warm
            stream_chat(url, model, 8, extra)
        single: dict[str, list] = {k: [] for k in servers}
        for _ in range(args.reps):
            for name, (url, model, extra) in servers.items():
                single[name].append(stream_chat(url, model, args.tokens, extra))
        rounds: dict[str, list[dict]] = {k: [] for k in servers}
        order = list(servers)
        for i in range(args.rounds):  # A B, then B A: both see the same share of a busy machine
            for name in (order if i % 2 == 0 else order[::-1]):
                url, model, extra = servers[name]
                rounds[name].append(concurrent(url, model, args.tokens // 2, extra, args.clients, args.requests))
        conc = {}
        for name, rs in rounds.items():
            lat_rounds = rs
            conc[name] = {"throughput": statistics.fmean(r["throughput"] for r in rs),
                          "p50": statistics.fmean(r["p50"] for r in lat_rounds),
                          "p95": statistics.fmean(r["p95"] for r in lat_rounds),
                          "requests": sum(r["requests"] for r in rs),
                          "errors": [e for r in rs for e in r["errors"]],
                          "per_round": [round(r["throughput"], 1) for r in rs]}
        print(f"model {args.model} ({path.name}), {args.threads} threads, ctx {args.ctx}, "
              f"load average {os.getloadavg()[0]:.1f}")
        print(f"{'':18}{'tok/s (1 stream)':>18}{'TTFT ms':>10}{'conc tok/s':>12}{'p50 s':>8}{'p95 s':>8}"
              f"{'reqs':>6}{'errors':>8}")
        for name in servers:
            rows = single[name]
            c = conc[name]
            print(f"{name:18}{statistics.median(r[1] for r in rows):>18.1f}"
                  f"{statistics.median(r[0] for r in rows) * 1000:>10.1f}{c['throughput']:>12.1f}"
                  f"{c['p50']:>8.2f}{c['p95']:>8.2f}{c['requests']:>6}{len(c['errors']):>8}")
            for e in c["errors"][:3]:
                print("   error:", e[:200])
        print("single-stream tok/s per rep:", {k: [round(r[1], 1) for r in v] for k, v in single.items()})
        print("concurrent tok/s per round:", {k: v["per_round"] for k, v in conc.items()})
        if args.soak > 0:
            theirs.terminate()
            start = rss_mb(ours.pid)
            c = concurrent(ours_url, args.model, args.tokens // 2, ours_extra, args.clients, 1,
                           until=time.monotonic() + args.soak)
            print(f"soak {args.soak:.0f}s localllm: {c['requests']} requests, {len(c['errors'])} errors, "
                  f"{c['throughput']:.1f} tok/s, p95 {c['p95']:.2f}s, RSS {start:.0f} MB -> {rss_mb(ours.pid):.0f} MB")
    finally:
        for proc in (ours, theirs):
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
