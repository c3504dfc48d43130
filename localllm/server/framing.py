"""What goes out, in the shapes the APIs share: stream frames (NDJSON lines, server-sent events), times as
Ollama writes them, tool calls in one shape, a token's logprobs, tool call ids."""

from __future__ import annotations

import json
import secrets
from datetime import UTC, datetime
from typing import Any

from localllm.api import TokenLogprob

NDJSON = "application/x-ndjson"
SSE = "text/event-stream"
SSE_HEADERS = {"Cache-Control": "no-cache"}


def ndjson(obj: Any) -> bytes:
    """One NDJSON line (Ollama's streams)."""
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode()


def sse(obj: Any, event: str | None = None) -> bytes:
    """One server-sent event: ``data: {...}`` (Chat Completions), with ``event: <type>`` before it
    (Responses, Anthropic Messages)."""
    data = b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"
    return b"event: " + event.encode() + b"\n" + data if event else data


def now_rfc3339() -> str:
    """``created_at`` as Ollama writes it (RFC 3339 with nanoseconds, UTC)."""
    t = datetime.now(UTC)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond:06d}000Z"


def rfc3339(ts: float | None) -> str:
    if ts is None:  # "never": Ollama shows a far-future time
        return "2318-11-26T00:00:00Z"
    t = datetime.fromtimestamp(ts, UTC)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond:06d}000Z"


def normalize_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Backend tool calls (``{"name", "arguments"}`` or ``{"function": {...}}``) → Ollama's shape
    ``{"id"?, "function": {"index", "name", "arguments": {...}}}``.

    >>> normalize_calls([{"name": "f", "arguments": '{"x": 1}'}])
    [{'function': {'index': 0, 'name': 'f', 'arguments': {'x': 1}}}]
    """
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = {"value": args}
        entry: dict[str, Any] = {"function": {"index": i, "name": fn.get("name", ""), "arguments": args or {}}}
        if call.get("id"):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def logprob_item(lp: TokenLogprob, top: bool) -> dict[str, Any]:
    """One token's logprob as Ollama and OpenAI's Chat Completions write it: ``{token, logprob, bytes,
    top_logprobs: [{token, logprob, bytes}]}`` (alternatives only when asked for)."""
    item: dict[str, Any] = {"token": lp.token, "logprob": lp.logprob, "bytes": lp.bytes}
    if top:
        item["top_logprobs"] = [{"token": t, "logprob": p, "bytes": b} for t, p, b in lp.top]
    return item


def call_id(call: dict[str, Any], prefix: str = "call_") -> str:
    """A tool call's id, or a fresh one."""
    return str(call.get("id") or f"{prefix}{secrets.token_hex(12)}")
