"""Two faces as a client meets them over real HTTP: a tool call streamed by the real default model (through
the official ``openai`` client, delta by delta), and a model whose file llama.cpp cannot load (each API's
error shape with one sentence, and the server goes on serving the model next to it)."""

from __future__ import annotations

import json

import httpx
import ollama
import openai
import pytest

from tests.server.derived import install_derived, serve
from tests.server.test_tool_choice import CHAT_TOOLS, QUESTION, TOOL_MODEL
from tests.support import DEFAULT_MODEL, tiny_gguf

BROKEN = "broken:tiny"


def test_a_forced_tool_call_streams_as_deltas(tool_server):
    client = openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model=TOOL_MODEL, messages=[{"role": "user", "content": QUESTION}],
                                            tools=CHAT_TOOLS, tool_choice="required", temperature=0, stream=True)
    chunks = list(stream)
    calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices]
    assert calls, "no tool_calls delta in the stream"
    assert {tc.index for tc in calls} == {0}
    assert calls[0].id and calls[0].function.name == "get_secret_number"
    arguments = "".join(tc.function.arguments or "" for tc in calls)
    assert json.loads(arguments) == {"person": "Alice"}
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == ["tool_calls"]
    assert not any(ch.choices[0].delta.content for ch in chunks if ch.choices)  # the call is not echoed as text


@pytest.fixture(scope="module")
def broken_server(tmp_path_factory, installed_default_model):
    from tests.support import TEST_HOME, install_copy

    home = tmp_path_factory.mktemp("faces-broken")
    gguf = tiny_gguf(tmp_path_factory.mktemp("faces-gguf") / "broken.gguf", "llama", bpe_vocab=True)
    store = install_derived(gguf, BROKEN, home, wheel_name="broken-tiny.whl", member="broken_tiny/model.gguf")
    install_copy(store.paths.models, TEST_HOME / "data" / "models")  # the default model beside it
    srv = serve(store)
    yield srv
    srv.stop()
    srv.engine.close()


def test_a_model_that_fails_to_load_is_one_sentence_in_each_api(broken_server):
    url = broken_server.url
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=url).generate(model=BROKEN, prompt="Hi", options={"num_predict": 2})
    assert e.value.status_code == 500
    message = str(e.value.error)
    assert "load" in message.lower() and "Traceback" not in message and "\n" not in message.strip()

    with pytest.raises(openai.APIStatusError) as oe:
        openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0).chat.completions.create(
            model=BROKEN, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert oe.value.status_code == 500
    body = oe.value.response.json()
    assert set(body) == {"error"} and body["error"]["message"] and "load" in body["error"]["message"].lower()

    r = httpx.post(url + "/api/chat", timeout=120, json={"model": BROKEN, "stream": True,
                                                         "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 500 and "error" in r.json()  # refused before the stream starts: no 200 + broken NDJSON
    assert broken_server.engine.ps() == []  # nothing half-loaded stays resident

    # the server goes on: the model next to it answers
    ok = ollama.Client(host=url).generate(model=DEFAULT_MODEL, prompt="Say hi.", options={"num_predict": 3,
                                                                                           "temperature": 0})
    assert ok.response.strip() and ok.done
