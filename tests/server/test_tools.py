"""Tool calls in both APIs' shapes, through the official clients. Both servers hold the default model with a
tool-capable chat template: a copy of its GGUF carrying Qwen2.5-Instruct's template (``<tools>`` in the system
turn, ``<tool_call>`` answers, ``<tool_response>`` turns), installed in a private store, so the server's own
capability check (``"tools"`` in ``/api/show``, a 400 for a model without) runs for real.

* The fake backend (it emits a fixed tool call): the server's translation of calls, streamed and not.
* End to end on the real model: the call arrives in ``tool_calls``, the tool's result goes back
  as a ``tool`` message and the next answer repeats it. SmolLM2-135M does not emit a call on its own
  (a system prompt showing the format and few-shot turns were tried: it answers in prose), so the
  *first* turn is constrained with ``format`` (a JSON schema of the call); the second is free."""

from __future__ import annotations

import json

import ollama
import openai
import pytest

from tests.server.derived import install_derived, serve, tool_model
from tests.support import QWEN25_TEMPLATE

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}]


TOOL_MODEL = "smollm2-tools:135m"


@pytest.fixture(scope="module")
def tool_store(default_model_path, tmp_path_factory):
    """A private store holding the default model with Qwen2.5's chat template as ``TOOL_MODEL``, installed through
    the store's own mirror path from a local stand-in (the GGUF and its wheel are made once and cached)."""
    gguf, wheel = tool_model(default_model_path)
    store = install_derived(gguf, TOOL_MODEL, tmp_path_factory.mktemp("tools-home"), **wheel)
    assert store.get(TOOL_MODEL).info["chat_template"] == QWEN25_TEMPLATE
    return store


@pytest.fixture(scope="module")
def tool_server(tool_store):
    from tests.fakes import FakeSource

    class ToolCalling(FakeSource):
        def __init__(self, spec):
            super().__init__(spec, tool_calls=[{"name": "get_weather", "arguments": {"city": "Paris"}}])

    srv = serve(tool_store, backend_class=lambda name: ToolCalling)
    yield srv
    srv.stop()
    srv.engine.close()


def test_ollama_tool_calls(tool_server):
    client = ollama.Client(host=tool_server.url)
    r = client.chat(TOOL_MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS)
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    streamed = [c for c in client.chat(TOOL_MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
                                       stream=True) if c.message.tool_calls]
    assert streamed[0].message.tool_calls[0].function.arguments == {"city": "Paris"}
    # the tool's answer goes back in as a message with the call in the history
    history = [{"role": "user", "content": "Weather in Paris?"}, r.message,
               {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
    r = client.chat(TOOL_MODEL, messages=history, tools=TOOLS)
    assert r.done


def test_openai_tool_calls(tool_server):
    client = openai.OpenAI(base_url=tool_server.url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model=TOOL_MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                       tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"} and call.id
    chunks = list(client.chat.completions.create(model=TOOL_MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                                 tools=TOOLS, stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0][0].function.name == "get_weather" and deltas[0][0].index == 0
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    follow = client.chat.completions.create(model=TOOL_MODEL, tools=TOOLS, messages=[
        {"role": "user", "content": "Weather?"}, choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
    assert follow.choices[0].finish_reason == "tool_calls"


# ------------------------------------------------------------------------------------------ real model

SECRET = "48613"  # what the tool returns: nowhere else in the conversation, so an answer holding it used it
SECRET_TOOLS = [{"type": "function", "function": {
    "name": "get_secret_number", "description": "Returns the secret number of a person.",
    "parameters": {"type": "object", "properties": {"person": {"type": "string"}}, "required": ["person"]}}}]
CALL_SCHEMA = {"type": "object", "properties": {
    "name": {"const": "get_secret_number"},
    "arguments": {"type": "object", "properties": {"person": {"type": "string", "maxLength": 20}},
                  "required": ["person"], "additionalProperties": False}},
    "required": ["name", "arguments"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the secret number of Alice?"}]
GREEDY = {"temperature": 0, "seed": 1, "num_predict": 40}


@pytest.fixture(scope="module")
def qwen_template_server(tool_store):
    srv = serve(tool_store)
    yield srv
    srv.stop()
    srv.engine.close()


def test_real_model_tool_call_round_trip_ollama(qwen_template_server):
    client = ollama.Client(host=qwen_template_server.url)
    assert "tools" in client.show(TOOL_MODEL).capabilities  # the template takes tools
    r = client.chat(TOOL_MODEL, messages=ASK, tools=SECRET_TOOLS, format=CALL_SCHEMA, options=GREEDY)
    (call,) = r.message.tool_calls
    assert call.function.name == "get_secret_number" and call.function.arguments == {"person": "Alice"}
    assert not r.message.content  # the call is not also leaked as text
    history = [*ASK, r.message, {"role": "tool", "content": SECRET, "tool_name": "get_secret_number"}]
    r = client.chat(TOOL_MODEL, messages=history, tools=SECRET_TOOLS, options=GREEDY)
    assert not r.message.tool_calls and SECRET in r.message.content, r.message.content


def test_real_model_tool_call_round_trip_openai(qwen_template_server):
    client = openai.OpenAI(base_url=qwen_template_server.url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(
        model=TOOL_MODEL, messages=ASK, tools=SECRET_TOOLS, temperature=0, seed=1, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "call", "schema": CALL_SCHEMA}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_secret_number" and call.id
    assert json.loads(call.function.arguments) == {"person": "Alice"}
    follow = client.chat.completions.create(model=TOOL_MODEL, tools=SECRET_TOOLS, temperature=0, seed=1,
                                            max_tokens=40, messages=[
        *ASK, choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": SECRET}])
    answer = follow.choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert SECRET in answer.message.content, answer.message.content
