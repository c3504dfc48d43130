"""The one generation path, seen from every API that streams: an error before any output is the API's error
status (not a 200 stream), a client that disconnects mid-stream frees its slot at once, a stream and the
non-streaming answer carry the same text."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.server.conftest import MODEL

LONG = "Once upon a time, in a land far away, there lived a dragon who"
MSG = [{"role": "user", "content": LONG}]
# path, body (streaming), the generation limit's field, where the text is in a non-streaming answer
STREAMS = [
    ("/api/chat", {"messages": MSG, "options": {"seed": 3}}, "ollama"),
    ("/api/generate", {"prompt": LONG, "options": {"seed": 3}}, "ollama"),
    ("/v1/chat/completions", {"messages": MSG, "stream": True, "seed": 3}, "openai"),
    ("/v1/completions", {"prompt": LONG, "stream": True, "seed": 3}, "openai"),
    ("/v1/responses", {"input": LONG, "stream": True}, "openai"),
    ("/v1/messages", {"messages": MSG, "stream": True, "max_tokens": 3000}, "anthropic"),
]


def _limit(path: str, n: int, body: dict) -> dict:
    body = json.loads(json.dumps(body))
    if path.startswith("/api"):
        body["options"]["num_predict"] = n
    elif path == "/v1/responses":
        body["max_output_tokens"] = n
    else:
        body["max_tokens"] = n
    return body


def _message(api: str, body: dict) -> str:
    if api == "ollama":
        return body["error"]
    if api == "anthropic":
        assert body["type"] == "error"
    return body["error"]["message"]


@pytest.mark.parametrize("path, body, api", STREAMS)
def test_an_error_before_any_output_is_the_status(url, path, body, api):
    """A prompt that cannot fit the context (256 tokens here) fails before the first token: 400, not 200."""
    big = "word " * 600
    body = json.loads(json.dumps(body).replace(LONG, big))
    body = {**body, "model": MODEL, "options": {**body.get("options", {}), "num_ctx": 256}}
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text[:300]
    assert r.headers["content-type"].startswith("application/json")
    message = _message(api, r.json())
    if api == "anthropic":  # Anthropic's own words, which Claude Code shows
        assert message.startswith("prompt is too long: ") and message.endswith(" tokens > 256 maximum"), message
    else:
        assert "context" in message.lower()


@pytest.mark.parametrize("path, body, api", STREAMS)
def test_a_disconnect_mid_stream_frees_the_slot(server, url, path, body, api):
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", url + path, json={**_limit(path, 3000, body), "model": MODEL}) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            for _ in range(8):  # a few frames of output
                next(lines)
            (running,) = [m for m in server.engine.ps() if m.name == MODEL]
            assert running.active == 1
            t0 = time.monotonic()
    while running.active and time.monotonic() - t0 < 15:
        time.sleep(0.01)
    freed = time.monotonic() - t0
    # ~0.2 s on a quiet machine; 10 s still fails a generation that runs on to its 3000 tokens
    assert running.active == 0 and freed < 10, f"{path}: slot still held {freed:.1f}s after the disconnect"


def _streamed_text(path: str, raw: str) -> str:
    out = []
    for line in raw.splitlines():
        if path.startswith("/api"):
            if line:
                obj = json.loads(line)
                out.append(obj.get("response") or obj.get("message", {}).get("content") or "")
        elif line.startswith("data: ") and line != "data: [DONE]":
            obj = json.loads(line[6:])
            if path == "/v1/chat/completions" and obj["choices"]:
                out.append(obj["choices"][0]["delta"].get("content") or "")
            elif path == "/v1/completions" and obj["choices"]:
                out.append(obj["choices"][0]["text"])
            elif obj.get("type") == "response.output_text.delta":
                out.append(obj["delta"])
            elif obj.get("type") == "content_block_delta":
                out.append(obj["delta"].get("text", ""))
    return "".join(out)


def _whole_text(path: str, obj: dict) -> str:
    if path == "/api/chat":
        return obj["message"]["content"]
    if path == "/api/generate":
        return obj["response"]
    if path == "/v1/chat/completions":
        return obj["choices"][0]["message"]["content"]
    if path == "/v1/completions":
        return obj["choices"][0]["text"]
    if path == "/v1/responses":
        return obj["output"][0]["content"][0]["text"]
    return obj["content"][0]["text"]


@pytest.mark.parametrize("path, body, api", STREAMS)
def test_streamed_and_whole_answers_agree(url, path, body, api):
    body = {**_limit(path, 12, body), "model": MODEL}
    if path.startswith("/api"):
        body["options"]["temperature"] = 0
    else:
        body["options"] = {"temperature": 0}
    streamed = _streamed_text(path, httpx.post(url + path, json=body, timeout=60).text)
    body["stream"] = False
    whole = _whole_text(path, httpx.post(url + path, json=body, timeout=60).json())
    assert streamed and streamed == whole


def test_the_servers_default_context(server):
    """``LOCALLLM_CONTEXT_LENGTH`` (here ``context_length=``) is the context of requests that set none, for
    clients that cannot send ``num_ctx`` (Claude Code); a request's own ``num_ctx`` still wins."""
    from tests.server.conftest import start

    srv = start(server.engine, context_length=1536)
    try:
        r = httpx.post(srv.url + "/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": MSG}, timeout=60)
        assert r.status_code == 200
        assert next(m for m in server.engine.ps() if m.name == MODEL).info.n_ctx == 1536
        r = httpx.post(srv.url + "/api/chat", json={"model": MODEL, "messages": MSG, "stream": False,
                                                     "options": {"num_predict": 2, "num_ctx": 1024}}, timeout=60)
        assert r.status_code == 200
        assert next(m for m in server.engine.ps() if m.name == MODEL).info.n_ctx == 1024
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def crash_server(installed_default_model):
    """A model whose decoding crashes at its first token (the fake source: a real crash cannot be provoked)."""
    from localllm.engine import Engine
    from tests.fakes import FakeSource
    from tests.server.conftest import start

    class CrashesAtOnce(FakeSource):
        def __init__(self, spec):
            super().__init__(spec, reply="never said", crash_after=0)

    srv = start(Engine(keep_alive=300, backend_class=lambda name: CrashesAtOnce))
    yield srv
    srv.stop()
    srv.engine.close()


@pytest.mark.parametrize("path, body, api", STREAMS)
def test_a_crash_before_any_output_is_a_500(crash_server, path, body, api):
    r = httpx.post(crash_server.url + path, json={**_limit(path, 20, body), "model": MODEL}, timeout=30)
    assert r.status_code == 500 and r.headers["content-type"].startswith("application/json"), r.text[:300]
    message = _message(api, r.json())
    assert "crashed" in message and "/" not in message
