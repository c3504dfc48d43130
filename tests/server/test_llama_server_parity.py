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


def scores(url: str, model: str, query: str, docs: list[str]) -> list[float]:
    r = httpx.post(url + "/v1/rerank", json={"model": model, "query": query, "documents": docs}, timeout=120)
    assert r.status_code == 200, r.text
    by_index = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    assert sorted(by_index) == list(range(len(docs)))
    return [by_index[i] for i in range(len(docs))]


# Exactness: an input evaluated alone gives llama-server's numbers exactly. Several in one evaluation agree to float
# precision with flash attention off; with it on (llama.cpp's default on the CPU, both servers' default) its F16
# arithmetic depends on where an input sits in the batch, so two servers that batch differently (llama-server by its
# slots, localllm up to 64 inputs at once) agree to ~1e-3 of a score, in the same order.
FA_TOL = 2e-3


def test_embeddings_equal_llama_servers(binary, bert_embedder, ours, tmp_path):
    with LlamaServer(binary, bert_embedder, "--embedding", "--pooling", "mean", *SERVER_ARGS,
                     log=tmp_path / "llama-server.log") as ref:
        theirs = embeddings(ref.url, "x", TEXTS)
        theirs_solo = [embeddings(ref.url, "x", [t])[0] for t in TEXTS]
    mine = embeddings(ours, EMBEDDER, TEXTS)
    assert theirs.shape == mine.shape == (len(TEXTS), 64)
    assert np.abs(mine - theirs).max() < FA_TOL / 10, np.abs(mine - theirs).max()
    mine_solo = [embeddings(ours, EMBEDDER, [t])[0] for t in TEXTS]
    assert np.abs(np.array(mine_solo) - np.array(theirs_solo)).max() < 1e-6


def test_rerank_scores_equal_llama_servers(binary, bert_reranker, ours, tmp_path):
    with LlamaServer(binary, bert_reranker, "--reranking", *SERVER_ARGS, log=tmp_path / "llama-server.log") as ref:
        theirs = [scores(ref.url, "x", q, TEXTS) for q in QUERIES]
        theirs_solo = [scores(ref.url, "x", QUERIES[0], [t])[0] for t in TEXTS]
    mine = [scores(ours, RERANKER, q, TEXTS) for q in QUERIES]
    for t, m in zip(theirs, mine, strict=True):
        assert max(abs(a - b) for a, b in zip(t, m, strict=True)) < FA_TOL, (t, m)
        for i in range(len(t)):  # the same order wherever the scores are further apart than the tolerance
            for j in range(len(t)):
                if t[i] > t[j] + 2 * FA_TOL:
                    assert m[i] > m[j], (i, j, t, m)
    mine_solo = [scores(ours, RERANKER, QUERIES[0], [t])[0] for t in TEXTS]
    assert max(abs(a - b) for a, b in zip(mine_solo, theirs_solo, strict=True)) < 1e-6, (mine_solo, theirs_solo)


@pytest.mark.parametrize("which", ["embedder", "reranker", "templated"])
def test_batched_numbers_are_llama_servers_to_float_precision_without_flash_attention(
        binary, which, bert_embedder, bert_reranker, bert_reranker_templated, tmp_path):
    """With flash attention off on both sides, a batch of inputs evaluated at once gives llama-server's numbers to
    float precision (in-process here: the server has no switch for it); the templated reranker is Qwen3-Reranker's
    way (the GGUF's rerank template)."""
    from backends.contract.specs import LoadSpec
    from backends.core.loop import LoadedModel
    from backends.llamacpp.source import LlamaCppSource

    path = {"embedder": bert_embedder, "reranker": bert_reranker, "templated": bert_reranker_templated}[which]
    flags = ["--embedding", "--pooling", "mean"] if which == "embedder" else ["--reranking"]
    with LlamaServer(binary, path, *flags, *SERVER_ARGS, "-fa", "off", log=tmp_path / "llama-server.log") as ref:
        theirs = (embeddings(ref.url, "x", TEXTS) if which == "embedder"
                  else np.array([scores(ref.url, "x", q, TEXTS) for q in QUERIES]))
    with LoadedModel(LlamaCppSource, LoadSpec(str(path), n_ctx=512, flash_attn=False)) as m:
        mine = (np.array(m.embed_many(TEXTS).vectors) if which == "embedder"
                else np.array([m.rerank(q, TEXTS).scores for q in QUERIES]))
    assert np.abs(mine - theirs).max() < 1e-5, np.abs(mine - theirs).max()
