"""Anthropic's Messages API (``/v1/messages``) through the official ``anthropic`` SDK and raw HTTP, on the real
default model: answers, the stream's event sequence, errors in Anthropic's shape, ``x-api-key``, token counts.
(Tool calls end to end: test_tool_choice.py; thinking blocks: test_thinking.py.)"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from tests.server.conftest import MODEL, start

GREEDY = {"options": {"temperature": 0, "seed": 1}}  # this SDK has no temperature argument: the extension
HI = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def client(url):
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)


def test_message(client):
    m = client.messages.create(model=MODEL, max_tokens=8, messages=HI, system="You are terse.", extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert 0 < m.usage.output_tokens <= 8 and m.usage.input_tokens + m.usage.cache_read_input_tokens > 5


def test_max_tokens_is_the_limit(client):
    m = client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Tell a story."}],
                               extra_body=GREEDY)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2


def test_system_blocks_and_content_blocks(client):
    as_text = client.messages.create(model=MODEL, max_tokens=6, system="Answer in French.", extra_body=GREEDY,
                                     messages=[{"role": "user", "content": "Say hello."}])
    as_blocks = client.messages.create(
        model=MODEL, max_tokens=6, extra_body=GREEDY,
        system=[{"type": "text", "text": "Answer in French.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}])
    assert as_blocks.content[0].text == as_text.content[0].text  # the same prompt either way


def test_stream_event_sequence_raw(url):
    r = httpx.post(url + "/v1/messages?beta=true", json={"model": MODEL, "max_tokens": 6, "messages": HI,
                                                         "stream": True, **GREEDY},
                   headers={"anthropic-version": "2023-06-01", "anthropic-beta": "x"}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = [f for f in r.text.split("\n\n") if f.strip()]
    events = []
    for f in frames:
        head, data = f.split("\n", 1)
        assert head.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data[6:])
        assert payload["type"] == head[7:]
        events.append(payload)
    types = [e["type"] for e in events]
    assert types[:3] == ["message_start", "ping", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[3:-3]) == {"content_block_delta"}
    start = events[0]["message"]
    assert start["content"] == [] and start["usage"]["output_tokens"] == 0 and start["stop_reason"] is None
    assert events[2]["content_block"] == {"type": "text", "text": ""} and events[2]["index"] == 0
    assert all(e["delta"]["type"] == "text_delta" for e in events[3:-3])
    delta = events[-2]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens") and delta["usage"]["output_tokens"] <= 6


def test_stream_matches_non_streaming(client):
    with client.messages.stream(model=MODEL, max_tokens=8, messages=HI, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    whole = client.messages.create(model=MODEL, max_tokens=8, messages=HI, extra_body=GREEDY)
    assert text == final.content[0].text == whole.content[0].text
    assert final.usage.output_tokens == whole.usage.output_tokens and final.stop_reason == whole.stop_reason


def test_multi_turn(client):
    m = client.messages.create(model=MODEL, max_tokens=6, extra_body=GREEDY, messages=[
        *HI, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again."}])
    assert m.content[0].text


def test_errors_in_anthropic_shape(client, url):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model:1b", max_tokens=5, messages=HI)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    assert "no-such-model:1b" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=0, messages=HI)
    assert e.value.body["error"] == {"type": "invalid_request_error",
                                     "message": "max_tokens is required and must be positive"}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=5, messages=[])
    assert "messages is required" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=5, messages=[
            {"role": "user", "content": [{"type": "hologram", "data": "x"}]}])  # (text documents are served)
    assert "'hologram' is not supported" in e.value.body["error"]["message"]
    for body, needle in (({"model": MODEL, "messages": HI}, "max_tokens is required and must be positive"),
                         ({"model": MODEL, "max_tokens": "ten", "messages": HI}, "invalid value for max_tokens: "),
                         ({"model": MODEL, "max_tokens": 5, "messages": "hello"}, "invalid value for messages: "),
                         (b"{", "invalid JSON in the request body")):
        r = (httpx.post(url + "/v1/messages", content=body) if isinstance(body, bytes)
             else httpx.post(url + "/v1/messages", json=body))
        assert r.status_code == 400, body
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert err["error"]["message"].startswith(needle), err
        assert err["request_id"].startswith("req_")


def test_unknown_fields_are_ignored(url):
    r = httpx.post(url + "/v1/messages", json={"model": MODEL, "max_tokens": 3, "messages": HI, "metadata": {
        "user_id": "u"}, "service_tier": "auto", "container": None, "some_future_field": {"a": 1},
        "context_management": {"edits": []}})
    assert r.status_code == 200 and r.json()["type"] == "message"


def test_a_mid_stream_error_is_an_error_event(installed_default_model):
    from localllm.engine import Engine
    from tests.fakes import FakeSource

    class Crashing(FakeSource):
        def __init__(self, spec):
            super().__init__(spec, reply="one two three four five six", chunk=4, crash_after=2)

    srv = start(Engine(keep_alive=300, backend_class=lambda name: Crashing))
    try:
        r = httpx.post(srv.url + "/v1/messages", json={"model": MODEL, "max_tokens": 50, "messages": HI,
                                                       "stream": True}, timeout=30)
        frames = [f for f in r.text.split("\n\n") if f.strip()]
        last = json.loads(frames[-1].split("\n", 1)[1][6:])
        assert frames[-1].startswith("event: error\n") and last["error"]["type"] == "api_error"
        assert "crashed" in last["error"]["message"] and "/" not in last["error"]["message"]
        r = httpx.post(srv.url + "/v1/messages", json={"model": MODEL, "max_tokens": 50, "messages": HI})
        assert r.status_code == 500 and r.json()["error"]["type"] == "api_error"
        assert "crashed" in r.json()["error"]["message"]
    finally:
        srv.stop()
        srv.engine.close()


def test_x_api_key_where_a_key_is_set(server):
    srv = start(server.engine, api_key="s3cret")
    try:
        bad = anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as e:
            bad.messages.create(model=MODEL, max_tokens=2, messages=HI)
        assert e.value.body["error"]["type"] == "authentication_error"
        good = anthropic.Anthropic(base_url=srv.url, api_key="s3cret", max_retries=0)  # sends x-api-key
        assert good.messages.create(model=MODEL, max_tokens=2, messages=HI).content
        token = anthropic.Anthropic(base_url=srv.url, auth_token="s3cret", max_retries=0)  # Authorization: Bearer
        assert token.messages.create(model=MODEL, max_tokens=2, messages=HI).content
        r = httpx.get(srv.url + "/api/tags", headers={"x-api-key": "s3cret"})
        assert r.status_code == 200 and MODEL in [m["name"] for m in r.json()["models"]]  # one key for every API
    finally:
        srv.stop()


def test_count_tokens(client):
    short = client.messages.count_tokens(model=MODEL, messages=HI)
    longer = client.messages.count_tokens(model=MODEL, system="You are a helpful assistant.", messages=[
        *HI, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Now say goodbye, please."}])
    assert 0 < short.input_tokens < longer.input_tokens


def test_models_list_reads_in_both_sdks(client, url):
    import openai

    ids = [m.id for m in client.models.list().data]
    assert MODEL in ids
    assert MODEL in [m.id for m in openai.OpenAI(base_url=url + "/v1", api_key="x").models.list().data]
