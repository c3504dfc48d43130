"""What a heavy client costs the others (issue 46): ``localllm serve`` in its own process.

    python benchmarks/hostile_load.py                      # made all-MiniLM-L6-sized reranker, 10,000 documents
    python benchmarks/hostile_load.py --documents 2000 --size tiny --embed 1000

* **idle CPU**: the server's CPU (psutil, its process and children) over ``--idle`` seconds with the default model
  loaded and idle (after a chat and an embedding, so llama.cpp's thread pools and the embedding context exist),
  and its thread count: should be ~0 %.
* **chat beside a rerank**: the longest pause between two streamed tokens of a chat (``/api/chat``, 128 tokens,
  the default model) alone, then while a rerank of ``--documents`` documents runs (the caps raised to allow it:
  ``LOCALLLM_MAX_RERANK_DOCUMENTS``, ``LOCALLLM_MAX_POOLED_TOKENS=0``), and the rerank's own time.
* ``--embed N``: the same beside an embedding request of N inputs on the **chat model itself** (one
  decode loop: the embedding batches and the chat's steps take turns).

Models: the default model (``smollm2:135m``, from the test home) and a made BERT reranker
(``benchmarks/embed_rerank.py``'s, cached under ``~/.cache/localllm-bench/embed``), installed in a throw-away home.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
from _serve import Localllm, load_avg, model_path
from embed_rerank import models, texts

CHAT = "bench-chat:latest"
RERANK = "bench-rerank:latest"


def chat_gaps(url: str, tokens: int = 128) -> tuple[list[float], float]:
    """(seconds between streamed chunks, time to the first) of one streamed chat."""
    body = {"model": CHAT, "messages": [{"role": "user", "content": "Tell me a long story about a cat."}],
            "options": {"temperature": 0, "num_predict": tokens, "seed": 1}, "stream": True}
    t0 = time.perf_counter()
    stamps: list[float] = []
    with httpx.stream("POST", url + "/api/chat", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line and not json.loads(line).get("done"):
                stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)], stamps[0] - t0


def beside(url: str, path: str, body: dict, label: str) -> None:
    done: dict[str, float] = {}

    def heavy() -> None:
        t = time.perf_counter()
        r = httpx.post(url + path, json=body, timeout=3600)
        done["status"], done["seconds"] = r.status_code, time.perf_counter() - t

    th = threading.Thread(target=heavy)
    th.start()
    time.sleep(1.0)  # under way
    gaps, ttft = chat_gaps(url)
    th.join()
    long = [(i, round(g, 2)) for i, g in enumerate(gaps) if g > 0.5]
    print(f"chat beside {label}: longest pause {max(gaps) * 1000:.0f} ms, median {statistics.median(gaps) * 1000:.1f} "
          f"ms, TTFT {ttft * 1000:.0f} ms; the {label}: HTTP {done['status']}, {done['seconds']:.1f} s"
          + (f"; pauses over 0.5 s (token, s): {long}" if long else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--documents", type=int, default=10_000)
    ap.add_argument("--size", choices=["tiny", "minilm"], default="minilm")
    ap.add_argument("--idle", type=float, default=5.0)
    ap.add_argument("--embed", type=int, default=0, metavar="N",
                    help="also an embedding request of N inputs on the chat model itself")
    args = ap.parse_args()
    _, reranker = models(args.size)
    chat_gguf = model_path("smollm2:135m")
    home = Path(tempfile.mkdtemp(prefix="localllm-bench-hostile-"))
    os.environ["LOCALLLM_HOME"] = str(home)
    from localllm.modelfile import Modelfile
    from localllm.store import Store

    store = Store()
    store.create(CHAT, Modelfile(from_=str(chat_gguf)))
    store.create(RERANK, Modelfile(from_=str(reranker)))
    n = args.documents
    env = {"LOCALLLM_MODELS": str(home / "data" / "models"), "LOCALLLM_MAX_RERANK_DOCUMENTS": str(n),
           "LOCALLLM_MAX_EMBED_INPUTS": str(max(n, args.embed)), "LOCALLLM_MAX_POOLED_TOKENS": "0"}
    print(f"load before: {load_avg()}")
    try:
        with Localllm(env=env, home=home) as srv:
            url = srv.url
            chat_gaps(url, 8)
            httpx.post(url + "/api/embed", json={"model": CHAT, "input": ["warm up"]}, timeout=600)
            httpx.post(url + "/v1/rerank", json={"model": RERANK, "query": "cat", "documents": texts(32, 0)},
                       timeout=600)
            proc = psutil.Process(srv.proc.pid)
            time.sleep(2.0)
            every = [proc, *proc.children(recursive=True)]
            for p in every:
                p.cpu_percent(None)
            time.sleep(args.idle)
            idle = sum(p.cpu_percent(None) for p in every)
            print(f"idle CPU of the server with {CHAT} and {RERANK} loaded: {idle:.1f} % over {args.idle:.0f} s "
                  f"({proc.num_threads()} threads, {psutil.cpu_count()} CPUs)")
            gaps, ttft = chat_gaps(url)
            print(f"chat alone: longest pause {max(gaps) * 1000:.0f} ms, "
                  f"median {statistics.median(gaps) * 1000:.1f} ms, TTFT {ttft * 1000:.0f} ms")
            query = "what is the capital of france"
            beside(url, "/v1/rerank", {"model": RERANK, "query": query, "documents": texts(n, 7)},
                   f"rerank of {n:,} documents")
            if args.embed:
                beside(url, "/api/embed", {"model": CHAT, "input": texts(args.embed, 8)},
                       f"embedding of {args.embed:,} inputs on the chat model")
    finally:
        shutil.rmtree(home, ignore_errors=True)
    print(f"load after: {load_avg()}")


if __name__ == "__main__":
    main()
