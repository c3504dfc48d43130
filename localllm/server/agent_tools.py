"""Tools as coding agents send them, reduced to the function tools a chat template renders, and the model's calls
mapped back to what the client declared (pure functions; the Responses and Messages translators use them).

Responses API (Codex CLI):

* ``function`` tools are served as they are;
* ``namespace`` tools (a named group of function tools) are flattened: each member becomes a function named
  ``<namespace>__<name>``, and a call to it comes back as ``{"name": <name>, "namespace": <namespace>}``;
* ``custom`` (free-form) tools become a function with one string argument, ``input``; a call comes back as a
  ``custom_tool_call`` item carrying that text;
* hosted tools (``web_search``, ``file_search``, ``computer``, ``code_interpreter``, remote ``mcp``,
  ``image_generation``, ``local_shell``, ``shell``, ``apply_patch``, ``tool_search``) run on OpenAI's side or need
  an item type of their own: they are left out of the prompt, with one log line each.

Messages API (Claude Code): client tools (an ``input_schema``) are served; Anthropic's versioned client tools
(``bash_…``, ``text_editor_…``, ``computer_…``, ``memory_…``) get the schema Anthropic's models are trained on;
server tools (``web_search_…``, ``web_fetch_…``, ``code_execution_…``, ``tool_search_…``, ``mcp_toolset``) and
tools with ``defer_loading`` are left out, with one log line each.

A malformed tool (no name, a schema that is not an object) is a 400 naming it.

>>> tools, names = responses_tools([{"type": "function", "name": "f", "parameters": {"type": "object"}},
...     {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "g"}]},
...     {"type": "custom", "name": "patch"}, {"type": "web_search"}])
>>> [t["function"]["name"] for t in tools]
['f', 'ns__g', 'patch']
>>> names.resolve("ns__g"), names.resolve("patch"), names.resolve("other")
(ToolName(name='g', namespace='ns', custom=False), ToolName(name='patch', namespace=None, custom=True), None)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from localllm.server.errors import bad_request

log = logging.getLogger("localllm.server")
SEP = "__"  # between a namespace and a member's name in the flattened function name
CUSTOM_ARG = "input"  # the one argument of a custom tool's function
HOSTED_RESPONSES_TOOLS = ("web_search", "web_search_preview", "file_search", "computer", "computer_use",
                          "computer_use_preview", "code_interpreter", "mcp", "image_generation", "local_shell",
                          "shell", "apply_patch", "tool_search")
ANTHROPIC_SERVER_TOOLS = ("web_search_", "web_fetch_", "code_execution_", "tool_search_tool_", "mcp_toolset")


@dataclass(frozen=True)
class ToolName:
    """What the client declared for a function the model may call."""

    name: str
    namespace: str | None = None
    custom: bool = False  # a custom (free-form) tool: its call carries text, not JSON arguments


@dataclass
class ToolNames:
    """Flattened function name → the client's tool, both ways."""

    by_function: dict[str, ToolName] = field(default_factory=dict)

    def add(self, function: str, tool: ToolName) -> None:
        self.by_function[function] = tool

    def resolve(self, function: str) -> ToolName | None:
        """The client's tool for a function name the model called (a namespace member's bare name too, when only
        one namespace has it)."""
        if function in self.by_function:
            return self.by_function[function]
        bare = [t for t in self.by_function.values() if t.namespace and t.name == function]
        return bare[0] if len(bare) == 1 else None

    def function_of(self, name: str, namespace: str | None = None) -> str:
        """The flattened function name of a client's tool (for calls the client sends back)."""
        return f"{namespace}{SEP}{name}" if namespace else name


def _schema(value: Any, where: str, label: str) -> dict[str, Any]:
    if value is None:
        return {"type": "object", "properties": {}}
    if not isinstance(value, dict):
        raise bad_request(f"{where} ({label}): the parameter schema must be a JSON schema object", param="tools")
    return value


def _name(tool: dict[str, Any], where: str) -> str:
    name = tool.get("name")
    if not isinstance(name, str) or not name.strip():
        raise bad_request(f"{where}: a {tool.get('type') or 'function'} tool needs a name", param="tools")
    return name


def _function(name: str, description: Any, parameters: dict[str, Any]) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name, "parameters": parameters}
    if isinstance(description, str) and description:
        fn["description"] = description
    return {"type": "function", "function": fn}


def custom_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A custom tool's one string argument; its grammar (when it has one) goes in the description."""
    fmt: dict[str, Any] = tool["format"] if isinstance(tool.get("format"), dict) else {}
    about = "The tool's input, as free-form text."
    if fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        about += f" It follows this {fmt.get('syntax') or ''} grammar:\n{fmt['definition']}"
    return {"type": "object", "properties": {CUSTOM_ARG: {"type": "string", "description": about}},
            "required": [CUSTOM_ARG]}


def responses_tools(tools: list[Any] | None) -> tuple[list[dict[str, Any]], ToolNames]:
    """The Responses API's tools → the backend's function tools, and the map back."""
    out: list[dict[str, Any]] = []
    names = ToolNames()
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{where} must be an object", param="tools")
        kind = tool.get("type")
        if kind == "function":
            name = _name(tool, where)
            out.append(_function(name, tool.get("description"), _schema(tool.get("parameters"), where, name)))
            names.add(name, ToolName(name))
        elif kind == "custom":
            name = _name(tool, where)
            out.append(_function(name, tool.get("description"), custom_parameters(tool)))
            names.add(name, ToolName(name, custom=True))
        elif kind == "namespace":
            ns = _name(tool, where)
            members = tool.get("tools")
            if not isinstance(members, list):
                raise bad_request(f"{where} ({ns}): a namespace tool needs a list of tools", param="tools")
            for j, member in enumerate(members):
                at = f"{where}.tools[{j}]"
                if not isinstance(member, dict) or member.get("type", "function") not in ("function", "custom"):
                    raise bad_request(f"{at}: a namespace holds function or custom tools", param="tools")
                name = _name(member, at)
                custom = member.get("type") == "custom"
                params = custom_parameters(member) if custom else _schema(member.get("parameters"), at, name)
                function = names.function_of(name, ns)
                out.append(_function(function, member.get("description"), params))
                names.add(function, ToolName(name, ns, custom))
        elif isinstance(kind, str) and kind.startswith(HOSTED_RESPONSES_TOOLS):
            log.info("tool %s (%s) runs on OpenAI's servers or needs its own item type; left out of the prompt",
                     tool.get("name") or kind, kind)
        else:
            raise bad_request(f"{where}: tool type {str(kind)[:40]!r} is not a Responses API tool type",
                              param="tools")
    return out, names


# ------------------------------------------------------------------------------------------ Anthropic

_BASH = {"type": "object", "properties": {
    "command": {"type": "string", "description": "The bash command to run."},
    "restart": {"type": "boolean", "description": "Restart the shell instead of running a command."}}}
_EDITOR = {"type": "object", "properties": {
    "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert", "undo_edit"]},
    "path": {"type": "string"}, "file_text": {"type": "string"}, "old_str": {"type": "string"},
    "new_str": {"type": "string"}, "insert_line": {"type": "integer"}, "insert_text": {"type": "string"},
    "view_range": {"type": "array", "items": {"type": "integer"}}}, "required": ["command", "path"]}
_COMPUTER = {"type": "object", "properties": {
    "action": {"type": "string"}, "coordinate": {"type": "array", "items": {"type": "integer"}},
    "text": {"type": "string"}}, "required": ["action"]}
_MEMORY = {"type": "object", "properties": {
    "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert", "delete", "rename"]},
    "path": {"type": "string"}, "file_text": {"type": "string"}, "old_str": {"type": "string"},
    "new_str": {"type": "string"}}, "required": ["command"]}
ANTHROPIC_CLIENT_TOOLS = {"bash_": _BASH, "text_editor_": _EDITOR, "computer_": _COMPUTER, "memory_": _MEMORY}


def anthropic_tools(tools: list[Any] | None) -> list[dict[str, Any]]:
    """Anthropic's tools → the backend's function tools (see the module's docstring for what is left out)."""
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{where} must be an object")
        kind = tool.get("type")
        if isinstance(kind, str) and kind.startswith(ANTHROPIC_SERVER_TOOLS):
            log.info("tool %s (%s) runs on Anthropic's servers; left out of the prompt", tool.get("name"), kind)
            continue
        name = _name(tool, where)
        if tool.get("defer_loading"):
            log.info("tool %s is deferred (defer_loading); left out of the prompt", name)
            continue
        versioned = next((s for p, s in ANTHROPIC_CLIENT_TOOLS.items() if isinstance(kind, str)
                          and kind.startswith(p)), None)
        if versioned is not None:
            out.append(_function(name, tool.get("description") or f"Anthropic's {kind} tool.", versioned))
            continue
        if kind not in (None, "custom"):
            raise bad_request(f"{where} ({name}): tool type {str(kind)[:40]!r} is not supported")
        if not isinstance(tool.get("input_schema"), dict):
            raise bad_request(f"{where} ({name}): input_schema must be a JSON schema object")
        out.append(_function(name, tool.get("description"), tool["input_schema"]))
    return out
