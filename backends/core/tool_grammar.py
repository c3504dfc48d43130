"""A lazy grammar for tool calls (llama.cpp's "lazy grammar"): while tools are offered, nothing is constrained until
the text shows the start of a call; from there on a grammar built from the offered tools' names and parameter
schemas decides, so the call that follows is a valid call to an offered tool with schema-valid arguments.

Starts recognised, in the shapes small models actually write (a Hermes-style template's own tags, what
Qwen2.5-Coder and its siblings write instead):

* ``<tool_call>`` (the template's tag) and ``<tools>`` (the tag of the tools list, which a 1.5B copies);
* a JSON object at the very start of the answer (``{`` then ``"name"``/``"type"``, or anything: it is forced);
* a fenced block ```` ```json ```` opening an object;
* ``{"name"`` anywhere, and ``[{"name"`` (a list of calls);
* the OpenAI envelope ``{"type": "function", "function": {...}}``.

The grammar then takes one or more calls, each ``{"name": <an offered name>, "arguments": <its parameters>}`` or
the envelope around one, in the shape the trigger began (tags closed, a fence closed, a list closed); the
stream's parser (:func:`backends.core._stops.parse_tool_calls`) reads every one of them.

llama.cpp replays the text from a trigger's first capture group to the end of the text so far into the grammar,
and a replay the grammar refuses aborts the process; so each trigger pattern is anchored at the end of the text
and admits only the openings this grammar accepts (a call's head, up to a prefix of an offered name).

Only the standard library here; the schema-to-GBNF step is llama-cpp-python's (:func:`grammar_for`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# the JSON whitespace the grammar takes between tokens: none, one space, or a newline and an indent (pretty JSON)
_SPACE = 'space ::= | " " | "\\n" [ \\t]{0,20}'
_SPACE_RE = r"(?: |\n[ \t]{0,20})?"
_WS = "ws ::= [ \\t\\n]{0,8}"  # between tags, fences and calls


@dataclass(frozen=True)
class ToolGrammar:
    """The GBNF (its root the whole constrained part) and the trigger patterns (ECMAScript regexes, searched in
    the text generated so far; the first capture group starts the constrained part)."""

    gbnf: str
    triggers: tuple[str, ...]


_SAFE_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")  # names whose trigger patterns are built (others: no constraint)


def _esc(text: str) -> str:
    """``text`` as a literal of an ECMAScript regex (std::regex): only ``.`` needs a backslash in a safe name."""
    return text.replace(".", "\\.")


def _prefixes(word: str) -> str:
    """A regex taking any prefix of ``word`` (the empty one too), the longest first.

    >>> bool(re.fullmatch(_prefixes("name"), "na")), bool(re.fullmatch(_prefixes("name"), "nx"))
    (True, False)
    """
    return "(?:" + "|".join(_esc(word[:k]) for k in range(len(word), 0, -1)) + ")?"


def _names_prefix(names: list[str]) -> str:
    """A regex for what may follow ``"name":`` in a replay: an opening quote and a prefix of an offered name, or a
    whole name and its closing quote."""
    alts = sorted({_esc(n[:k]) for n in names for k in range(len(n), 0, -1)}, key=len, reverse=True)
    whole = "|".join(_esc(n) + '"' for n in sorted(names, key=len, reverse=True))
    return f'(?:"(?:{whole}|{"|".join(alts)})?)?'


def tool_names(tools: list[dict[str, Any]] | None) -> list[str]:
    out = []
    for t in tools or []:
        fn = t.get("function", t) if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]:
            out.append(fn["name"])
    return out


def call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON schema of one call to any of ``tools``: ``{"name": <const>, "arguments": <its parameters>}``, or
    the OpenAI envelope ``{"type": "function", "function": <that>}``; ``$defs`` hoisted to the root.

    >>> s = call_schema([{"type": "function", "function": {"name": "f"}}])
    >>> s["anyOf"][0]["properties"]["name"], s["anyOf"][1]["properties"]["type"]
    ({'const': 'f'}, {'const': 'function'})
    """
    calls: list[dict[str, Any]] = []
    defs: dict[str, Any] = {}
    for tool in tools:
        fn = tool.get("function", tool)
        params = dict(fn.get("parameters") or {"type": "object"})
        for key in ("$defs", "definitions"):
            if isinstance(params.get(key), dict):
                defs.setdefault(key, {}).update(params.pop(key))
        params.pop("$schema", None)
        calls.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                      "required": ["name", "arguments"], "additionalProperties": False})
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    envelope = {"type": "object", "properties": {"type": {"const": "function"}, "function": one},
                "required": ["type", "function"], "additionalProperties": False}
    return {"anyOf": [*calls, envelope], **defs}


def build(tools: list[dict[str, Any]] | None, to_gbnf: Any, json_tags: bool = True) -> ToolGrammar | None:
    """The lazy tool-call grammar for ``tools``; ``to_gbnf(schema) -> str`` turns a JSON schema into GBNF whose
    start rule is ``root`` (:func:`backends.llamacpp.sampling.grammar_for`). None when no tool has a name or the
    schemas cannot be turned into a grammar (generation is then left unconstrained, as before). ``json_tags``
    False: the template's ``<tool_call>`` holds XML (Qwen3.5's ``<function=NAME>``), so that tag triggers nothing."""
    names = tool_names(tools)
    if not names or not all(_SAFE_NAME.fullmatch(n) for n in names):
        return None
    try:
        body = to_gbnf(call_schema([t for t in tools or [] if tool_names([t])]))
    except Exception:  # noqa: BLE001 - a schema the converter cannot take: no constraint
        return None
    body = re.sub(r"(?m)^space ::= .*$", lambda _m: _SPACE, body)
    body = re.sub(r"(?m)^root ::= ", "tool-call ::= ", body)
    if re.search(r"(?<![\w-])root(?![\w-])", body):  # a schema that refers to its own root: leave it alone
        return None
    gbnf = "\n".join([
        "root ::= tagged | tools-tag | listed | plain",
        'tagged ::= "<tool_call>" ws tool-call ws "</tool_call>" (ws "<tool_call>" ws tool-call ws "</tool_call>")*',
        'tools-tag ::= "<tools>" ws tool-call (ws ","? ws tool-call)* ws "</tools>"',
        'listed ::= "[" ws tool-call (ws "," ws tool-call)* ws "]"',
        # calls one after another, each in its own fence where the model fences them
        'plain ::= tool-call (ws ("```" ws "```json" ws)? tool-call)* (ws "```")?',
        _WS,
        body,
    ])
    head = r'\{' + _SPACE_RE + '(?:"' + _prefixes("name") + '|"' + _prefixes("type") + ")?"
    name_head = r'\{' + _SPACE_RE + r'"name"' + _SPACE_RE + "(?::" + _SPACE_RE + _names_prefix(names) + ")?"
    type_head = (r'\{' + _SPACE_RE + r'"type"' + _SPACE_RE + ":" + _SPACE_RE + r'"function"'
                 + "(?:," + _SPACE_RE + '(?:"' + _prefixes("function") + ")?)?")
    triggers = (
        *([r"(<tool_call>[ \t\n]{0,8}(?:" + head + ")?)$"] if json_tags else []),
        r"(<tools>[ \t\n]{0,8}(?:" + head + ")?)$",
        r"^[ \t\n]*(" + head + ")$",
        r"```json[ \t\n]{0,8}(" + head + ")$",
        r"(\[[ \t\n]{0,8}" + name_head + ")$",
        "(" + name_head + ")$",
        "(" + type_head + ")$",
    )
    return ToolGrammar(gbnf, triggers)


def describe(g: ToolGrammar) -> str:
    """One line for logs: the size of the grammar and the number of triggers."""
    return json.dumps({"gbnf_chars": len(g.gbnf), "triggers": len(g.triggers)})
