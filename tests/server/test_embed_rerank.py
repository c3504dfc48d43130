"""Embedding and reranking models on every face of the server, through the official ``ollama`` and ``openai`` clients
and curl: the made BERT embedder and reranker (:mod:`tests.support_embed`) pulled into a private store beside the
default model. Their numbers are compared with the backend's own here; with llama-server's in
``tests/server/test_llama_server_parity.py``."""

from __future__ import annotations

import json
import subprocess

import httpx
import numpy as np
import ollama
import openai
import pytest

from tests.support_embed import EMBEDDER, RERANKER

CHAT = "smollm2:135m"
Q = "what is the capital of france"
DOCS = ["paris is the capital of france", "the apple is red", "the cat sat on the mat", "hello world"]
LONG = " ".join(["cat", "dog", "bird"] * 240)  # over the made models' 512-token context
RERANK_PATHS = ["/v1/rerank", "/v1/reranking", "/rerank", "/reranking", "/api/rerank"]


@pytest.fixture(scope="module")
def esrv(installed_default_model, bert_embedder, bert_reranker, tmp_path_factory):
    from tests.server.derived import serve
    from tests.support_embed import install_embed_models

    srv = serve(install_embed_models(tmp_path_factory.mktemp("embed-home"), bert_embedder, bert_reranker))
    yield srv
    srv.stop()
    srv.engine.close()


@pytest.fixture(scope="module")
def url(esrv) -> str:
    return esrv.url


def rerank(url: str, path: str = "/v1/rerank", **body):
    return httpx.post(url + path, json={"model": RERANKER, "query": Q, "documents": DOCS, **body}, timeout=60)


# ------------------------------------------------------------------------------------------ capabilities


def test_capabilities_come_from_the_gguf(url):
    c = ollama.Client(host=url)
    assert c.show(EMBEDDER).capabilities == ["embedding"]
    assert c.show(RERANKER).capabilities == ["rerank"]
    assert "completion" in c.show(CHAT).capabilities
    tags = {m["name"]: m["capabilities"] for m in httpx.get(url + "/api/tags").json()["models"]}
    assert tags[EMBEDDER] == ["embedding"] and tags[RERANKER] == ["rerank"]
    models = {m["id"]: m for m in httpx.get(url + "/v1/models").json()["data"]}
    assert models[EMBEDDER]["capabilities"] == ["embedding"]


@pytest.mark.parametrize("model", [EMBEDDER, RERANKER])
def test_chat_and_generate_to_an_embedding_model_are_a_400_that_says_so(esrv, url, model):
    esrv.engine.unload(model)  # another test of this module may have loaded it: these requests must not
    c = ollama.Client(host=url)
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model, messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 400 and "model and does not support chat or text generation" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        c.generate(model, prompt="hi")
    assert e.value.status_code == 400
    oa = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="does not support chat"):
        oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    assert not any(m["name"] == model for m in httpx.get(url + "/api/ps").json()["models"])  # nothing loaded


# ------------------------------------------------------------------------------------------ embeddings


def test_embed_through_both_clients_batched_as_the_backend_makes_them(url, esrv):
    c = ollama.Client(host=url)
    r = c.embed(EMBEDDER, input=DOCS)
    assert len(r.embeddings) == 4 and len(r.embeddings[0]) == 64
    assert r.prompt_eval_count == sum(len(d.split()) + 2 for d in DOCS)  # every word is one piece, + [CLS] [SEP]
    direct = esrv.engine.embed_many(EMBEDDER, DOCS)
    assert np.allclose(r.embeddings, direct.vectors, atol=1e-6)
    oa = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    got = oa.embeddings.create(model=EMBEDDER, input=DOCS)
    assert np.allclose([d.embedding for d in got.data], direct.vectors, atol=1e-6)
    assert got.usage.prompt_tokens == r.prompt_eval_count
    legacy = httpx.post(url + "/api/embeddings", json={"model": EMBEDDER, "prompt": DOCS[0]}).json()["embedding"]
    assert np.allclose(legacy, direct.vectors[0], atol=1e-6)
    ps = {m["name"]: m for m in httpx.get(url + "/api/ps").json()["models"]}
    assert ps[EMBEDDER]["context_length"] == 512  # loaded once, its context capped to what it was trained for


def test_truncate_is_honoured(url):
    c = ollama.Client(host=url)
    cut = c.embed(EMBEDDER, input=[LONG])
    assert len(cut.embeddings[0]) == 64 and cut.prompt_eval_count == 512
    with pytest.raises(ollama.ResponseError) as e:
        c.embed(EMBEDDER, input=["hello", LONG], truncate=False)
    assert e.value.status_code == 400 and "Input 1 has" in e.value.error and "holds 512" in e.value.error


def test_dimensions_shorten_only_a_matryoshka_model(url):
    c = ollama.Client(host=url)
    full = np.array(c.embed(EMBEDDER, input="hello world").embeddings[0])
    short = c.embed(EMBEDDER, input="hello world", dimensions=32).embeddings[0]
    assert np.allclose(short, full[:32] / np.linalg.norm(full[:32]), atol=1e-6)
    oa = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    assert len(oa.embeddings.create(model=EMBEDDER, input="hello", dimensions=16).data[0].embedding) == 16
    with pytest.raises(openai.BadRequestError, match="trained for embeddings of 16 to 64 dimensions, not 8"):
        oa.embeddings.create(model=EMBEDDER, input="hello", dimensions=8)
    with pytest.raises(openai.BadRequestError, match="not known to be Matryoshka-trained"):
        oa.embeddings.create(model=CHAT, input="hello", dimensions=32)
    assert len(c.embed(CHAT, input="hello", dimensions=4096).embeddings[0]) == 576  # at or above the width: as is


def test_a_reranker_makes_no_embeddings(url):
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=url).embed(RERANKER, input="hello")
    assert e.value.status_code == 400 and "is a reranking model" in e.value.error


# ------------------------------------------------------------------------------------------ rerank


@pytest.mark.parametrize("path", RERANK_PATHS)
def test_rerank_on_every_path(url, esrv, path):
    r = rerank(url, path)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == RERANKER and body["object"] == "list"
    scores = esrv.engine.rerank(RERANKER, Q, DOCS).scores
    results = body["results"]
    assert [x["index"] for x in results] == sorted(range(4), key=lambda i: -scores[i])
    assert [x["relevance_score"] for x in results] == pytest.approx(sorted(scores, reverse=True), abs=1e-6)
    assert body["usage"]["prompt_tokens"] == sum(len(d.split()) for d in DOCS) + 4 * (len(Q.split()) + 2)
    assert "document" not in results[0]


def test_rerank_top_n_documents_as_objects_and_return_documents_with_curl(url):
    body = {"model": RERANKER, "query": Q, "documents": [{"text": d} for d in DOCS], "top_n": 2,
            "return_documents": True}
    out = subprocess.run(["curl", "-sS", "-X", "POST", url + "/v1/rerank", "-H", "Content-Type: application/json",
                          "-d", json.dumps(body)], capture_output=True, text=True, timeout=60, check=True).stdout
    results = json.loads(out)["results"]
    assert len(results) == 2 and results[0]["relevance_score"] >= results[1]["relevance_score"]
    assert all(x["document"] == {"text": DOCS[x["index"]]} for x in results)
    plain = rerank(url, top_n=2).json()["results"]
    assert [x["index"] for x in plain] == [x["index"] for x in results]


def test_a_document_over_the_context_is_cut_with_a_flag_or_refused(url):
    r = httpx.post(url + "/v1/rerank", json={"model": RERANKER, "query": Q, "documents": [LONG, "dog"]}, timeout=60)
    flags = {x["index"]: x.get("truncated", False) for x in r.json()["results"]}
    assert flags == {0: True, 1: False}
    r = httpx.post(url + "/v1/rerank", json={"model": RERANKER, "query": Q, "documents": [LONG],
                                            "truncate": False}, timeout=60)
    assert r.status_code == 400 and "Document 0 has" in r.json()["error"]["message"]


@pytest.mark.parametrize("body, status, words", [
    ({"documents": []}, 400, "documents must be a non-empty list"),
    ({"top_n": 0}, 400, "top_n must be at least 1"),
    ({"model": EMBEDDER}, 400, "has no rank head"),
    ({"model": CHAT}, 400, "has no rank head"),
    ({"model": "no-such:model"}, 404, "neither installed nor in the catalog"),
    ({"query": 3}, 400, "query"),
])
def test_bad_rerank_requests_in_each_apis_shape(url, body, status, words):
    for path in ("/v1/rerank", "/rerank", "/api/rerank"):
        r = rerank(url, path, **body)
        assert r.status_code == status, (path, r.text)
        err = r.json()["error"]
        message = err if path == "/api/rerank" else err["message"]  # Ollama's shape, else OpenAI's (llama-server's)
        assert isinstance(message, str) and words in message, (path, message)


# ------------------------------------------------------------------------------------------ beside chat


def test_embeddings_beside_chat_streams_need_no_reload_and_change_nothing(url, esrv):
    """A chat model embeds on its own decode loop (a second, pooling context) while its chat streams run: no reload,
    the streams give their solo text, the vectors their solo values; the embedder and the reranker answer meanwhile."""
    import threading

    c = ollama.Client(host=url)
    opts = {"temperature": 0, "num_predict": 24, "seed": 1}
    msgs = [{"role": "user", "content": "Name three colours."}]
    solo_text = c.chat(CHAT, messages=msgs, options=opts).message.content
    running = [m for m in esrv.engine.ps() if m.name == CHAT]  # loaded for chat (no embedding context yet)
    solo_vecs = c.embed(CHAT, input=DOCS).embeddings
    texts: list[str] = []

    def stream() -> None:
        texts.append("".join(p.message.content for p in ollama.Client(host=url).chat(
            CHAT, messages=msgs, options=opts, stream=True)))

    threads = [threading.Thread(target=stream) for _ in range(2)]
    for t in threads:
        t.start()
    during = [c.embed(CHAT, input=DOCS).embeddings for _ in range(3)]
    other = c.embed(EMBEDDER, input=DOCS).embeddings
    ranked = rerank(url).json()["results"]
    for t in threads:
        t.join()
    assert texts == [solo_text, solo_text]
    for vecs in during:
        assert np.allclose(vecs, solo_vecs, atol=1e-4)
    assert len(other) == 4 and len(ranked) == 4
    assert [m for m in esrv.engine.ps() if m.name == CHAT] == running  # the same loaded model: no reload


def test_metrics_count_the_pooled_inputs(url):
    def count(name: str, model: str) -> float:
        for line in httpx.get(url + "/metrics").text.splitlines():
            if line.startswith(f"localllm_{name}_total{{") and f'model="{model}"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = count("pooled_inputs", RERANKER), count("pooled_tokens", RERANKER)
    body = rerank(url).json()
    after = count("pooled_inputs", RERANKER), count("pooled_tokens", RERANKER)
    assert after[0] - before[0] == len(DOCS) and after[1] - before[1] == body["usage"]["prompt_tokens"]
