"""Tool calls end to end on the real default model with a tool-capable chat template (Qwen2.5-Instruct's),
through the official SDKs of the OpenAI-style APIs and Anthropic's, round trips included.

SmolLM2-135M does not call a tool on its own (test_tools.py says what was tried), so the first turn forces one
with ``tool_choice`` (OpenAI ``"required"`` / a named function, Anthropic ``{"type": "any"}`` / a named tool):
the server turns the tools' parameter schemas into the grammar of one call. The tool's result goes back
(``function_call_output`` / ``tool_result``) and the free answer uses it. A parameter schema the grammar cannot
express is a 400 naming the keyword, in each API's shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

TOOL_MODEL = "smollm2-tools:135m"
SECRET = "48613"  # what the tool returns: nowhere else in the conversation
QUESTION = "What is the secret number of Alice?"
PARAMS = {"type": "object", "properties": {"person": {"type": "string", "maxLength": 20}}, "required": ["person"]}
ANTHROPIC_TOOLS = [{"name": "get_secret_number", "description": "Returns the secret number of a person.",
                    "input_schema": PARAMS}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_secret_number",
                    "description": "Returns the secret number of a person.", "parameters": PARAMS}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in RESPONSES_TOOLS[0].items() if k != "type"}}]
GREEDY = {"options": {"temperature": 0, "seed": 1}}
BAD_PARAMS = {"type": "object", "properties": {"person": {"type": "string", "not": {"const": "Bob"}}}}


def test_anthropic_tool_use_round_trip(tool_server):
    client = anthropic.Anthropic(base_url=tool_server.url, api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": QUESTION}]
    m = client.messages.create(model=TOOL_MODEL, max_tokens=60, messages=ask, tools=ANTHROPIC_TOOLS,
                               tool_choice={"type": "tool", "name": "get_secret_number"}, extra_body=GREEDY)
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_secret_number" and use.input == {"person": "Alice"} and use.id
    said = {"role": "assistant", "content": [b.model_dump() for b in m.content]}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": SECRET}]}
    answer = client.messages.create(model=TOOL_MODEL, max_tokens=40, tools=ANTHROPIC_TOOLS, extra_body=GREEDY,
                                    messages=[*ask, said, result])
    assert answer.stop_reason in ("end_turn", "max_tokens") and SECRET in answer.content[0].text


def test_anthropic_tool_use_stream(tool_server):
    client = anthropic.Anthropic(base_url=tool_server.url, api_key="unused", max_retries=0)
    with client.messages.stream(model=TOOL_MODEL, max_tokens=60, messages=[{"role": "user", "content": QUESTION}],
                                tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"}, extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    start = next(e for e in events if e.type == "content_block_start")
    assert start.content_block.type == "tool_use" and start.content_block.input == {}
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert [d.type for d in deltas] == ["input_json_delta"] and json.loads(deltas[0].partial_json) == {
        "person": "Alice"}
    assert final.stop_reason == "tool_use" and final.content[-1].input == {"person": "Alice"}
    assert [e.type for e in events][-2:] == ["message_delta", "message_stop"]


def test_responses_function_call_round_trip(tool_server):
    client = openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused", max_retries=0)
    r = client.responses.create(model=TOOL_MODEL, input=QUESTION, tools=RESPONSES_TOOLS, tool_choice="required",
                                temperature=0)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_secret_number" and call.status == "completed"
    assert json.loads(call.arguments) == {"person": "Alice"} and call.call_id
    output = {"type": "function_call_output", "call_id": call.call_id, "output": SECRET}
    answer = client.responses.create(model=TOOL_MODEL, previous_response_id=r.id, tools=RESPONSES_TOOLS,
                                     temperature=0, max_output_tokens=40, input=[output])
    assert SECRET in answer.output_text
    # the same turn, stateless: the call and its output sent as items
    again = client.responses.create(model=TOOL_MODEL, tools=RESPONSES_TOOLS, temperature=0, max_output_tokens=40,
                                    input=[{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True),
                                           output])
    assert again.output_text == answer.output_text
    with client.responses.stream(model=TOOL_MODEL, input=QUESTION, tools=RESPONSES_TOOLS, temperature=0,
                                 tool_choice={"type": "function", "name": "get_secret_number"}) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_response()
    assert ["response.output_item.added", "response.function_call_arguments.delta",
            "response.function_call_arguments.done", "response.output_item.done"] == types[2:6]
    assert final.output[0].type == "function_call" and json.loads(final.output[0].arguments) == {"person": "Alice"}


def test_chat_completions_tool_choice_required(tool_server):
    client = openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": QUESTION}]
    r = client.chat.completions.create(model=TOOL_MODEL, messages=ask, tools=CHAT_TOOLS, tool_choice="required",
                                       temperature=0)
    choice = r.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and json.loads(call.function.arguments) == {"person": "Alice"}
    answer = client.chat.completions.create(model=TOOL_MODEL, tools=CHAT_TOOLS, temperature=0, max_tokens=40,
                                            messages=[*ask, choice.message.model_dump(exclude_none=True),
                                                      {"role": "tool", "tool_call_id": call.id, "content": SECRET}])
    assert SECRET in answer.choices[0].message.content


@pytest.mark.parametrize("path, body, shape", [
    ("/v1/messages", {"max_tokens": 10, "messages": [{"role": "user", "content": QUESTION}],
                      "tools": [{"name": "get_secret_number", "input_schema": BAD_PARAMS}],
                      "tool_choice": {"type": "any"}}, "anthropic"),
    ("/v1/responses", {"input": QUESTION, "tool_choice": "required",
                       "tools": [{"type": "function", "name": "get_secret_number", "parameters": BAD_PARAMS}]},
     "openai"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": QUESTION}], "tool_choice": "required",
                              "tools": [{"type": "function", "function": {"name": "get_secret_number",
                                                                          "parameters": BAD_PARAMS}}]}, "openai"),
])
def test_a_schema_the_grammar_cannot_express_is_named(tool_server, path, body, shape):
    r = httpx.post(tool_server.url + path, json={"model": TOOL_MODEL, **body})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert message == ('tools: the parameters of "get_secret_number": the JSON schema keyword "not" (at '
                       'properties.person) cannot be expressed by the grammar that constrains the output')
    assert (r.json().get("type") == "error") == (shape == "anthropic")


def test_tool_choice_naming_another_tool_or_with_a_format(tool_server):
    r = httpx.post(tool_server.url + "/v1/chat/completions", json={
        "model": TOOL_MODEL, "messages": [{"role": "user", "content": QUESTION}], "tools": CHAT_TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "send_email"}}})
    assert r.status_code == 400 and '"send_email", which is not one of the tools' in r.json()["error"]["message"]
    r = httpx.post(tool_server.url + "/v1/chat/completions", json={
        "model": TOOL_MODEL, "messages": [{"role": "user", "content": QUESTION}], "tools": CHAT_TOOLS,
        "tool_choice": "required", "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and "cannot be combined" in r.json()["error"]["message"]
