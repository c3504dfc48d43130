"""What a request may name and constrain, checked before anything runs: a model name (never a path), a blob
digest, a ``format`` (``"json"`` or a JSON schema the grammar that constrains the output can follow), tools in
OpenAI's/Ollama's shape and a ``tool_choice`` that forces a call. Each is a 400 with one sentence."""

from __future__ import annotations

import re
from typing import Any

from localllm.errors import InvalidNameError
from localllm.names import parse_name
from localllm.server.errors import bad_request, scrub

DIGEST_RE = re.compile(r"^sha256[:-][0-9a-fA-F]{64}$")


def check_name(value: Any, field: str = "model") -> str:
    """A model name from a request: a name, never a path. Raises a 400 with one sentence."""
    if value is None or value == "":
        raise bad_request(f"{field} is required")
    try:
        return parse_name(value, allow_path=False).name
    except InvalidNameError as e:
        raise bad_request(str(e)) from None


def check_digest(value: str) -> str:
    """``sha256:<64 hex>`` (or ``sha256-``); anything else is refused before it can reach a path."""
    if not isinstance(value, str) or not DIGEST_RE.match(value):
        raise bad_request(f"invalid digest format: expected sha256:<64 hex digits>, got {scrub(str(value))[:80]!r}")
    return "sha256:" + value[7:].lower()


def check_format(value: Any, field: str = "format") -> str | dict[str, Any] | None:
    """Ollama's ``format``: ``"json"``, a JSON Schema object the grammar can follow, or nothing."""
    if value is None or value == "":
        return None
    if value == "json":
        return "json"
    if isinstance(value, dict):
        problem = schema_problem(value)
        if problem:
            raise bad_request(f"{field}: {problem}", param=field)
        return value
    raise bad_request(f'invalid format: expected "json" or a JSON schema object, got {scrub(str(value))[:60]!r}')


SCHEMA_TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")
_NO_GRAMMAR = ("not", "if", "then", "else")  # keywords the JSON-schema-to-grammar converter cannot express
_SUB_SCHEMA = ("additionalProperties", "items", "contains", "propertyNames", "unevaluatedItems")
_SUB_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUB_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def schema_problem(schema: Any, path: str = "") -> str | None:
    """The first thing in a JSON schema that the grammar constraining the output cannot express, as one
    sentence naming the keyword; None when the whole schema can be followed.

    >>> schema_problem({"type": "object", "properties": {"a": {"not": {"type": "string"}}}})
    'the JSON schema keyword "not" (at properties.a) cannot be expressed by the grammar that constrains the output'
    >>> schema_problem({"type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z]+$"}}}) is None
    True
    """
    where = f" (at {path})" if path else ""
    cannot = "cannot be expressed by the grammar that constrains the output"
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"a JSON schema{where} must be an object, not {type(schema).__name__}"
    for key in _NO_GRAMMAR:
        if key in schema:
            return f'the JSON schema keyword "{key}"{where} {cannot}'
    ref = schema.get("$ref")
    if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
        return (f'the JSON schema keyword "$ref"{where} may only point inside the schema (#/...), '
                f"not to {str(ref)[:60]!r}")
    kind = schema.get("type")
    for t in kind if isinstance(kind, list) else [kind] if kind is not None else []:
        if t not in SCHEMA_TYPES:
            return (f'the JSON schema keyword "type"{where} has {str(t)[:40]!r}, which is not one of '
                    f'{", ".join(SCHEMA_TYPES)}')
    pattern = schema.get("pattern")
    if pattern is not None and not (isinstance(pattern, str) and pattern.startswith("^") and pattern.endswith("$")):
        return (f'the JSON schema keyword "pattern"{where} must start with ^ and end with $ for the grammar to follow '
                f"it (got {str(pattern)[:60]!r})")
    dot = path + "." if path else ""
    for key in _SUB_SCHEMA:
        sub = schema.get(key)
        if isinstance(sub, dict) and (p := schema_problem(sub, dot + key)):
            return p
        if isinstance(sub, list) and key == "items":
            for i, x in enumerate(sub):
                if p := schema_problem(x, f"{dot}{key}[{i}]"):
                    return p
    for key in _SUB_LISTS:
        sub = schema.get(key)
        if isinstance(sub, list):
            for i, x in enumerate(sub):
                if p := schema_problem(x, f"{dot}{key}[{i}]"):
                    return p
    for key in _SUB_MAPS:
        sub = schema.get(key)
        if isinstance(sub, dict):
            for name, x in sub.items():
                if p := schema_problem(x, f"{dot}{key}.{name}"):
                    return p
    return None


def check_tools(tools: Any, field: str = "tools") -> list[dict[str, Any]] | None:
    """Tools in OpenAI's/Ollama's shape (``{"type": "function", "function": {name, description, parameters}}``);
    a malformed one is a 400 naming it."""
    if not tools:
        return None
    if not isinstance(tools, list):
        raise bad_request(f"{field} must be a list", param=field)
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"{field}[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                              param=field)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"{field}[{i}].function.parameters must be a JSON schema object", param=field)
    return tools


def forced_tools(choice: Any) -> list[str] | None:
    """A ``tool_choice`` that forces a call → the tools it allows ([] = any); None when the model decides.
    Reads OpenAI's (``"required"``, ``{"type": "function", "function": {"name"}}``), the Responses API's
    (``{"type": "function", "name"}``) and Anthropic's (``{"type": "any"}``, ``{"type": "tool", "name"}``).

    >>> forced_tools("required"), forced_tools({"type": "tool", "name": "f"}), forced_tools("auto")
    ([], ['f'], None)
    """
    if choice in ("required", "any"):
        return []
    if not isinstance(choice, dict):
        return None
    kind = choice.get("type")
    if kind in ("any", "required"):
        return []
    if kind in ("function", "tool"):
        fn = choice.get("function")
        name = choice.get("name") or (fn.get("name") if isinstance(fn, dict) else None)
        if not isinstance(name, str) or not name:
            raise bad_request("tool_choice must name the tool it forces", param="tool_choice")
        return [name]
    return None
