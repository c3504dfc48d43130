"""What one client's request may do to the server's loads and work (issue 46), against a real server over HTTP:
load options a request chooses (``num_thread``, ``num_ctx``) stay bounded by the machine and count for that
request's load only; a prompt that can never fit is a 400 at once; a load the planner refuses is the API's 4xx;
embedding and rerank requests are capped (413) and stop when their client leaves."""

from __future__ import annotations

import statistics
import time

import anthropic
import httpx
import ollama
import openai
import psutil
import pytest

from tests.support_embed import RERANKER

MODEL = "smollm2:135m"
PLAIN = {"temperature": 0, "num_predict": 32, "seed": 1}
WORD = "hello "  # one token of the default model


@pytest.fixture(scope="module")
def hsrv(installed_default_model, bert_embedder, bert_reranker, tmp_path_factory):
    from tests.server.derived import serve
    from tests.support_embed import install_embed_models

    srv = serve(install_embed_models(tmp_path_factory.mktemp("hostile-home"), bert_embedder, bert_reranker))
    yield srv
    srv.stop()
    srv.engine.close()


def generate(url: str, options: dict | None = None, timeout: float = 120, prompt: str = "Count to ten.") -> float:
    """Seconds one /api/generate takes (the answer read whole)."""
    t0 = time.perf_counter()
    r = httpx.post(url + "/api/generate", json={"model": MODEL, "prompt": prompt, "stream": False,
                                                "options": {**PLAIN, **(options or {})}}, timeout=timeout)
    assert r.status_code == 200, r.text
    return time.perf_counter() - t0


def ps(url: str) -> dict:
    (m,) = [m for m in httpx.get(url + "/api/ps").json()["models"] if m["name"] == MODEL]
    return m


def resident(srv):
    (m,) = [m for m in srv.engine.ps() if m.name == MODEL]
    return m


# ------------------------------------------------------------------------------------------ load options


def test_num_thread_1024_leaves_later_plain_requests_as_fast_as_before(hsrv):
    """Issue 46: ``num_thread: 1024`` in an embed request made the server run 1,028 threads and every later plain
    request take 125 s for 32 tokens (under 1 s before). Threads are capped to the cores this process may use."""
    url = hsrv.url
    generate(url)  # loaded and warm
    before = statistics.median(generate(url) for _ in range(3))
    r = httpx.post(url + "/api/embed", json={"model": MODEL, "input": "hi", "options": {"num_thread": 1024}},
                   timeout=120)
    assert r.status_code == 200, r.text
    assert psutil.Process().num_threads() < 200  # the server runs in this process: no thread per asked-for "core"
    after = statistics.median(generate(url, timeout=10 * before + 10) for _ in range(3))
    assert after <= 3 * before + 1.0, (before, after)
    assert resident(hsrv).model.source.n_threads <= len(psutil.Process().cpu_affinity())


def test_a_plain_request_after_an_odd_load_gets_the_default_load_again(hsrv):
    """A request's ``num_ctx`` / ``num_thread`` load the model for it; the next request that asks for neither gets
    the default load, not the odd one (as Ollama reloads when a request's options differ from the loaded ones)."""
    url = hsrv.url
    generate(url)
    default_ctx, default_threads = ps(url)["context_length"], resident(hsrv).model.source.n_threads
    generate(url, {"num_ctx": 2048, "num_thread": 1})
    assert ps(url)["context_length"] == 2048 and resident(hsrv).model.source.n_threads == 1
    generate(url)
    assert ps(url)["context_length"] == default_ctx
    assert resident(hsrv).model.source.n_threads == default_threads


# ------------------------------------------------------------------------------------------ context growth


def test_a_prompt_that_can_never_fit_is_a_400_without_a_reload(hsrv):
    """A prompt longer than the model was trained for (8,192 tokens) answers 400 at once: the model is not loaded
    again at its largest context first."""
    url = hsrv.url
    generate(url)
    loaded = resident(hsrv)
    c = ollama.Client(host=url, timeout=600)
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(MODEL, messages=[{"role": "user", "content": WORD * 9000}], options={"num_predict": 4})
    assert e.value.status_code == 400 and "token" in e.value.error
    assert resident(hsrv) is loaded and ps(url)["context_length"] == loaded.info.n_ctx  # no load happened


def test_a_long_prompt_grows_the_context_and_the_default_comes_back_when_long_prompts_stop(hsrv):
    """A chat longer than the default context grows it; after three requests in a row that fit the default context
    (``localllm.residency.SHRINK_AFTER``) the next one gets the default load again."""
    url = hsrv.url
    generate(url)
    default_ctx = ps(url)["context_length"]
    c = ollama.Client(host=url, timeout=600)
    r = c.chat(MODEL, messages=[{"role": "user", "content": WORD * (default_ctx + 100)}], options={"num_predict": 2})
    assert r.prompt_eval_count > default_ctx
    grown = ps(url)["context_length"]
    assert grown > default_ctx
    for _ in range(3):  # short requests, served by the grown load
        generate(url)
        assert ps(url)["context_length"] == grown
    generate(url)  # the long prompts stopped: the default load again
    assert ps(url)["context_length"] == default_ctx


@pytest.fixture
def small_machine_server(hsrv):
    """A server whose engine plans for a CPU machine with 1,400 MiB of RAM, where the default model fits with a
    2,048-token context but not with the 8,192 tokens it was trained for, which every request asks for
    (``context_length``, the server's ``LOCALLLM_CONTEXT_LENGTH``)."""
    from dataclasses import replace

    from localllm.engine import Engine
    from tests.server.conftest import start

    ram = 1400 << 20
    small = replace(hsrv.engine.hardware, ram_total=ram, ram_available=ram, gpus=[])
    srv = start(Engine(store=hsrv.engine.store, hardware=small, keep_alive=0, memory_budget=ram), context_length=8192)
    yield srv
    srv.stop()
    srv.engine.close()


def test_a_context_too_big_for_the_machine_is_a_4xx_in_every_apis_shape(small_machine_server):
    url = small_machine_server.url
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=url).chat(MODEL, messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 400 and "context does not fit" in e.value.error
    oa = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="context does not fit"):
        oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="context does not fit"):
        oa.responses.create(model=MODEL, input="hi", max_output_tokens=16)
    an = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="context does not fit"):
        an.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])


# ------------------------------------------------------------------------------------------ rerank / embed caps


def test_a_huge_rerank_is_a_413_with_one_sentence_at_once(hsrv):
    """Issue 46: 200,000 documents (an 840 KB body) got no answer in 60 s and ran for ten minutes."""
    docs = ["the cat"] * 200_000
    t0 = time.perf_counter()
    r = httpx.post(hsrv.url + "/v1/rerank", json={"model": RERANKER, "query": "cat", "documents": docs}, timeout=30)
    assert r.status_code == 413
    assert r.json()["error"]["message"] == ("A rerank takes at most 1,000 documents (LOCALLLM_MAX_RERANK_DOCUMENTS), "
                                            "not 200,000; send them in smaller requests.")
    r = httpx.post(hsrv.url + "/api/rerank", json={"model": RERANKER, "query": "cat", "documents": docs}, timeout=30)
    assert r.status_code == 413 and "at most 1,000 documents" in r.json()["error"]
    assert time.perf_counter() - t0 < 20


def test_embedding_inputs_and_tokens_are_capped(hsrv):
    oa = openai.OpenAI(base_url=hsrv.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as e:
        oa.embeddings.create(model=MODEL, input=["hi"] * 3000)
    assert e.value.status_code == 413 and "at most 2,048 inputs" in e.value.message
    engine = hsrv.engine
    engine.max_pooled_tokens = 500
    try:
        with pytest.raises(ollama.ResponseError) as e2:
            ollama.Client(host=hsrv.url).embed(MODEL, input=["the cat sat on the mat"] * 200)
        assert e2.value.status_code == 413 and "more than the 500 one request may take" in e2.value.error
        r = httpx.post(hsrv.url + "/v1/rerank", json={"model": RERANKER, "query": "cat",
                                                       "documents": ["the cat sat on the mat"] * 200}, timeout=60)
        assert r.status_code == 413 and "query-document pairs take" in r.json()["error"]["message"]
    finally:
        engine.max_pooled_tokens = 300_000


def test_a_client_that_leaves_mid_rerank_frees_the_server(hsrv):
    """A rerank whose client disconnects stops at its next batch: the CPU goes quiet and a chat answers as fast as
    before (issue 46: it ran for ten minutes after the client had gone)."""
    engine = hsrv.engine
    generate(hsrv.url)
    before = statistics.median(generate(hsrv.url) for _ in range(3))
    docs = [f"the cat sat on the mat {i} and the dog sat on the road" for i in range(60_000)]
    engine.max_rerank_documents = engine.max_pooled_tokens = 0  # no cap: what a client that leaves costs
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(hsrv.url + "/v1/rerank", json={"model": RERANKER, "query": "cat", "documents": docs},
                       timeout=httpx.Timeout(30, read=3))
        time.sleep(1.0)  # its next check
        busy = psutil.Process().cpu_percent(interval=1.0)
        after = generate(hsrv.url, timeout=10 * before + 10)
    finally:
        engine.max_rerank_documents, engine.max_pooled_tokens = 1000, 300_000
    assert busy < 50, busy  # the rerank stopped (it took both cores)
    assert after <= 3 * before + 1.0, (before, after)
