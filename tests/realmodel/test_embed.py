"""A real encoder's embeddings (nomic-embed-text-v1.5, trained with task prefixes and Matryoshka sizes 768 → 64):
a query is nearer the document it is about, at every trained size (``dimensions``), through the openai client."""

from __future__ import annotations

import math

import openai
import pytest

from tests.support import NOMIC_MODEL

QUERY = "search_query: a cat"
DOCS = ["search_document: a small kitten sleeps on the sofa", "search_document: the stock market fell sharply"]


def _cos(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


@pytest.fixture(scope="module")
def client(nomic_model, coder_url):
    return openai.OpenAI(base_url=coder_url + "/v1", api_key="x", max_retries=0)


@pytest.mark.parametrize("dims", [None, 512, 256, 128, 64])
def test_the_query_is_nearer_its_document_at_every_trained_size(client, dims):
    kw = {"dimensions": dims} if dims else {}
    r = client.embeddings.create(model=NOMIC_MODEL, input=[QUERY, *DOCS], **kw)
    q, kitten, market = (d.embedding for d in r.data)
    assert len(q) == (dims or 768)
    assert abs(math.sqrt(sum(x * x for x in q)) - 1) < 1e-3  # normalised again after the cut
    assert _cos(q, kitten) > _cos(q, market) + 0.1, (dims, _cos(q, kitten), _cos(q, market))


def test_a_size_below_the_trained_ones_is_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=NOMIC_MODEL, input=QUERY, dimensions=32)
    assert "trained for embeddings of 64 to 768 dimensions, not 32" in str(e.value)


def test_nomic_embeddings_equal_llama_servers(nomic_model, coder_url, tmp_path):
    """The real encoder's vectors are llama-server's (``--embedding --pooling mean``, the same file and llama.cpp),
    each input alone: exactly to float precision."""
    import httpx
    import numpy as np

    from tests.support_embed import LlamaServer, llama_server_binary

    binary = llama_server_binary()
    if binary is None:
        pytest.skip("llama-server is not built: python benchmarks/llama_tools.py --target llama-server")
    texts = [QUERY, *DOCS]

    def vectors(url: str, model: str) -> np.ndarray:
        return np.array([httpx.post(url + "/v1/embeddings", json={"model": model, "input": t}, timeout=120)
                         .json()["data"][0]["embedding"] for t in texts])

    with LlamaServer(binary, nomic_model.path, "--embedding", "--pooling", "mean", "-c", "2048",
                     log=tmp_path / "llama-server.log") as ref:
        theirs = vectors(ref.url, "x")
    mine = vectors(coder_url, NOMIC_MODEL)
    assert theirs.shape == mine.shape == (3, 768)
    assert np.abs(mine - theirs).max() < 1e-5, np.abs(mine - theirs).max()
