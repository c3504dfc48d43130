"""Embedding and rerank throughput: ``localllm serve`` beside llama.cpp's own ``llama-server`` on the same files.

    python benchmarks/embed_rerank.py                  # made BERT models (all-MiniLM-L6 sized), 2 threads
    python benchmarks/embed_rerank.py --requests 40 --size tiny

Hugging Face is out of reach on the build machines, so the models are *made* (``tests/support_embed.py``): a random
BERT embedder (mean pooling) and a BERT reranker (rank head), by default of all-MiniLM-L6's shape (384 wide, 6
blocks, 12 heads; ~10 M parameters with the small test vocabulary), cached under ``~/.cache/localllm-bench/embed``.
Random weights cost what trained ones cost. Both servers get the same files and the same number of threads.

* **embed**: ``POST /v1/embeddings`` with a batch of 32 short texts (6-12 words) per request, requests one after
  another: inputs per second.
* **rerank**: ``POST /v1/rerank`` with one query and 32 short documents per request: documents per second.

Each side is warmed up with two requests first; the figure is the median over ``--requests`` requests of
(inputs / wall time of the request), with the mean beside it. localllm serves the models by name (installed from
the files with ``Store.create``, in a throw-away home); llama-server runs as its users start it (``--embedding
--pooling mean`` / ``--reranking``, ``-c 2048 -np 4``, ``-t`` threads). llama-server is built from the same sdist by
``benchmarks/llama_tools.py`` (``python benchmarks/llama_tools.py --target llama-server``).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import llama_tools
from _serve import ROOT, Localllm, load_avg

WORDS = ("the a of to and in is on at for with cat dog sat mat bird fish tree house car road sky sea river city "
         "paris france capital country model search query document answer rank score vector local fast small "
         "large red blue green one two three apple bread water coffee book read hello world morning day sun").split()


def texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 12))) for _ in range(n)]


def models(size: str) -> tuple[Path, Path]:
    import sys

    sys.path.insert(0, str(ROOT))
    from tests.support_embed import make_bert

    shapes: dict[str, dict[str, int]] = {"tiny": {}, "minilm": {"n_embd": 384, "n_ff": 1536, "n_blocks": 6,
                                                                "n_head": 12}}
    shape = {**shapes[size], "f16": True}  # F16 weights, as real GGUFs of this size ship (F16 / Q8_0)
    d = Path("~/.cache/localllm-bench/embed").expanduser()
    return (make_bert(d / f"bert-embed-{size}.gguf", **shape),  # type: ignore[arg-type]
            make_bert(d / f"bert-rerank-{size}.gguf", rerank=True, **shape))  # type: ignore[arg-type]


def measure(url: str, path: str, body_of: object, n_inputs: int, requests: int) -> tuple[float, float]:
    """(median, mean) inputs per second over ``requests`` requests, after two warm-up ones."""
    import httpx

    rates = []
    with httpx.Client(timeout=300) as c:
        for i in range(requests + 2):
            body = body_of(i)  # type: ignore[operator]
            t0 = time.perf_counter()
            r = c.post(url + path, json=body)
            dt = time.perf_counter() - t0
            r.raise_for_status()
            if i >= 2:
                rates.append(n_inputs / dt)
    return statistics.median(rates), statistics.fmean(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=["tiny", "minilm"], default="minilm")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-reference", action="store_true", help="localllm only (no llama-server beside it)")
    args = ap.parse_args()
    embedder, reranker = models(args.size)
    server_bin = None if args.no_reference else llama_tools.tool("llama-server")

    home = Path(tempfile.mkdtemp(prefix="localllm-bench-embed-"))
    os.environ["LOCALLLM_HOME"] = str(home)
    from localllm.modelfile import Modelfile
    from localllm.store import Store

    store = Store()
    threads = {"num_thread": args.threads}  # the same threads as llama-server's -t
    store.create("bench-embed:latest", Modelfile(from_=str(embedder), parameters=threads))
    store.create("bench-rerank:latest", Modelfile(from_=str(reranker), parameters=threads))

    def embed_body(model: str) -> object:
        return lambda i: {"model": model, "input": texts(args.batch, i)}

    def rerank_body(model: str) -> object:
        return lambda i: {"model": model, "query": texts(1, 1000 + i)[0], "documents": texts(args.batch, i)}

    rows = []
    print(f"load before: {load_avg()}")
    env = {"LOCALLLM_MODELS": str(home / "data" / "models")}
    with Localllm(env=env, home=home) as ours:
        rows.append(("embed", "localllm", *measure(ours.url, "/v1/embeddings", embed_body("bench-embed"),
                                                   args.batch, args.requests)))
        rows.append(("rerank", "localllm", *measure(ours.url, "/v1/rerank", rerank_body("bench-rerank"),
                                                    args.batch, args.requests)))
    import sys

    sys.path.insert(0, str(ROOT))
    from tests.support_embed import LlamaServer

    common = ["-c", "2048", "-np", "4"]
    if server_bin is not None:
        with LlamaServer(server_bin, embedder, "--embedding", "--pooling", "mean", *common,
                         threads=args.threads) as ls:
            rows.append(("embed", "llama-server", *measure(ls.url, "/v1/embeddings", embed_body("x"), args.batch,
                                                           args.requests)))
        with LlamaServer(server_bin, reranker, "--reranking", *common, threads=args.threads) as ls:
            rows.append(("rerank", "llama-server", *measure(ls.url, "/v1/rerank", rerank_body("x"), args.batch,
                                                            args.requests)))
    shutil.rmtree(home, ignore_errors=True)
    unit = {"embed": "inputs/s", "rerank": "docs/s"}
    print(f"\nmodel: made BERT ({args.size}), batch {args.batch}, {args.requests} requests, {args.threads} threads")
    print(f"{'task':8} {'server':14} {'median':>10} {'mean':>10}")
    for task, who, med, mean in rows:
        print(f"{task:8} {who:14} {med:10.1f} {mean:10.1f}  {unit[task]}")
    print(f"load after: {load_avg()}")


if __name__ == "__main__":
    main()
