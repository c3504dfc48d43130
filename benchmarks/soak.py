"""Soak (issue 11): ``--clients`` clients (default 8) against one ``localllm serve`` for ``--seconds`` (default
600), loopback only, each client a bounded loop of mixed requests; the server's RSS and ``/metrics`` sampled
every ``--every`` seconds (default 10).

    python benchmarks/soak.py                                 # 8 clients, 10 minutes, the default slots
    python benchmarks/soak.py --seconds 600 --clients 8 --parallel 8 --threads 2

Each client draws its next request from a seeded generator (so a rerun sends the same mix):

* ``chat``: ``/v1/chat/completions`` streamed, a ~300-token system prompt shared by all clients + a question
  (prefix copies between sequences), 16–96 tokens;
* ``story``: ``/v1/completions`` streamed, a distinct raw prompt, 32–128 tokens at temperature 0.8;
* ``leave``: a chat stream the client closes after 3 chunks (a disconnect mid-answer: its cells must be freed);
* ``whole``: ``/v1/chat/completions`` not streamed, 24 tokens;
* ``long``: a distinct ~1,200-token user message, 8 tokens (chunked prefill beside the others; evicts idle
  prefixes once the pool fills).

An error is any exception or error payload other than the intended disconnects. At the end the server must
be idle again: ``localllm_slots_busy`` and ``localllm_kv_cells_used`` back to 0 (cells of idle prefixes,
``kv_cells_cached``, may stay). RSS is reported first / last / max and the last minute's median against the
first minute's (flat = no growth beyond noise).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from typing import Any

import _serve
from _common import default_threads, load_average
from _serve import Localllm, Tokens, med, model_path, pct, story_prompt, stream, system_prompt

LONG_SENTENCE = "The river rose slowly through the night, and the town listened. "
KINDS = (("chat", 0.40), ("story", 0.25), ("leave", 0.15), ("whole", 0.12), ("long", 0.08))


async def client_loop(i: int, url: str, model: str, deadline: float, shared: str, tok: Tokens,
                      extra: dict[str, Any], log: dict[str, Any]) -> None:
    rng = random.Random(1000 + i)
    client = _serve.async_client(url)
    n = 0
    try:
        while time.monotonic() < deadline:
            n += 1
            kind = rng.choices([k for k, _ in KINDS], [w for _, w in KINDS])[0]
            t0 = time.perf_counter()
            err: str | None = None
            tokens = 0
            if kind in ("chat", "leave"):
                q = [{"role": "system", "content": shared},
                     {"role": "user", "content": f"Client {i}, question {n}: which rule covers case {1000 + 37 * n}?"}]
                r = await stream(client, model, messages=q, max_tokens=rng.randint(16, 96), temperature=0.7,
                                 seed=n, extra_body=extra, stop_after=3 if kind == "leave" else None)
                err, tokens = r.error, r.completion_tokens or r.chunks
            elif kind == "story":
                r = await stream(client, model, prompt=story_prompt(100_000 * i + n), max_tokens=rng.randint(32, 128),
                                 temperature=0.8, seed=n, extra_body=extra)
                err, tokens = r.error, r.completion_tokens
            elif kind == "long":
                text = f"Client {i} note {n}. " + LONG_SENTENCE * 100
                r = await stream(client, model, messages=[{"role": "user", "content": text + " Summarise."}],
                                 max_tokens=8, temperature=0, extra_body=extra)
                err, tokens = r.error, r.completion_tokens
            else:
                try:
                    c = await client.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": f"Client {i}/{n}: say hello."}],
                        max_tokens=24, temperature=0.5, seed=n, extra_body=extra)
                    tokens = c.usage.completion_tokens if c.usage else 0
                except Exception as e:  # noqa: BLE001 - counted
                    err = f"{type(e).__name__}: {e}"[:300]
            dt = time.perf_counter() - t0
            log["kinds"][kind] += 1
            log["latency"].append(dt)
            log["tokens"] += tokens
            if err:
                log["errors"].append(f"{kind}: {err}")
    finally:
        await client.close()


async def soak(srv: Localllm, model: str, args: argparse.Namespace, tok: Tokens,
               extra: dict[str, Any]) -> dict[str, Any]:
    shared = system_prompt(300, tok, nonce="soak")
    log: dict[str, Any] = {"kinds": Counter(), "latency": [], "tokens": 0, "errors": [], "samples": []}
    deadline = time.monotonic() + args.seconds
    t0 = time.monotonic()

    async def sampler() -> None:
        while True:
            m = await asyncio.to_thread(srv.metrics)
            log["samples"].append({"t": round(time.monotonic() - t0, 1), "rss_mb": round(srv.rss_mb(), 1),
                                   "anon_mb": round(srv.anon_mb(), 1),
                                   "busy": m.get("localllm_slots_busy", 0),
                                   "kv_used": m.get("localllm_kv_cells_used", 0),
                                   "kv_cached": m.get("localllm_kv_cells_cached", 0),
                                   "queue": m.get("localllm_queue_depth", 0), "load": load_average()})
            s = log["samples"][-1]
            print(f"  t={s['t']:6.1f}s RSS {s['rss_mb']:7.1f} MB (anonymous {s['anon_mb']:7.1f}) busy {s['busy']:.0f} "
                  f"queue {s['queue']:.0f} KV used "
                  f"{s['kv_used']:.0f} cached {s['kv_cached']:.0f}; {sum(log['kinds'].values())} requests, "
                  f"{len(log['errors'])} errors (load {s['load']})", flush=True)
            await asyncio.sleep(args.every)

    samp = asyncio.create_task(sampler())
    await asyncio.gather(*(client_loop(i, srv.url, model, deadline, shared, tok, extra, log)
                           for i in range(args.clients)))
    log["wall"] = time.monotonic() - t0
    samp.cancel()
    await asyncio.sleep(1.0)  # one step for the last disconnects to be seen
    log["end_metrics"] = srv.metrics()
    log["end_rss"] = srv.rss_mb()
    return log


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--threads", type=int, default=None, help="default: physical cores (the backend's default)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--every", type=float, default=10, help="seconds between RSS / metrics samples")
    ap.add_argument("--parallel", type=int, default=0, help="LOCALLLM_NUM_PARALLEL (0: the product's default)")
    ap.add_argument("--num-ctx", type=int, default=4096)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    threads = args.threads or default_threads()
    tok = Tokens(model_path(args.model))
    extra = {"num_ctx": args.num_ctx, "options": {"num_thread": threads}}
    env = {"LOCALLLM_NUM_PARALLEL": str(args.parallel)} if args.parallel else {}
    print(f"soak: model {args.model}, {threads} threads, {args.clients} clients, {args.seconds:.0f} s; "
          f"load average at start {load_average()}", flush=True)
    with Localllm(env) as srv:
        try:
            asyncio.run(asyncio.wait_for(_warm(srv.url, args.model, extra), 300))
            m0 = srv.metrics()
            log = asyncio.run(soak(srv, args.model, args, tok, extra))
        finally:
            srv.remove_home()
    m1 = log["end_metrics"]
    rss = [s["rss_mb"] for s in log["samples"]] + [log["end_rss"]]
    first_min = [s["rss_mb"] for s in log["samples"] if s["t"] <= 60]
    last_min = [s["rss_mb"] for s in log["samples"] if s["t"] >= log["wall"] - 60]
    served = sum(log["kinds"].values())
    gen = m1.get("localllm_generated_tokens_total", 0) - m0.get("localllm_generated_tokens_total", 0)
    print(f"\nload average at end: {load_average()}")
    print(f"{served} requests in {log['wall']:.0f} s ({dict(log['kinds'])}), {len(log['errors'])} errors; "
          f"{gen:.0f} tokens generated (server count), {gen / log['wall']:.1f} tok/s; latency p50 "
          f"{med(log['latency']):.2f} s, p95 {pct(log['latency'], 0.95):.2f} s")
    print(f"slots {m1.get('localllm_slots', 0):.0f}; at the end: busy {m1.get('localllm_slots_busy', 0):.0f}, KV cells "
          f"used {m1.get('localllm_kv_cells_used', 0):.0f}, kept by idle prefixes "
          f"{m1.get('localllm_kv_cells_cached', 0):.0f} of {m1.get('localllm_kv_cells', 0):.0f}; evictions "
          f"{m1.get('localllm_kv_evictions_total', 0):.0f}; prompt tokens evaluated "
          f"{m1.get('localllm_prompt_tokens_total', 0):.0f}, reused "
          f"{m1.get('localllm_prompt_tokens_cached_total', 0):.0f}")
    anon = [s["anon_mb"] for s in log["samples"]]
    print(f"RSS first {rss[0]:.1f} MB, last {rss[-1]:.1f} MB, max {max(rss):.1f} MB; first-minute median "
          f"{med(first_min):.1f}, last-minute median {med(last_min):.1f} MB; anonymous first {anon[0]:.1f}, last "
          f"{anon[-1]:.1f}, max {max(anon):.1f} MB")
    steps = [(a["t"], b["rss_mb"] - a["rss_mb"]) for a, b in zip(log["samples"], log["samples"][1:], strict=False)
             if abs(b["rss_mb"] - a["rss_mb"]) >= 5]
    if steps:
        print("RSS steps of 5 MB or more between samples (s, MB): " + ", ".join(f"{t:.0f}: {d:+.1f}" for t, d in steps))
    for e in log["errors"][:5]:
        print("  error:", e)
    if args.json:
        print(json.dumps({k: v for k, v in log.items() if k != "end_metrics"}, default=str))


async def _warm(url: str, model: str, extra: dict[str, Any]) -> None:
    client = _serve.async_client(url)
    try:
        r = await stream(client, model, prompt="Hello", max_tokens=4, extra_body=extra)
        if r.error:
            raise SystemExit(f"warm-up failed: {r.error}")
    finally:
        await client.close()


if __name__ == "__main__":
    main()
