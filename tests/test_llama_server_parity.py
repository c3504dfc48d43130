"""The same numbers as llama.cpp: on the made BERT embedder and reranker (:mod:`tests.support_embed`), localllm's
``/v1/embeddings`` vectors and ``/v1/rerank`` scores equal those of llama.cpp's own ``llama-server`` (built from the
same llama-cpp-python sdist by ``benchmarks/llama_tools.py``; ``.ci/run`` builds it before the suite) to float
tolerance, so a user switching from llama-server gets the same retrieval.

llama-server runs as its users start it: ``--embedding --pooling mean`` for the embedder, ``--reranking`` for the
reranker, on a free loopback port."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.support_embed import EMBEDDER, RERANKER, LlamaServer, llama_server_binary

TEXTS = ["the cat sat on the mat", "hello world", "paris is the capital of france", "a dog",
         "reading books in the morning with coffee and bread", "the sun and the moon and the star"]
QUERIES = ["what is the capital of france", "cat"]
SERVER_ARGS = ["-c", "2048", "-np", "4"]  # 512 tokens a slot: the made models' context


@pytest.fixture(scope="module")
def binary():
    path = llama_server_binary()
    if path is None:
        pytest.skip("llama-server is not built: python benchmarks/llama_tools.py --target llama-server")
    return path


@pytest.fixture(scope="module")
def ours(installed_default_model, bert_embedder, bert_reranker, tmp_path_factory):
    from tests.server.derived import serve
    from tests.support_embed import install_embed_models

    srv = serve(install_embed_models(tmp_path_factory.mktemp("parity-home"), bert_embedder, bert_reranker))
    yield srv.url
    srv.stop()
    srv.engine.close()


def embeddings(url: str, model: str, texts: list[str]) -> np.ndarray:
    r = httpx.post(url + "/v1/embeddings", json={"model": model, "input": texts}, timeout=120)
    assert r.status_code == 200, r.text
    return np.array([d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])])


def scores(url: str, model: str, query: str, docs: list[str]) -> dict[int, float]:
    r = httpx.post(url + "/v1/rerank", json={"model": model, "query": query, "documents": docs}, timeout=120)
    assert r.status_code == 200, r.text
    return {x["index"]: x["relevance_score"] for x in r.json()["results"]}


def test_embeddings_equal_llama_servers(binary, bert_embedder, ours, tmp_path):
    with LlamaServer(binary, bert_embedder, "--embedding", "--pooling", "mean", *SERVER_ARGS,
                     log=tmp_path / "llama-server.log") as ref:
        theirs = embeddings(ref.url, "x", TEXTS)
        theirs_one = embeddings(ref.url, "x", TEXTS[:1])
    mine = embeddings(ours, EMBEDDER, TEXTS)
    assert theirs.shape == mine.shape == (len(TEXTS), 64)
    assert np.abs(mine - theirs).max() < 1e-5, np.abs(mine - theirs).max()
    assert np.abs(embeddings(ours, EMBEDDER, TEXTS[:1]) - theirs_one).max() < 1e-5


def test_rerank_scores_equal_llama_servers(binary, bert_reranker, ours, tmp_path):
    with LlamaServer(binary, bert_reranker, "--reranking", *SERVER_ARGS, log=tmp_path / "llama-server.log") as ref:
        theirs = [scores(ref.url, "x", q, TEXTS) for q in QUERIES]
    mine = [scores(ours, RERANKER, q, TEXTS) for q in QUERIES]
    for t, m in zip(theirs, mine, strict=True):
        assert sorted(t) == sorted(m) == list(range(len(TEXTS)))
        assert max(abs(t[i] - m[i]) for i in t) < 1e-4, (t, m)
        assert sorted(t, key=lambda i: -t[i]) == sorted(m, key=lambda i: -m[i])  # the same order


def test_rerank_template_scores_equal_llama_servers(binary, bert_reranker_templated, tmp_path):
    """A GGUF with a rerank template (Qwen3-Reranker's way): the same prompt, the same scores (in-process here)."""
    from backends.base import LoadSpec
    from backends.llamacpp import LlamaCppSource
    from backends.loop import LoadedModel

    with LlamaServer(binary, bert_reranker_templated, "--reranking", *SERVER_ARGS,
                     log=tmp_path / "llama-server.log") as ref:
        theirs = scores(ref.url, "x", QUERIES[0], TEXTS)
    with LoadedModel(LlamaCppSource, LoadSpec(str(bert_reranker_templated), n_ctx=512)) as m:
        mine = m.rerank(QUERIES[0], TEXTS).scores
    assert max(abs(theirs[i] - mine[i]) for i in theirs) < 1e-4, (theirs, mine)
