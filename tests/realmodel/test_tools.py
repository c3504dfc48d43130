"""Tool calls of a real small model (Qwen2.5-Coder-0.5B-Instruct) through the official ollama, openai and anthropic
clients.

What the model writes by itself for a plain request is a fenced ```` ```json {"name": …, "arguments": …} ``` ````
block, not its template's ``<tool_call>`` tags (``free_url``: the lazy grammar off): the stream parses that form. With
the grammar on (as shipped), a call, once begun, is a valid call to an offered tool with schema-valid arguments --
also where the model by itself writes something no parser takes."""

from __future__ import annotations

import json

import anthropic
import ollama
import openai
import pytest

from tests.realmodel.conftest import ASK_WEATHER, CTX, WEATHER

OPTS = {"temperature": 0, "num_ctx": CTX, "num_predict": 96}

# nested, typed arguments; the model by itself (no grammar) answers this one with arguments that break the schema
EVENT = [{"type": "function", "function": {
    "name": "create_event", "description": "Create a calendar event",
    "parameters": {"type": "object", "properties": {
        "title": {"type": "string"},
        "when": {"type": "object", "properties": {"date": {"type": "string"}, "hour": {"type": "integer"}},
                 "required": ["date", "hour"]},
        "attendees": {"type": "array", "items": {"type": "string"}}},
        "required": ["title", "when", "attendees"]}}}]


def _check_event(args: dict) -> None:
    assert set(args) == {"title", "when", "attendees"}, args
    assert isinstance(args["title"], str) and isinstance(args["attendees"], list)
    assert all(isinstance(a, str) for a in args["attendees"])
    assert set(args["when"]) == {"date", "hour"} and isinstance(args["when"]["hour"], int), args


@pytest.mark.parametrize("which", ["free", "constrained"])
def test_ollama_client_gets_the_call(which, coder, coder_url, free_url):
    """Both ways the weather question gives ``get_weather(city="Paris")`` in ``tool_calls`` and no JSON in the text."""
    client = ollama.Client(host=free_url if which == "free" else coder_url)
    r = client.chat(coder, messages=[{"role": "user", "content": ASK_WEATHER}], tools=WEATHER, options=OPTS)
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    assert "get_weather" not in (r.message.content or "")


def test_the_free_model_writes_a_fence_and_the_stream_parses_it(coder, free_url):
    """Without tools the same question shows what the model writes (a fenced JSON call); with tools that text is a
    call. (The raw form is what llama-server --jinja returns as content.)"""
    client = ollama.Client(host=free_url)
    tools_text = json.dumps(WEATHER)
    r = client.chat(coder, messages=[
        {"role": "system", "content": f"You may call these tools, answering with a JSON object: {tools_text}"},
        {"role": "user", "content": ASK_WEATHER}], options=OPTS)
    assert '"get_weather"' in r.message.content and "Paris" in r.message.content, r.message.content


def test_openai_client_constrained_call_is_schema_valid_streamed_and_not(coder, coder_url):
    client = openai.OpenAI(base_url=coder_url + "/v1", api_key="x", max_retries=0)
    ask = [{"role": "user", "content": "Create an event 'Team sync' on 2026-12-10 at 15 with alice and bob."}]
    r = client.chat.completions.create(model=coder, messages=ask, tools=EVENT, temperature=0, max_tokens=128,
                                       extra_body={"options": {"num_ctx": CTX}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "create_event"
    _check_event(json.loads(call.function.arguments))
    chunks = list(client.chat.completions.create(model=coder, messages=ask, tools=EVENT, temperature=0,
                                                 max_tokens=128, stream=True,
                                                 extra_body={"options": {"num_ctx": CTX}}))
    deltas = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    assert deltas and deltas[0].function.name == "create_event"
    args = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(args) == json.loads(call.function.arguments)
    assert chunks[-1].choices == [] or chunks[-1].choices[0].finish_reason in ("tool_calls", None)


def test_anthropic_client_gets_a_tool_use_block(coder, coder_url):
    client = anthropic.Anthropic(base_url=coder_url, api_key="unused", max_retries=0)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in WEATHER]
    r = client.messages.create(model=coder, max_tokens=96, temperature=0, tools=tools,  # type: ignore[arg-type]
                               messages=[{"role": "user", "content": ASK_WEATHER}])
    assert r.stop_reason == "tool_use"
    (use,) = [b for b in r.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
