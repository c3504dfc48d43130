"""The JSON schema of one forced tool call, shared by the server's ``tool_choice`` (every API) and the chat
faces' forced call (``localllm run --tool-choice required``): the output is constrained by a grammar to the
bare-JSON call form ``{"name": ..., "arguments": {...}}`` that the stream already parses as a tool call, so a
forced call goes through the same parsing as one the model chose to make."""

from __future__ import annotations

from typing import Any

from localllm.errors import LocalLLMError


class ToolSchemaError(LocalLLMError):
    """A tool list that cannot be turned into a forced call; ``param`` names the request field at fault."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def forced_call_schema(tools: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """The JSON schema of one call to any of ``tools`` (or to those named): ``{"name": <const>, "arguments":
    <its parameters>}``, the bare-JSON call form the stream parses. Definitions are hoisted to the root so
    that ``#/$defs/...`` references still resolve.

    >>> forced_call_schema([{"type": "function", "function": {"name": "f"}}], [])["properties"]["name"]
    {'const': 'f'}
    """
    from localllm.hardware import schema_problem

    chosen = [t for t in tools if not names or t["function"]["name"] in names]
    if not chosen:
        raise ToolSchemaError(f'tool_choice names "{names[0][:60]}", which is not one of the tools', "tool_choice")
    alternatives: list[dict[str, Any]] = []
    defs: dict[str, Any] = {}
    for tool in chosen:
        fn = tool["function"]
        params = dict(fn.get("parameters") or {"type": "object"})
        if problem := schema_problem(params):
            raise ToolSchemaError(f'tools: the parameters of "{fn["name"]}": {problem}', "tools")
        for key in ("$defs", "definitions"):
            if isinstance(params.get(key), dict):
                defs.setdefault(key, {}).update(params.pop(key))
        params.pop("$schema", None)
        alternatives.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                             "required": ["name", "arguments"], "additionalProperties": False})
    schema = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    return {**schema, **defs}
