"""Every context a request may shape answers or refuses, and the server lives on: odd ``num_ctx`` values (the
embedding context llama.cpp once aborted on unless its size was a multiple of its 64 sequences: issue 51) and the
other load options (``num_batch``, ``num_thread``, ``num_gpu``), through ``/api/embed``, ``/v1/embeddings``,
``/api/rerank`` and chat, against a real ``localllm serve`` in a process of its own (a crash is the server's exit,
seen here and named, not the death of the pytest worker). Each answer is a 200, or a 400 in one sentence."""

from __future__ import annotations

import pytest

from tests.support_serve import ServeProcess, one_sentence

MODEL = "smollm2:135m"  # trained context 8192
DOCS = ["paris is the capital of france", "the cat sat on the mat"]

# around every multiple of 64 and 256 a user might miss, up to the trained context
SIZES = [256, 257, 300, 511, 1000, 1023, 2047, 2049, 8192]
OPTIONS = [
    {"num_ctx": 1}, {"num_ctx": 2}, {"num_ctx": 100},
    {"num_ctx": 300, "num_batch": 257}, {"num_batch": 1}, {"num_batch": 7}, {"num_batch": 100_000},
    {"num_thread": 1}, {"num_thread": 3}, {"num_thread": 0}, {"num_thread": 1025},
    {"num_gpu": 0}, {"num_gpu": 999}, {"num_gpu": -1},
]


@pytest.fixture(scope="module")
def serve(installed_default_model, bert_embedder, bert_reranker, tmp_path_factory):
    from tests.support_embed import install_embed_models

    home = tmp_path_factory.mktemp("context-sizes-home")
    install_embed_models(home, bert_embedder, bert_reranker)
    with ServeProcess(home) as srv:
        yield srv


def ok_or_400(r, what: str) -> bool:
    """True for a 200; a 400 must say why in one sentence; anything else fails, naming the request."""
    assert r.status_code in (200, 400), f"{what} -> {r.status_code}: {r.text[:300]}"
    if r.status_code == 400:
        one_sentence(r)
    return r.status_code == 200


def walk(srv: ServeProcess, options: dict) -> dict[str, int]:
    """Chat with ``options`` (loading the model as they say), then the pooled routes beside it: an embedding with and
    without the options (OpenAI's carries none: it runs on the context chat loaded), a rerank with them."""
    from tests.support_embed import EMBEDDER, RERANKER

    got = {}
    calls = [
        ("chat", "/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": False,
                               "options": {**options, "num_predict": 1, "temperature": 0}}),
        ("/v1/embeddings", "/v1/embeddings", {"model": MODEL, "input": "hello"}),
        ("/api/embed", "/api/embed", {"model": MODEL, "input": ["hello", "world"], "options": options}),
        ("/api/embed bert", "/api/embed", {"model": EMBEDDER, "input": "the cat", "options": options}),
        ("/api/rerank", "/api/rerank", {"model": RERANKER, "query": "capital of france", "documents": DOCS,
                                        "options": options}),
    ]
    for name, path, body in calls:
        what = f"{name} with options {options}"
        r = srv.call("POST", path, body, what=what)
        got[name] = r.status_code
        if ok_or_400(r, what) and "embed" in name:
            data = r.json()
            vectors = data.get("embeddings") or [d["embedding"] for d in data.get("data", [])]
            assert vectors and all(len(v) in (576, 64) for v in vectors), what
    return got


@pytest.mark.parametrize("n", SIZES)
def test_every_context_size_embeds_and_the_server_lives(serve, n):
    got = walk(serve, {"num_ctx": n})
    assert set(got.values()) == {200}, got  # every size from 256 to the trained context is served


@pytest.mark.parametrize("options", OPTIONS, ids=[",".join(f"{k}={v}" for k, v in o.items()) for o in OPTIONS])
def test_the_options_that_shape_a_context_answer_or_refuse(serve, options):
    walk(serve, options)
    assert serve.call("GET", "/api/tags").status_code == 200
