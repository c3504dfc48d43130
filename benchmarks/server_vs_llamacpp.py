"""localllm serve against llama-cpp-python's own server (``python -m llama_cpp.server``), same GGUF file,
same threads and context, both through the OpenAI API (``/v1/chat/completions``, streamed).

    python benchmarks/server_vs_llamacpp.py [--model smollm2:135m] [--threads 2] [--tokens 128]
                                            [--reps 3] [--clients 4,8] [--requests 3] [--rounds 2]
                                            [--parallel N] [--soak SECONDS] [--their-interrupt]

Needs llama_cpp.server's dependencies (not a rebuild of llama-cpp-python):
``pip install sse-starlette starlette-context pydantic-settings`` (the ``[server]`` extra).

Reports per server: single-stream decode tokens/s and TTFT (client clocks, medians over reps,
interleaved), then for each ``--clients`` count, that many concurrent clients each sending ``--requests``
requests of ``--conc-tokens`` tokens (each request a distinct prompt: nobody gets a free cached prefix):
total throughput (completion chunks / wall time), request latency p50/p95 (each server's requests of all
rounds pooled) and errors; rounds alternate the servers' order. localllm runs in an isolated home
(``benchmarks/_serve.py``) with its default slots (4 where they fit) unless ``--parallel`` sets
``LOCALLLM_NUM_PARALLEL``; llama_cpp.server serves one request at a time (it queues them with
``--interrupt_requests False``). ``--soak N`` repeats the concurrent load (the first clients count) for N
seconds on localllm and prints its RSS at start and end (``soak.py`` is the fuller soak).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = "Write a long story about a dragon who learns to bake bread."
SUBJECTS = ["a dragon who learns to bake bread", "a robot who tends a garden", "a sailor lost in fog",
            "a clockmaker's last clock", "a fox who runs a library", "a lighthouse with no keeper",
            "twin astronauts on Mars", "a village that forgets the winter"]


_local = threading.local()


def _client():
    """One keep-alive connection pool per thread, as a real client keeps (and not httpx's per-call setup)."""
    import httpx

    if not hasattr(_local, "client"):
        _local.client = httpx.Client(timeout=600)
    return _local.client


def stream_chat(url: str, model: str, tokens: int, extra: dict,
                prompt: str = PROMPT) -> tuple[float, float, int, float]:
    """(ttft s, decode tokens/s, chunks, total s) for one streamed chat completion."""

    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
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
               until: float | None = None, tag: str = "") -> dict:
    latencies: list[float] = []
    chunks = [0]
    errors: list[str] = []
    lock = threading.Lock()

    def worker(c: int) -> None:
        done = 0
        while done < requests or (until is not None and time.monotonic() < until):
            prompt = f"Request {tag}{c}.{done}: write a long story about {SUBJECTS[(c + done) % len(SUBJECTS)]}."
            try:
                _, _, n, total = stream_chat(url, model, tokens, extra, prompt)
                with lock:
                    latencies.append(total)
                    chunks[0] += n
            except Exception as e:  # noqa: BLE001 - counted
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
            done += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat = sorted(latencies)
    p95 = lat[min(len(lat) - 1, int(0.95 * len(lat)))] if lat else float("nan")
    return {"throughput": chunks[0] / wall, "p50": statistics.median(lat) if lat else float("nan"),
            "p95": p95, "requests": len(lat), "errors": errors, "wall": wall, "latencies": lat}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=128, help="tokens of the single-stream requests")
    ap.add_argument("--conc-tokens", type=int, default=64, help="tokens of each concurrent request")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--clients", default="4,8", help="concurrent clients, one or more counts")
    ap.add_argument("--requests", type=int, default=3, help="requests per client per round")
    ap.add_argument("--rounds", type=int, default=2, help="concurrent rounds per server, order alternating")
    ap.add_argument("--parallel", type=int, default=0, help="LOCALLLM_NUM_PARALLEL (0: the default slots)")
    ap.add_argument("--soak", type=float, default=0.0)
    ap.add_argument("--their-interrupt", action="store_true",
                    help="keep llama_cpp.server's default interrupt_requests=True (a new request cuts the "
                         "running stream); off by default so both servers queue")
    args = ap.parse_args()
    from _serve import LlamaCppServer, Localllm, model_path, pct

    counts = [int(c) for c in str(args.clients).split(",")]
    path = model_path(args.model)
    ours_extra = {"num_ctx": args.ctx, "options": {"num_thread": args.threads}}
    ours = Localllm({"LOCALLLM_NUM_PARALLEL": str(args.parallel)} if args.parallel else {})
    try:
        theirs = LlamaCppServer(path, args.threads, args.ctx, args.their_interrupt)
    except BaseException:
        ours.close()
        ours.remove_home()
        raise
    servers = {"localllm": (ours.url, args.model, ours_extra), "llama_cpp.server": (theirs.url, "bench", {})}
    print(f"model {args.model} ({path.name}), {args.threads} threads, ctx {args.ctx}, localllm slots "
          f"{args.parallel or 'default'}; load average at start {os.getloadavg()[0]:.1f}", flush=True)
    try:
        for url, model, extra in servers.values():  # load + warm
            stream_chat(url, model, 8, extra)
        single: dict[str, list] = {k: [] for k in servers}
        for _ in range(args.reps):
            for name, (url, model, extra) in servers.items():
                single[name].append(stream_chat(url, model, args.tokens, extra))
        conc: dict[int, dict[str, dict]] = {}
        order = list(servers)
        for n in counts:
            rounds: dict[str, list[dict]] = {k: [] for k in servers}
            for i in range(args.rounds):  # A B, then B A: both see the same share of a busy machine
                for name in (order if i % 2 == 0 else order[::-1]):
                    url, model, extra = servers[name]
                    rounds[name].append(concurrent(url, model, args.conc_tokens, extra, n, args.requests,
                                                   tag=f"{n}.{i}."))
                print(f"  {n} clients, round {i + 1}: " + ", ".join(
                    f"{k} {v[-1]['throughput']:.1f} tok/s p50 {v[-1]['p50']:.2f} s" for k, v in rounds.items())
                    + f" (load {os.getloadavg()[0]:.1f})", flush=True)
            conc[n] = {}
            for name, rs in rounds.items():
                lat = [x for r in rs for x in r["latencies"]]
                conc[n][name] = {"throughput": statistics.fmean(r["throughput"] for r in rs),
                                 "p50": statistics.median(lat) if lat else float("nan"), "p95": pct(lat, 0.95),
                                 "requests": len(lat), "errors": [e for r in rs for e in r["errors"]],
                                 "per_round": [round(r["throughput"], 1) for r in rs]}
        print(f"model {args.model} ({path.name}), {args.threads} threads, ctx {args.ctx}, "
              f"load average at end {os.getloadavg()[0]:.1f}")
        print(f"{'':18}{'tok/s (1 stream)':>18}{'TTFT ms':>10}")
        for name in servers:
            rows = single[name]
            print(f"{name:18}{statistics.median(r[1] for r in rows):>18.1f}"
                  f"{statistics.median(r[0] for r in rows) * 1000:>10.1f}")
        print("single-stream tok/s per rep:", {k: [round(r[1], 1) for r in v] for k, v in single.items()})
        print(f"{'clients':>8} {'server':18}{'tok/s':>8}{'p50 s':>8}{'p95 s':>8}{'reqs':>6}{'errors':>8}  per round")
        for n, by in conc.items():
            for name, c in by.items():
                print(f"{n:>8} {name:18}{c['throughput']:>8.1f}{c['p50']:>8.2f}{c['p95']:>8.2f}{c['requests']:>6}"
                      f"{len(c['errors']):>8}  {c['per_round']}")
                for e in c["errors"][:3]:
                    print("   error:", e[:200])
        if args.soak > 0:
            theirs.close()
            start = ours.rss_mb()
            c = concurrent(ours.url, args.model, args.conc_tokens, ours_extra, counts[0], 1,
                           until=time.monotonic() + args.soak, tag="soak.")
            print(f"soak {args.soak:.0f}s localllm: {c['requests']} requests, {len(c['errors'])} errors, "
                  f"{c['throughput']:.1f} tok/s, p95 {c['p95']:.2f}s, RSS {start:.0f} MB -> {ours.rss_mb():.0f} MB")
    finally:
        theirs.close()
        ours.close()
        ours.remove_home()


if __name__ == "__main__":
    main()
