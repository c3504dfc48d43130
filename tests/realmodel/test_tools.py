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


def _fn(name: str, props: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": props, "required": required}}}


# the tools of benchmarks/tool_calls.py, where the model by itself names tools that are not offered
OFFERED = [
    _fn("get_weather", {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        ["city"]),
    _fn("search_web", {"query": {"type": "string"}, "max_results": {"type": "integer"}}, ["query"]),
    _fn("send_email", {"to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}},
        ["to", "subject", "body"]),
    _fn("convert_currency", {"amount": {"type": "number"}, "from_currency": {"type": "string"},
                             "to_currency": {"type": "string"}}, ["amount", "from_currency", "to_currency"]),
    _fn("create_event", {"title": {"type": "string"},
                         "when": {"type": "object", "properties": {"date": {"type": "string"},
                                                                   "hour": {"type": "integer"}},
                                  "required": ["date", "hour"]},
                         "attendees": {"type": "array", "items": {"type": "object", "properties": {
                             "name": {"type": "string"}, "email": {"type": "string"}}, "required": ["name"]}}},
        ["title", "when", "attendees"]),
]
BUDGET = [{"role": "system", "content": "You are a helpful assistant. Use the tools when they help."},
          {"role": "user", "content": "Set up a meeting 'Budget' on 2026-12-11 at 16 with finance (fin@example.com)."}]


def _valid(calls: list) -> bool:
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in OFFERED}
    try:
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
    except (KeyError, ValueError, jsonschema.ValidationError):
        return False
    return bool(calls)


def test_openai_client_constrained_call_is_valid_where_the_free_model_names_no_offered_tool(coder, coder_url,
                                                                                              free_url):
    """By itself the model calls a tool "Budget" (not offered): no valid call. Constrained, the call is
    ``create_event`` with arguments that satisfy its nested schema, the same streamed and not."""
    kw = {"model": coder, "messages": BUDGET, "tools": OFFERED, "temperature": 0, "max_tokens": 160,
          "extra_body": {"options": {"num_ctx": CTX}}}
    free = openai.OpenAI(base_url=free_url + "/v1", api_key="x", max_retries=0).chat.completions.create(**kw)
    assert not _valid(free.choices[0].message.tool_calls or []), free.choices[0].message
    client = openai.OpenAI(base_url=coder_url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "create_event" and _valid([call])
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    assert deltas and deltas[0].function.name == "create_event"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == json.loads(call.function.arguments)


def test_anthropic_client_gets_a_tool_use_block(coder, coder_url):
    client = anthropic.Anthropic(base_url=coder_url, api_key="unused", max_retries=0)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in WEATHER]
    r = client.messages.create(model=coder, max_tokens=96, tools=tools, extra_body={"temperature": 0},  # type: ignore
                               messages=[{"role": "user", "content": ASK_WEATHER}])
    assert r.stop_reason == "tool_use"
    (use,) = [b for b in r.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
