"""Streaming text helpers shared by backends: stop strings held back, UTF-8 held until complete, tool calls.

>>> m = StopMatcher(["</s>"])
>>> m.push("Hello </")
('Hello ', False)
>>> m.push("s> more")
('', True)
"""

from __future__ import annotations

import ast
import codecs
import json
import re
from typing import Any


class StopMatcher:
    """Feed text pieces; get back the part that is safe to emit and whether a stop string was hit.

    Text that could be the start of a stop string is held back until it is clear either way, so a
    partial stop string never reaches the caller. The stop string itself is never emitted.
    """

    def __init__(self, stops: list[str] | None):
        self.stops = [s for s in (stops or []) if s]
        self._buf = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Add ``text``; return (text safe to emit now, stopped)."""
        if not self.stops:
            return text, False
        buf = self._buf + text
        first = -1
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (first < 0 or i < first):
                first = i
        if first >= 0:
            self._buf = ""
            return buf[:first], True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self._buf = buf[len(buf) - hold:] if hold else ""
        return (buf[: len(buf) - hold] if hold else buf), False

    def flush(self) -> str:
        """The held-back text, at the end of a stream that did not stop on a stop string."""
        out, self._buf = self._buf, ""
        return out


class Utf8Stream:
    """Bytes of token pieces in, complete characters out (a multibyte character split over tokens is held).

    >>> u = Utf8Stream()
    >>> u.push("é".encode()[:1]), u.push("é".encode()[1:])
    ('', 'é')
    """

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, data: bytes) -> str:
        return self._dec.decode(data)

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


# ------------------------------------------------------------------------------------------ tool calls

_TOOL_TAG = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
# Qwen3.5 / Qwen3-Coder: <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>
_XML_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|$)", re.S)
# Gemma 4: <|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>
_GEMMA_CALL = re.compile(r"<\|tool_call>\s*call:([^{\s]+)\s*(\{.*?\})\s*(?:<tool_call\|>|$)", re.S)
_GEMMA_QUOTE = '<|"|>'
# LFM2: <|tool_call_start|>[get_weather(city="Paris", days=3)]<|tool_call_end|> (Python-style; JSON in histories)
_LFM2_CALL = re.compile(r"<\|tool_call_start\|>\s*(.*?)\s*(?:<\|tool_call_end\|>|$)", re.S)
# Ministral 3 / Mistral: [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"} (repeated for parallel calls)
_MISTRAL_CALL = re.compile(r"\[TOOL_CALLS\]\s*([^\[\s{]+)\s*\[ARGS\]")
_TOOL_PREFIXES = ("<tool_call>", "<|tool_call>", "<|tool_call_start|>", "[TOOL_CALLS]", "<tools>", "{", "[", "```")


_TOOL_MARKERS = ("<tool_call>", "<|tool_call>", "<|tool_call_start|>", "[TOOL_CALLS]")  # tagged forms only


# where a call may begin after words (in tool mode): the tagged forms, a ```json fence, the <tools> tag a Qwen2.5
# sibling copies from its template, and a JSON call object ({"name", a list of them, the OpenAI envelope)
_MID_CALL = re.compile(r'<tool_call>|<\|tool_call>|<\|tool_call_start\|>|\[TOOL_CALLS\]|<tools>|```json'
                       r'|\[?\{\s*"name"|\{\s*"type"\s*:\s*"function"')
_MID_MARKERS = (*_TOOL_MARKERS, "<tools>", "```json", '{"name"', '[{"name"', '{"type":"function"')


def _squeeze(text: str) -> str:
    return re.sub(r"\s+", "", text)


def tool_marker_at(text: str) -> int:
    """Where in ``text`` a tool call begins after words (a whole marker, or the start of one at the very end), or
    -1: the words a model writes before its call are content, the call from there on is held.

    >>> tool_marker_at("I will check.<tool_call>"), tool_marker_at("ok.<|tool"), tool_marker_at("a < b")
    (13, 3, -1)
    >>> tool_marker_at('Sure: ```json {"name": "f"'), tool_marker_at('Sure: { "na'), tool_marker_at("x = {a}")
    (6, 6, -1)
    """
    m = _MID_CALL.search(text)
    best = m.start() if m else -1
    for i in range(max(0, len(text) - 24), len(text)):  # a tail that may still grow into a marker
        if best >= 0 and i >= best:
            break
        if text[i] in "<[{`" and (tail := _squeeze(text[i:])) and any(
                mk.startswith(tail) and mk != tail for mk in _MID_MARKERS):
            best = i
            break
    return best


def _partial_tail(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``tags``."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


def could_be_tool_call(text: str, after_words: bool = False) -> bool:
    """True while ``text`` (stripped) is, or could grow into, a tool call in a form we parse. ``after_words``: the
    text began after words (:func:`tool_marker_at`), where only a marker counts, not any ``{`` or fence.

    >>> could_be_tool_call("{ return 1; }"), could_be_tool_call("{ return 1; }", after_words=True)
    (True, False)
    """
    t = text.lstrip()
    if not t:
        return True
    if after_words:
        sq = _squeeze(t[:40])
        return any(sq.startswith(mk) or mk.startswith(sq) for mk in _MID_MARKERS)
    return any(t.startswith(p) or p.startswith(t) for p in _TOOL_PREFIXES)


def _one_call(obj: Any) -> dict[str, Any] | None:
    if not isinstance(obj, dict):
        return None
    if "function" in obj and isinstance(obj["function"], dict):  # OpenAI shape
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": name, "arguments": args}


def _param_types(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, str]]:
    """{tool name: {parameter: JSON schema type}} from an OpenAI-style tools list."""
    out: dict[str, dict[str, str]] = {}
    for t in tools or []:
        fn = t.get("function", t) if isinstance(t, dict) else {}
        props = ((fn.get("parameters") or {}).get("properties") or {}) if isinstance(fn, dict) else {}
        if isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(props, dict):
            out[fn["name"]] = {k: str(v.get("type") or "") if isinstance(v, dict) else "" for k, v in props.items()}
    return out


def _xml_value(raw: str, kind: str) -> Any:
    """A ``<parameter>`` value: text as it is for a string parameter, else JSON where it parses (numbers,
    booleans, objects, arrays), else the text."""
    if kind == "string":
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _xml_calls(text: str, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    types = _param_types(tools)
    calls = []
    for name, body in _XML_FUNCTION.findall(text):
        kinds = types.get(name, {})
        args = {k: _xml_value(v, kinds.get(k, "")) for k, v in _XML_PARAMETER.findall(body)}
        calls.append({"name": name, "arguments": args})
    return calls or None


def _gemma_args(body: str) -> Any:
    """Gemma 4's argument object (bare keys, strings between ``<|"|>``, JSON numbers/booleans/null, nested
    objects and lists) as Python data; ValueError when it is not one."""
    out: list[str] = []
    i, n = 0, len(body)
    while i < n:
        if body.startswith(_GEMMA_QUOTE, i):
            j = body.find(_GEMMA_QUOTE, i + len(_GEMMA_QUOTE))
            if j < 0:
                raise ValueError("an unterminated string")
            out.append(json.dumps(body[i + len(_GEMMA_QUOTE):j], ensure_ascii=False))
            i = j + len(_GEMMA_QUOTE)
            continue
        c = body[i]
        if c.isalpha() or c == "_":  # a bare key, or true/false/null
            j = i
            while j < n and (body[j].isalnum() or body[j] in "_-."):
                j += 1
            word = body[i:j]
            rest = body[j:].lstrip()
            out.append(json.dumps(word) if rest.startswith(":") else word)
            i = j
            continue
        out.append(c)
        i += 1
    return json.loads("".join(out))


def _gemma_calls(text: str) -> list[dict[str, Any]] | None:
    calls = []
    for name, body in _GEMMA_CALL.findall(text):
        try:
            args = _gemma_args(body)
        except ValueError:
            return None
        if not isinstance(args, dict):
            return None
        calls.append({"name": name, "arguments": args})
    return calls or None


_PY_LITERALS = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _py_value(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _PY_LITERALS:  # JSON literals are allowed too
        return _PY_LITERALS[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_py_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_py_value(k): _py_value(v) for k, v in zip(node.keys, node.values, strict=True) if k is not None}
    return ast.literal_eval(node)  # strings, numbers, negative numbers; anything else raises ValueError


def _python_calls(body: str) -> list[dict[str, Any]] | None:
    """``[name(key=value, ...), ...]`` (LFM2's calls) parsed without running anything (``ast``); None otherwise."""
    try:
        tree = ast.parse(body.strip(), mode="eval").body
        items = tree.elts if isinstance(tree, ast.List) else [tree]
        calls = []
        for c in items:
            if not isinstance(c, ast.Call) or c.args or not isinstance(c.func, ast.Name | ast.Attribute):
                return None
            calls.append({"name": ast.unparse(c.func),
                          "arguments": {k.arg: _py_value(k.value) for k in c.keywords if k.arg}})
        return calls or None
    except (SyntaxError, ValueError, TypeError):
        return None


def _lfm2_calls(text: str) -> list[dict[str, Any]] | None:
    calls: list[dict[str, Any]] = []
    for body in _LFM2_CALL.findall(text):
        try:  # a history's JSON form
            obj = json.loads(body)
            found = [_one_call(o) for o in (obj if isinstance(obj, list) else [obj])]
            if any(c is None for c in found):
                return None
            calls += [c for c in found if c is not None]
        except ValueError:
            got = _python_calls(body)
            if got is None:
                return None
            calls += got
    return calls or None


def _mistral_calls(text: str) -> list[dict[str, Any]] | None:
    calls = []
    dec = json.JSONDecoder()
    for m in _MISTRAL_CALL.finditer(text):
        rest = text[m.end():].lstrip()
        try:
            args, _ = dec.raw_decode(rest)
        except ValueError:
            return None
        if not isinstance(args, dict):
            return None
        calls.append({"name": m.group(1), "arguments": args})
    return calls or None


def parse_tool_calls(text: str, tools: list[dict[str, Any]] | None = None) -> list[dict[str, Any]] | None:
    r"""Tool calls in ``text`` as ``[{"name", "arguments"}]``, or None when it is plain text.

    Understands ``<tool_call>{...}</tool_call>`` (Qwen/Hermes), a bare JSON object or list of objects
    with ``name`` + ``arguments``/``parameters`` (Llama 3.x), optionally inside a ```json fence; Qwen3.5's
    ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>`` (values typed by
    the ``tools`` schema where given: a string parameter stays text, others are read as JSON when they parse);
    Gemma 4's ``<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>``; LFM2's
    ``<|tool_call_start|>[NAME(key="text", n=3)]<|tool_call_end|>`` (read with ``ast``, never run); and Ministral
    3's ``[TOOL_CALLS]NAME[ARGS]{...}``.

    >>> parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    [{'name': 'f', 'arguments': {'x': 1}}]
    >>> parse_tool_calls('<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>')
    [{'name': 'f', 'arguments': {'x': 1}}]
    >>> parse_tool_calls('<|tool_call>call:f{city:<|"|>Paris<|"|>,days:3}<tool_call|>')
    [{'name': 'f', 'arguments': {'city': 'Paris', 'days': 3}}]
    >>> parse_tool_calls('<|tool_call_start|>[f(city="Paris", days=3)]<|tool_call_end|>')
    [{'name': 'f', 'arguments': {'city': 'Paris', 'days': 3}}]
    >>> parse_tool_calls('[TOOL_CALLS]f[ARGS]{"city": "Paris"}')
    [{'name': 'f', 'arguments': {'city': 'Paris'}}]
    >>> parse_tool_calls("hello") is None
    True
    """
    t = text.strip()
    if t.startswith("<|tool_call>"):
        return _gemma_calls(t)
    if "<|tool_call_start|>" in t:
        return _lfm2_calls(t)
    if "[TOOL_CALLS]" in t:
        return _mistral_calls(t)
    if t.startswith("<tools>"):  # the tools list's tag, which Qwen2.5 siblings copy around their call
        t = re.sub(r"^<tools>\s*|\s*</tools>$", "", t)
    bodies = _TOOL_TAG.findall(t) if "<tool_call>" in t else [t]
    if bodies and all(b.startswith("<function=") for b in bodies):
        return _xml_calls(t, tools)
    calls: list[dict[str, Any]] = []
    for body in bodies:
        objs = _json_values(body)
        if objs is None:
            return None
        for obj in objs:
            for item in obj if isinstance(obj, list) else [obj]:
                call = _one_call(item)
                if call is None:
                    return None
                calls.append(call)
    return calls or None


_BETWEEN = re.compile(r"(?:\s|,|```[a-zA-Z]*)*")  # what may stand between calls: space, commas, fences


def _json_values(text: str) -> list[Any] | None:
    """The JSON values of ``text`` one after another, each maybe in its own ```` ```json ```` fence and separated
    by whitespace or commas; None when anything else is there.

    >>> _json_values('```json\\n{"a": 1}\\n```\\n```json\\n[2]\\n```')
    [{'a': 1}, [2]]
    >>> _json_values('{"a": 1} and more') is None
    True
    """
    dec = json.JSONDecoder()
    out: list[Any] = []
    i = 0
    while True:
        m = _BETWEEN.match(text, i)
        i = m.end() if m else i
        if i >= len(text):
            return out or None
        try:
            value, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        out.append(value)
