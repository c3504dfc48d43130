"""What coding agents send, accepted and answered: request bodies recorded from Codex CLI 0.171 (Responses API)
and Claude Code 2.1 (Messages API) against a recording server (``tests/data/agents/``, long texts shortened),
sent through the official ``openai`` and ``anthropic`` clients; namespace, custom and hosted tools; the
``encrypted_content`` round trip; system turns anywhere; Anthropic's versioned and server tools; malformed tools.

The server holds the default model with a tool-capable template; the token source is the fake one (it emits
the scripted calls and records what the chat template was given), so the translation is what is tested."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.server.derived import install_derived, serve, tool_model
from tests.server.test_tools import TOOL_MODEL

DATA = Path(__file__).parent.parent / "data" / "agents"
CODEX = json.loads((DATA / "codex-0.171-responses.json").read_text())
CLAUDE = json.loads((DATA / "claude-code-2.1-messages.json").read_text())
SEEN: list[dict[str, Any]] = []  # what each render got: {"messages", "tools"}


@pytest.fixture(scope="module")
def agent_server(default_model_path, tmp_path_factory):
    from tests.fakes import FakeSource

    class Scripted(FakeSource):
        """Calls the tools a request's last user turn names (``call:<function> <json arguments>``), answers a
        tool result with its text, and records each render."""

        def render(self, messages, *, tools=None, add_generation_prompt=True, template_kwargs=None):
            if add_generation_prompt:  # not the system prompt's own render (where a cached prefix ends)
                SEEN.append({"messages": copy.deepcopy(messages), "tools": copy.deepcopy(tools)})
            last = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "user"), "")
            if isinstance(last, str) and last.startswith("call:") and messages[-1].get("role") == "user":
                name, _, args = last[5:].partition(" ")
                self.knobs.tool_calls = [{"name": name, "arguments": json.loads(args or "{}")}]
            else:
                self.knobs.tool_calls = None
            return super().render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                  template_kwargs=template_kwargs)

        def __init__(self, spec):
            super().__init__(spec, answer_tool_results=True, reply="done")

    gguf, wheel = tool_model(default_model_path)
    store = install_derived(gguf, TOOL_MODEL, tmp_path_factory.mktemp("agents-home"), **wheel)
    srv = serve(store, backend_class=lambda name: Scripted)
    yield srv
    srv.stop()
    srv.engine.close()


@pytest.fixture(scope="module")
def oai(agent_server):
    return openai.OpenAI(base_url=agent_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(agent_server):
    return anthropic.Anthropic(base_url=agent_server.url, api_key="unused", max_retries=0)


def _last() -> dict[str, Any]:
    return SEEN[-1]


def _functions(seen: dict[str, Any]) -> list[str]:
    return [t["function"]["name"] for t in seen["tools"] or []]


KNOWN_RESPONSES = ("model", "input", "tools", "tool_choice", "parallel_tool_calls", "reasoning", "store", "include",
                   "prompt_cache_key", "stream", "instructions")


def _codex_body(**changes: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The recorded Codex body as (SDK arguments, extra_body) with ``changes`` applied."""
    body = {**copy.deepcopy(CODEX), "model": TOOL_MODEL, **changes}
    known = {k: v for k, v in body.items() if k in KNOWN_RESPONSES}
    return known, {k: v for k, v in body.items() if k not in KNOWN_RESPONSES}


# ------------------------------------------------------------------------------------------ Responses


def test_codex_request_streams_in_the_order_codex_reads(oai, caplog):
    caplog.set_level(logging.INFO, logger="localllm.server")
    args, extra = _codex_body()
    events = list(oai.responses.create(**args, extra_body=extra))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types[-2:] == ["response.output_item.done", "response.completed"]
    assert events[-1].response.output_text == "done"
    seen = _last()
    # developer turns are system turns; the namespace is flattened; web_search is left out, with a log line
    assert [m["role"] for m in seen["messages"]] == ["system", "system", "user", "user"]
    names = _functions(seen)
    assert "exec_command" in names and "multi_agent_v1__close_agent" in names and "web_search" not in names
    assert "tool web_search (web_search) runs on OpenAI's servers" in caplog.text


def test_namespace_call_comes_back_under_the_clients_name_and_round_trips(oai):
    call = {"target": "agent-1"}
    args, extra = _codex_body(stream=False, input=[
        {"role": "user", "content": f"call:multi_agent_v1__close_agent {json.dumps(call)}"}])
    r = oai.responses.create(**args, extra_body=extra)
    (item,) = [o for o in r.output if o.type == "function_call"]
    assert item.name == "close_agent" and item.namespace == "multi_agent_v1"
    assert json.loads(item.arguments) == call
    # Codex sends the call back (store: false) with its output: the model sees the flattened name again
    back = [*args["input"], item.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": item.call_id, "output": "closed"}]
    args, extra = _codex_body(stream=False, input=back)
    r = oai.responses.create(**args, extra_body=extra)
    assert r.output_text == "The tool said: closed"
    msgs = _last()["messages"]
    assert msgs[-2]["tool_calls"][0]["function"]["name"] == "multi_agent_v1__close_agent"
    assert msgs[-1]["role"] == "tool" and msgs[-1]["content"] == "closed"


CUSTOM = {"type": "custom", "name": "apply_patch", "description": "Apply a patch.",
          "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hi\n*** End Patch"


def test_custom_tool_call_carries_text_streamed_and_not(oai):
    ask = [{"role": "user", "content": f"call:apply_patch {json.dumps({'input': PATCH})}"}]
    r = oai.responses.create(model=TOOL_MODEL, input=ask, tools=[CUSTOM], store=False)
    (item,) = r.output
    assert item.type == "custom_tool_call" and item.name == "apply_patch" and item.input == PATCH
    fn = _last()["tools"][0]["function"]
    assert fn["name"] == "apply_patch" and "start: /.+/" in fn["parameters"]["properties"]["input"]["description"]
    events = list(oai.responses.create(model=TOOL_MODEL, input=ask, tools=[CUSTOM], store=False, stream=True))
    types = [e.type for e in events]
    assert types[-5:] == ["response.output_item.added", "response.custom_tool_call_input.delta",
                          "response.custom_tool_call_input.done", "response.output_item.done", "response.completed"]
    assert events[-2].item.input == PATCH
    back = [*ask, item.model_dump(exclude_none=True),
            {"type": "custom_tool_call_output", "call_id": item.call_id, "output": "Done!"}]
    r = oai.responses.create(model=TOOL_MODEL, input=back, tools=[CUSTOM], store=False)
    assert r.output_text == "The tool said: Done!"
    assert _last()["messages"][-2]["tool_calls"][0]["function"]["arguments"] == {"input": PATCH}


HOSTED = [{"type": "web_search"}, {"type": "web_search_preview"}, {"type": "file_search", "vector_store_ids": ["v"]},
          {"type": "computer_use_preview", "display_width": 1, "display_height": 1, "environment": "linux"},
          {"type": "code_interpreter", "container": {"type": "auto"}},
          {"type": "mcp", "server_label": "x", "server_url": "https://example.com"},
          {"type": "image_generation"}, {"type": "local_shell"}, {"type": "shell"}, {"type": "apply_patch"}]


@pytest.mark.parametrize("tool", HOSTED, ids=[t["type"] for t in HOSTED])
def test_every_hosted_tool_is_left_out_with_one_log_line(oai, tool, caplog):
    caplog.set_level(logging.INFO, logger="localllm.server")
    r = httpx.post(str(oai.base_url) + "responses", json={
        "model": TOOL_MODEL, "input": "hi", "tools": [tool, {"type": "function", "name": "f"}]})
    assert r.status_code == 200, r.text
    assert _functions(_last()) == ["f"]
    assert len([rec for rec in caplog.records if tool["type"] in rec.getMessage()]) == 1


def test_hosted_tools_items_in_the_input_are_left_out(oai):
    items = [{"role": "user", "content": "hi"},
             {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search"}},
             {"type": "local_shell_call", "id": "ls_1", "call_id": "c", "status": "completed",
              "action": {"type": "exec", "command": ["ls"], "env": {}}},
             {"type": "local_shell_call_output", "call_id": "c", "output": "x"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
             {"role": "user", "content": "again"}]
    r = httpx.post(str(oai.base_url) + "responses", json={"model": TOOL_MODEL, "input": items})
    assert r.status_code == 200, r.text
    assert [m["role"] for m in _last()["messages"]] == ["user", "assistant", "user"]


def test_encrypted_reasoning_from_the_client_goes_back_in(oai):
    from localllm.server.responses_routes import encrypt

    items = [{"role": "user", "content": "hi"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": encrypt("I should greet.")},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
             {"role": "user", "content": "again"}]
    r = oai.responses.create(model=TOOL_MODEL, input=items, store=False, include=["reasoning.encrypted_content"])
    assert r.status == "completed"
    assert _last()["messages"][1]["thinking"] == "I should greet."


@pytest.mark.parametrize(("tool", "says"), [
    ({"type": "function", "parameters": {"type": "object"}}, "tools[0]: a function tool needs a name"),
    ({"type": "function", "name": "f", "parameters": "x"}, "tools[0] (f): the parameter schema must be"),
    ({"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "g", "parameters": []}]},
     "tools[0].tools[0] (g): the parameter schema must be"),
    ({"type": "custom"}, "tools[0]: a custom tool needs a name"),
    ({"type": "bogus", "name": "b"}, "tools[0]: tool type 'bogus' is not a Responses API tool type"),
])
def test_a_malformed_responses_tool_is_a_400_naming_it(oai, tool, says):
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=TOOL_MODEL, input="hi", tools=[tool])
    assert says in e.value.body["message"] and e.value.body["param"] == "tools"


# ------------------------------------------------------------------------------------------ Messages

KNOWN_MESSAGES = ("model", "messages", "system", "tools", "metadata", "max_tokens", "thinking", "stream")


def _claude_body(**changes: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    body = {**copy.deepcopy(CLAUDE), "model": TOOL_MODEL, **changes}
    known = {k: v for k, v in body.items() if k in KNOWN_MESSAGES}
    return known, {k: v for k, v in body.items() if k not in KNOWN_MESSAGES}


def test_claude_code_request_streams_in_the_order_claude_code_reads(claude):
    args, extra = _claude_body()
    with claude.messages.stream(**{k: v for k, v in args.items() if k != "stream"}, extra_body=extra,
                                extra_query={"beta": "true"}) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop" and "message_delta" in events
    assert final.content[0].text == "done" and final.stop_reason == "end_turn"
    seen = _last()
    # the system turn Claude Code puts after the first user turn stays where it is
    assert [m["role"] for m in seen["messages"]] == ["system", "user", "system"]
    assert seen["messages"][2]["content"].startswith("# Environment")
    assert _functions(seen) == [t["name"] for t in CLAUDE["tools"]]


def test_claude_code_tool_use_round_trip(claude):
    ask = [{"role": "user", "content": 'call:Bash {"command": "ls"}'}]
    args, extra = _claude_body(stream=False, messages=ask, max_tokens=100)  # the SDK streams 32000
    r = claude.messages.create(**{k: v for k, v in args.items() if k != "stream"}, extra_body=extra)
    (use,) = r.content
    assert use.type == "tool_use" and use.name == "Bash" and use.input == {"command": "ls"}
    assert r.stop_reason == "tool_use"
    back = [*ask, {"role": "assistant", "content": [use.model_dump()]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "a.txt",
                                          "cache_control": {"type": "ephemeral"}}]}]
    args, extra = _claude_body(stream=False, messages=back, max_tokens=100)
    r = claude.messages.create(**{k: v for k, v in args.items() if k != "stream"}, extra_body=extra)
    assert r.content[0].text == "The tool said: a.txt"


def test_claude_code_count_tokens_takes_the_same_body(claude):
    r = claude.messages.count_tokens(model=TOOL_MODEL, messages=CLAUDE["messages"], system=CLAUDE["system"],
                                     tools=CLAUDE["tools"])
    assert r.input_tokens > 5000


ANTHROPIC_TOOLS = [
    {"type": "bash_20250124", "name": "bash"},
    {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
    {"type": "web_search_20250305", "name": "web_search", "max_uses": 2},
    {"type": "web_fetch_20250910", "name": "web_fetch"},
    {"type": "code_execution_20250825", "name": "code_execution"},
    {"name": "Later", "description": "deferred", "input_schema": {"type": "object"}, "defer_loading": True},
    {"name": "Read", "description": "read a file", "input_schema": {"type": "object"},
     "cache_control": {"type": "ephemeral"}},
]


def test_versioned_client_tools_are_served_and_server_tools_left_out(claude, caplog):
    caplog.set_level(logging.INFO, logger="localllm.server")
    r = claude.messages.create(model=TOOL_MODEL, max_tokens=20, tools=ANTHROPIC_TOOLS,  # type: ignore[arg-type]
                               messages=[{"role": "user", "content": "hi"}])
    assert r.content[0].text == "done"
    tools = {t["function"]["name"]: t["function"] for t in _last()["tools"]}
    assert list(tools) == ["bash", "str_replace_based_edit_tool", "Read"]
    assert "command" in tools["bash"]["parameters"]["properties"]
    assert tools["str_replace_based_edit_tool"]["parameters"]["required"] == ["command", "path"]
    for name in ("web_search", "web_fetch", "code_execution", "Later"):
        assert len([rec for rec in caplog.records if f"tool {name} " in rec.getMessage()]) == 1


@pytest.mark.parametrize("thinking", [{"type": "enabled", "budget_tokens": 2048}, {"type": "adaptive"},
                                      {"type": "adaptive", "display": "omitted"}, {"type": "disabled"}])
def test_thinking_forms_and_claude_codes_other_fields_are_accepted(claude, thinking):
    r = claude.messages.create(
        model=TOOL_MODEL, max_tokens=20, thinking=thinking,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
                  {"role": "system", "content": "Be brief."}],  # type: ignore[list-item]
        metadata={"user_id": "u"},
        extra_body={"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                    "output_config": {"effort": "high"}})
    assert r.content[0].text == "done"


def test_output_config_format_constrains_the_answer(claude):
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    r = claude.messages.create(model=TOOL_MODEL, max_tokens=20, messages=[{"role": "user", "content": "hi"}],
                               extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert r.stop_reason == "end_turn"
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=TOOL_MODEL, max_tokens=20, messages=[{"role": "user", "content": "hi"}],
                               extra_body={"output_config": {"format": {"type": "json_schema"}}})
    assert "output_config.format" in e.value.body["error"]["message"]


@pytest.mark.parametrize(("tool", "says"), [
    ({"description": "no name", "input_schema": {"type": "object"}}, "tools[0]: a function tool needs a name"),
    ({"name": "Bad", "input_schema": "x"}, "tools[0] (Bad): input_schema must be a JSON schema object"),
    ({"name": "NoSchema"}, "tools[0] (NoSchema): input_schema must be a JSON schema object"),
    ({"type": "bogus_2099", "name": "b"}, "tools[0] (b): tool type 'bogus_2099' is not supported"),
])
def test_a_malformed_anthropic_tool_is_a_400_naming_it(claude, tool, says):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=TOOL_MODEL, max_tokens=5, tools=[tool],  # type: ignore[list-item]
                               messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "invalid_request_error" and says in e.value.body["error"]["message"]


@pytest.mark.parametrize(("tool", "says"), [
    ({"type": "function", "function": {"parameters": {"type": "object"}}}, "tools[0]: a function tool needs a name"),
    ({"type": "function", "function": {"name": "write", "parameters": []}},
     "tools[0] (write): the parameter schema must be a JSON schema object"),
])
def test_a_malformed_chat_tool_is_a_400_naming_it(oai, tool, says):
    """OpenCode's API (chat completions): the same sentence."""
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=TOOL_MODEL, messages=[{"role": "user", "content": "hi"}], tools=[tool])
    assert says in e.value.body["message"] and e.value.body["param"] == "tools"


# ------------------------------------------------------------------------------------------ version


def test_api_version_passes_codexs_gate_with_ours_beside_it(agent_server):
    v = httpx.get(agent_server.url + "/api/version").json()
    assert tuple(int(p) for p in v["version"].split(".")) >= (0, 13, 4)  # Codex --oss: "requires Ollama 0.13.4"
    assert v["localllm"]
