"""Messages reshaped for a chat template that expects another shape than OpenAI's (what llama.cpp's server does
in ``common/parsers/gemma4.cpp``).

Gemma 4's template takes tool results in the assistant message that made the calls (``tool_responses``: name and
response), not as ``role: "tool"`` messages; the answer after them belongs to the same model turn:

>>> msgs = [{"role": "user", "content": "Weather?"},
...         {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "w", "arguments": {}}}]},
...         {"role": "tool", "content": '{"c": 18}'}, {"role": "assistant", "content": "18 C."}]
>>> for_template("… message['tool_responses'] …", msgs)[1:]
[{'role': 'assistant', 'tool_calls': [{'function': {'name': 'w', 'arguments': {}}}], \
'tool_responses': [{'name': 'w', 'response': {'c': 18}}], 'content': '18 C.'}]

Only the standard library is used (``backends`` imports nothing from ``localllm``).
"""

from __future__ import annotations

import json
from typing import Any


def for_template(template: str | None, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` in the shape ``template`` expects (unchanged for templates that take OpenAI's)."""
    if template and "tool_responses" in template:
        return gemma4_tool_responses(messages)
    return messages


def _name_of(call: Any) -> str:
    fn = call.get("function", call) if isinstance(call, dict) else {}
    return str(fn.get("name") or "") if isinstance(fn, dict) else ""


def _response(content: Any) -> Any:
    if isinstance(content, str):
        try:
            return json.loads(content)
        except ValueError:
            return content
    return content


def gemma4_tool_responses(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """assistant(tool_calls) → tool... → [assistant(content)] become one assistant message with ``tool_calls``,
    ``tool_responses`` (each named after the call in the same position, else its ``tool_call_id``) and the
    answer as ``content``; any thinking of the first message is kept."""
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(messages):
        m = messages[i]
        if m.get("role") != "assistant" or not m.get("tool_calls"):
            out.append(m)
            i += 1
            continue
        calls = list(m["tool_calls"])
        merged: dict[str, Any] = {"role": "assistant", "tool_calls": calls}
        for key in ("thinking", "reasoning_content"):
            if isinstance(m.get(key), str) and m[key]:
                merged[key] = m[key]
        i += 1
        responses: list[dict[str, Any]] = []
        while i < len(messages) and messages[i].get("role") == "tool":
            t = messages[i]
            name = _name_of(calls[len(responses)]) if len(responses) < len(calls) else ""
            responses.append({"name": name or str(t.get("tool_call_id") or t.get("tool_name") or ""),
                              "response": _response(t.get("content"))})
            i += 1
        if responses:
            merged["tool_responses"] = responses
        nxt = messages[i] if i < len(messages) else None
        if nxt is not None and nxt.get("role") == "assistant" and not nxt.get("tool_calls") and nxt.get("content"):
            merged["content"] = nxt["content"]
            i += 1
        elif m.get("content"):
            merged["content"] = m["content"]
        out.append(merged)
    return out
