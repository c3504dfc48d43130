"""What a request may name and constrain, checked before anything runs: a model name (never a path), a blob
digest, a ``format`` (``"json"`` or a JSON schema the grammar that constrains the output can follow), tools in
OpenAI's/Ollama's shape and a ``tool_choice`` that forces a call. Each is a 400 with one sentence."""

from __future__ import annotations

import re
from typing import Any

from localllm.errors import InvalidNameError
from localllm.names import _looks_like_path as looks_like_path
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


def check_digest(value: str, field: str | None = None) -> str:
    """``sha256:<64 hex>`` (or ``sha256-``); anything else is refused before it can reach a path (a file path with
    :data:`NOT_A_PATH`'s sentence, whether or not the file exists)."""
    if not isinstance(value, str) or not DIGEST_RE.match(value):
        if field is not None and isinstance(value, str) and looks_like_path(value.strip()):
            raise bad_request(NOT_A_PATH.format(field=field), param=field)
        raise bad_request(f"invalid digest format: expected sha256:<64 hex digits>, got {scrub(str(value))[:80]!r}")
    return "sha256:" + value[7:].lower()


# one sentence for any file path in a create request: the same whether the file exists, is a GGUF or is neither,
# so that a caller learns nothing about the server's files
NOT_A_PATH = ("{field} must name a model or an uploaded blob (sha256:<64 hex digits>), never a file path: a request "
              "cannot name a file on the server (upload it to /api/blobs first)")


def check_ref(value: Any, field: str, *, words: tuple[str, ...] = ()) -> str:
    """What ``/api/create`` builds on or drafts with (``from``, ``draft``): a model name, a blob digest (``from``
    only, with no ``words``) or one of ``words`` (``draft``: ``none``, ``ngram``, ...); never a file path, which is
    refused with :data:`NOT_A_PATH`, whatever the path.

    >>> check_ref("ngram", "draft", words=("ngram", "none"))
    'ngram'
    >>> check_ref("/etc/hostname", "draft") # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    localllm.server.errors.APIError: draft must name a model or an uploaded blob (sha256:<64 hex digits>), never ...
    """
    if isinstance(value, str) and value.strip() in words:
        return value.strip()
    if isinstance(value, str) and not words and DIGEST_RE.match(value.strip()):
        return check_digest(value.strip())
    if value is None or value == "":
        raise bad_request(f"{field} is required")
    try:
        return parse_name(value, allow_path=False).name  # never opens a file
    except InvalidNameError as e:
        if isinstance(value, str) and looks_like_path(value.strip()):
            raise bad_request(NOT_A_PATH.format(field=field), param=field) from None
        raise bad_request(str(e)) from None


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


def schema_problem(schema: Any) -> str | None:
    """The first thing in a JSON schema the backend that will follow it cannot express (one sentence), or None:
    the backends' own rules (:func:`localllm.hardware.schema_problem`: a schema is refused only when no backend
    that runs here can follow it).

    >>> schema_problem({"type": "object", "properties": {"a": {"not": {"type": "string"}}}})
    'the JSON schema keyword "not" (at properties.a) cannot be expressed by the grammar that constrains the output'
    >>> schema_problem({"type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z]+$"}}}) is None
    True
    """
    from localllm.hardware import schema_problem as backend_schema_problem

    return backend_schema_problem(schema)


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
            raise bad_request(f"{field}[{i}]: a function tool needs a name: "
                              f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", param=field)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"{field}[{i}] ({fn['name'][:60]}): the parameter schema must be a JSON schema object",
                              param=field)
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
