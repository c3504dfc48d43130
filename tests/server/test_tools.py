"""Tool calls in both APIs' shapes. No installed test model has a tool-aware chat template, so the
backend is the fake one (it emits a fixed tool call) and the template capability check is forced on:
what is tested is the server's translation, through the official clients."""

from __future__ import annotations

import json

import ollama
import openai
import pytest

from tests.server.conftest import MODEL, start

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def tool_server(installed_default_model):
    from backends.fake import FakeBackend
    from localllm.engine import Engine
    from localllm.server import common

    class ToolCalling(FakeBackend):
        def __init__(self, spec):
            spec.extra.update(tool_calls=[{"name": "get_weather", "arguments": {"city": "Paris"}}])
            super().__init__(spec)

    mp = pytest.MonkeyPatch()
    mp.setattr(common, "template_supports_tools", lambda template: True)
    srv = start(Engine(keep_alive=300, backend_class=lambda name: ToolCalling))
    yield srv
    srv.stop()
    srv.engine.close()
    mp.undo()


def test_ollama_tool_calls(tool_server):
    client = ollama.Client(host=tool_server.url)
    r = client.chat(MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS)
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    streamed = [c for c in client.chat(MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
                                       stream=True) if c.message.tool_calls]
    assert streamed[0].message.tool_calls[0].function.arguments == {"city": "Paris"}
    # the tool's answer goes back in as a message with the call in the history
    r = client.chat(MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}, r.message,
                                     {"role": "tool", "content": "sunny", "tool_name": "get_weather"}], tools=TOOLS)
    assert r.done


def test_openai_tool_calls(tool_server):
    client = openai.OpenAI(base_url=tool_server.url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"} and call.id
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                                 tools=TOOLS, stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0][0].function.name == "get_weather" and deltas[0][0].index == 0
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    follow = client.chat.completions.create(model=MODEL, tools=TOOLS, messages=[
        {"role": "user", "content": "Weather?"}, choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
    assert follow.choices[0].finish_reason == "tool_calls"
