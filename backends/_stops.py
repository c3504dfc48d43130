"""Streaming text helpers shared by backends: stop strings held back, UTF-8 held until complete, tool calls.

>>> m = StopMatcher(["</s>"])
>>> m.push("Hello </")
('Hello ', False)
>>> m.push("s> more")
('', True)
"""

from __future__ import annotations

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
_TOOL_PREFIXES = ("<tool_call>", "{", "[", "```")


def could_be_tool_call(text: str) -> bool:
    """True while ``text`` (stripped) is, or could grow into, a tool call in a form we parse."""
    t = text.lstrip()
    if not t:
        return True
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


def parse_tool_calls(text: str) -> list[dict[str, Any]] | None:
    """Tool calls in ``text`` as ``[{"name", "arguments"}]``, or None when it is plain text.

    Understands ``<tool_call>{...}</tool_call>`` (Qwen/Hermes), a bare JSON object or list of objects
    with ``name`` + ``arguments``/``parameters`` (Llama 3.x), optionally inside a ```json fence.

    >>> parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    [{'name': 'f', 'arguments': {'x': 1}}]
    >>> parse_tool_calls("hello") is None
    True
    """
    t = text.strip()
    if t.startswith("```"):
        t = re.sub(r"^```[a-zA-Z]*\s*|\s*```$", "", t)
    bodies = _TOOL_TAG.findall(t) if "<tool_call>" in t else [t]
    calls: list[dict[str, Any]] = []
    for body in bodies:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        for item in obj if isinstance(obj, list) else [obj]:
            call = _one_call(item)
            if call is None:
                return None
            calls.append(call)
    return calls or None
