"""The official ``openai`` Python client against ``localllm serve``'s ``/v1`` (real HTTP, real model)."""

from __future__ import annotations

import base64
import json
import struct

import openai
import pytest

from tests.server.conftest import MODEL


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_models(client):
    ids = [m.id for m in client.models.list().data]
    assert MODEL in ids
    m = client.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model" and m.created > 0
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model:1b")


def test_chat_non_streaming(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}],
                                       max_tokens=5, temperature=0, seed=1)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 5 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_with_usage(client):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}],
                                            max_tokens=5, temperature=0, seed=1, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 5
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}],
                                           max_tokens=5, temperature=0, seed=1)
    assert text == whole.choices[0].message.content


def test_chat_json_schema(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
              "required": ["name"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a colour as JSON."}], max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "colour", "schema": schema}})
    data = json.loads(r.choices[0].message.content)
    assert set(data) == {"name"} and isinstance(data["name"], str)


def test_num_ctx_extension_sets_the_context(client, server):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                   extra_body={"num_ctx": 1024})
    assert next(m for m in server.engine.ps() if m.name == MODEL).info.n_ctx == 1024
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                   extra_body={"options": {"num_ctx": 2048}})
    assert next(m for m in server.engine.ps() if m.name == MODEL).info.n_ctx == 2048


def test_completions(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text and r.usage.completion_tokens <= 4


def test_embeddings(client):
    r = client.embeddings.create(model=MODEL, input=["hello", "world"])
    assert [d.index for d in r.data] == [0, 1] and len(r.data[0].embedding) == 576
    r64 = client.embeddings.create(model=MODEL, input="hello", encoding_format="base64")
    raw = base64.b64decode(r64.data[0].embedding)  # little-endian float32, as OpenAI sends it
    values = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert len(values) == 576 and abs(values[0] - r.data[0].embedding[0]) < 1e-5


def test_errors_in_openai_shape(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model:1b", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["type"] == "not_found_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[])
    assert "too short" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert "does not support tools" in e.value.body["message"]
