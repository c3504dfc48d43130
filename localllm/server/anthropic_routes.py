"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) on the one generation
path, so Claude Code and the ``anthropic`` SDKs can talk to a local model: the body is translated into a
:class:`~localllm.server.generation.Call` and the events into content blocks (pure functions and
:class:`MessagesEncoder` below). Errors are Anthropic's ``{"type": "error", "error": {"type", "message"}}``.

* ``system`` (a string or text blocks), ``messages`` with text, image (base64), ``document`` (text),
  ``tool_use``, ``tool_result`` and ``thinking`` blocks, ``max_tokens`` (required), ``stop_sequences``,
  ``temperature``/``top_p``/``top_k``. A ``system`` message among the turns (Claude Code sends one after the first
  user turn) is a system turn where it stands; the blocks of server tools' results are left out with a log line.
* ``tools`` (``{name, description, input_schema}`` and Anthropic's versioned client tools, ``bash_…``,
  ``text_editor_…``) → tool calls as ``tool_use`` blocks (``stop_reason: "tool_use"``); tools that run on
  Anthropic's servers (web search...) and deferred ones cannot run here and are left out
  (:mod:`~localllm.server.agent_tools`).
* ``thinking: {"type": "enabled", "budget_tokens": N}`` (or ``adaptive``: the model's default, at
  ``output_config.effort``'s level where given; or the effort alone: that level) → ``think``; reasoning comes
  back as ``thinking`` blocks. A model that cannot think ignores it (no 400), as Ollama does here.
  ``output_config.format`` (a JSON schema) constrains the answer.
* Streams: ``message_start``, ``ping``, per block ``content_block_start`` / ``content_block_delta``
  (``thinking_delta``, ``text_delta``, ``input_json_delta``) / ``content_block_stop``, ``message_delta``
  (stop reason, usage), ``message_stop``; an error after the stream began is an ``error`` event.
* ``x-api-key`` works where a key is configured (:mod:`localllm.server.security`); ``anthropic-version`` and
  ``anthropic-beta`` headers (and ``?beta=true``) are accepted and ignored, as are ``cache_control``,
  ``metadata`` and ``context_management``.
"""

from __future__ import annotations

import json
import logging
import secrets
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from localllm.api import ContextOverflowError, Done, GenerateRequest, Stats, TextChunk, ThinkValue, ToolCalls
from localllm.server import generation as g
from localllm.server.agent_tools import anthropic_tools
from localllm.server.checks import check_format, check_tools, forced_tools
from localllm.server.errors import APIError, bad_request
from localllm.server.framing import SSE, SSE_HEADERS, call_id, normalize_calls, sse
from localllm.server.images import check_request, from_base64
from localllm.server.options import api_options, keep_alive_of
from localllm.server.protocol import engine_of, run_sync
from localllm.server.schemas import AnthropicBody, AnthropicCountBody
from localllm.server.translator import Translator

router = APIRouter(prefix="/v1")
log = logging.getLogger("localllm.server")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 529: "overloaded_error"}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """Anthropic's error shape: ``{"type": "error", "error": {"type", "message"}, "request_id"}``.

    >>> error_body(404, "no such model")["error"]
    {'type': 'not_found_error', 'message': 'no such model'}
    """
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}, "request_id": f"req_{secrets.token_hex(12)}"}


API = Translator("anthropic", router, error_body, prefix="/v1/messages")
_IGNORED_BLOCKS = ("redacted_thinking", "server_tool_use", "web_search_tool_result", "web_fetch_tool_result",
                   "code_execution_tool_result", "bash_code_execution_tool_result",
                   "text_editor_code_execution_tool_result", "tool_search_tool_result", "mcp_tool_use",
                   "mcp_tool_result", "container_upload", "tool_reference")
_EFFORT: dict[str, ThinkValue] = {"low": "low", "medium": "medium", "high": "high", "max": "high", "xhigh": "high"}


# ------------------------------------------------------------------------------------ requests (pure)


BILLING_HEADER = "x-anthropic-billing-header:"  # Claude Code's first system block: for Anthropic's billing


def system_text(system: Any, where: str = "system") -> str:
    """The system prompt's text. Claude Code's billing header block (its version and a hash that changes with
    the session's first message) is not for the model and is left out, so that sessions share their prefix."""
    if system is None or isinstance(system, str):
        return system or ""
    texts = []
    for i, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise bad_request(f"{where}[{i}] must be a text block")
        if not block["text"].startswith(BILLING_HEADER):
            texts.append(block["text"])
    return "\n\n".join(texts)


def _document_text(block: dict[str, Any]) -> str:
    """A ``document`` (a text or content source) or ``search_result`` block as text; "" for a PDF or a URL."""
    source = block.get("source")
    title = block.get("title") if isinstance(block.get("title"), str) else ""
    if isinstance(source, dict) and source.get("type") == "text" and isinstance(source.get("data"), str):
        body = source["data"]
    else:
        content = source.get("content") if isinstance(source, dict) else block.get("content")
        body = _tool_result_text(content, "document") if isinstance(content, list | str) else ""
    if not body:
        log.info("document block without text (a PDF or a URL) left out of the prompt")
    return f"{title}\n{body}".strip() if body else ""


def _tool_result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of blocks")
    texts = []
    for block in content:
        if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
    return "\n".join(texts)


def messages_in(messages: list[Any]) -> tuple[list[dict[str, Any]], bool]:
    """Anthropic messages → backend messages; also whether any carries an image. A user turn's
    ``tool_result`` blocks become ``tool`` turns placed before its text."""
    out: list[dict[str, Any]] = []
    images = False
    names: dict[str, str] = {}  # tool_use id -> tool name
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.role not in ("user", "assistant", "system"):
            raise bad_request(f"{where}.role must be user, assistant or system")
        if m.role == "system":  # Claude Code's environment turn: a system turn where it stands
            out.append({"role": "system", "content": system_text(m.content, f"{where}.content")})
            continue
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        texts: list[str] = []
        thinking: list[str] = []
        calls: list[dict[str, Any]] = []
        pics: list[bytes] = []
        tools: list[dict[str, Any]] = []
        for j, block in enumerate(blocks):
            at = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                if not isinstance(block.get("text"), str):
                    raise bad_request(f"{at}.text must be a string")
                texts.append(block["text"])
            elif kind == "image":
                source = block.get("source") or {}
                if not isinstance(source, dict) or source.get("type") != "base64" or not source.get("data"):
                    raise bad_request(f"{at}: only base64 image sources are supported")
                images = True
                pics.append(from_base64(source["data"], f"{at}.source.data"))
            elif kind == "thinking" and m.role == "assistant":
                if isinstance(block.get("thinking"), str):
                    thinking.append(block["thinking"])
            elif kind == "tool_use" and m.role == "assistant":
                name, tid, args = block.get("name"), block.get("id"), block.get("input", {})
                if not isinstance(name, str) or not isinstance(tid, str) or not isinstance(args, dict):
                    raise bad_request(f"{at}: a tool_use block needs an id, a name and an input object")
                names[tid] = name
                calls.append({"type": "function", "id": tid, "function": {"name": name, "arguments": args}})
            elif kind == "tool_result" and m.role == "user":
                tid = block.get("tool_use_id")
                if not isinstance(tid, str):
                    raise bad_request(f"{at}.tool_use_id must be a string")
                tool: dict[str, Any] = {"role": "tool", "content": _tool_result_text(block.get("content"), at),
                                        "tool_call_id": tid}
                if tid in names:
                    tool["name"] = tool["tool_name"] = names[tid]
                tools.append(tool)
            elif kind in ("document", "search_result"):
                text = _document_text(block)
                if text:
                    texts.append(text)
            elif kind in _IGNORED_BLOCKS:
                log.info("%s block (a server tool's or a reference) left out of the prompt", kind)
            else:
                raise bad_request(f"{at}: content block type {str(kind)[:40]!r} is not supported in a {m.role} turn")
        out += tools
        if texts or pics or calls or thinking or not tools:
            msg: dict[str, Any] = {"role": m.role, "content": "\n".join(texts)}
            if pics:
                msg["images"] = pics
            if thinking:
                msg["thinking"] = msg["reasoning_content"] = "\n".join(thinking)
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out, images


def tools_in(tools: list[dict[str, Any]] | None, choice: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """Anthropic tools → the backend's; server tools and deferred ones are left out, with a log line."""
    out = anthropic_tools(tools)  # checked even when tool_choice is none: a malformed tool is a 400
    if not out or (choice or {}).get("type") == "none":
        return None
    return check_tools(out)


def format_of(output_config: dict[str, Any] | None) -> str | dict[str, Any] | None:
    """``output_config.format`` (``{"type": "json_schema", "schema": {...}}``) → the answer's format."""
    fmt = (output_config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad_request("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}")
    return check_format(fmt["schema"], "output_config.format.schema")


def think_of(thinking: dict[str, Any] | None, output_config: dict[str, Any] | None) -> ThinkValue:
    """``thinking`` and ``output_config.effort`` → ``think``: ``enabled`` on, ``disabled`` off (whatever the
    effort); ``adaptive`` the model's own default (a thinking model thinks) at the effort's level where one is
    given; an effort alone, that level (a template without levels: on).

    >>> think_of({"type": "adaptive"}, None), think_of({"type": "adaptive"}, {"effort": "max"})
    (None, 'high')
    >>> think_of(None, {"effort": "low"}), think_of({"type": "disabled"}, {"effort": "high"})
    ('low', False)
    """
    if thinking:
        kind = thinking.get("type")
        if kind == "enabled":
            return True
        if kind == "disabled":
            return False
        if kind != "adaptive":
            raise bad_request(f"thinking.type must be enabled, disabled or adaptive, got {str(kind)[:40]!r}")
    effort = (output_config or {}).get("effort")
    if effort is None:
        return None
    if not isinstance(effort, str) or effort not in _EFFORT:
        raise bad_request(f"output_config.effort must be low, medium, high or max, got {str(effort)[:40]!r}")
    return _EFFORT[effort]


def messages_call(body: AnthropicBody) -> g.Call:
    if not body.model:
        raise bad_request("model is required")
    if body.max_tokens is None or body.max_tokens <= 0:
        raise bad_request("max_tokens is required and must be positive")
    if not body.messages:
        raise bad_request("messages is required")
    messages, images = messages_in(body.messages)
    system = system_text(body.system)
    if system:
        messages.insert(0, {"role": "system", "content": system})
    sampling, options = api_options(body.options, max_tokens=body.max_tokens, stop=body.stop_sequences,
                                    temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                    num_ctx=body.num_ctx)
    tools = tools_in(body.tools, body.tool_choice)
    req = GenerateRequest(messages=messages, sampling=sampling, tools=tools, format=format_of(body.output_config),
                          think=think_of(body.thinking, body.output_config))
    return g.Call(body.model, req, options, keep_alive_of(body.keep_alive), images=images, relax_thinking=True,
                  force_tools=forced_tools(body.tool_choice) if tools else None)


def estimate_tokens(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    """A rough prompt size (characters / 4, as Ollama estimates it) for ``message_start``, sent before
    the prompt's real count is known (``message_delta`` has that)."""
    chars = sum(len(str(m.get("content") or "")) for m in messages) + len(json.dumps(tools or []))
    return max(1, chars // 4)


# ------------------------------------------------------------------------------------ answers (pure)


def stop_reason(done: Done, calls: bool) -> str:
    if calls:
        return "tool_use"
    return "max_tokens" if done.finish_reason == "length" else "end_turn"


def usage(stats: Stats) -> dict[str, int]:
    cached = int(stats.prompt_cached_tokens)
    return {"input_tokens": int(stats.prompt_eval_count) - cached, "output_tokens": int(stats.eval_count),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def tool_use_blocks(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "tool_use", "id": call_id(call, "toolu_"), "name": call["function"]["name"],
             "input": call["function"]["arguments"] if isinstance(call["function"]["arguments"], dict)
             else {"value": call["function"]["arguments"]}}
            for call in normalize_calls(calls)]


def message_object(mid: str, model: str, r: g.Result) -> dict[str, Any]:
    """The non-streaming answer: thinking, then text, then tool_use blocks."""
    content: list[dict[str, Any]] = []
    if r.thinking:
        content.append({"type": "thinking", "thinking": r.thinking, "signature": ""})
    if r.content or not r.calls:
        content.append({"type": "text", "text": r.content})
    content += tool_use_blocks(r.calls)
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason(r.done, bool(r.calls)), "stop_sequence": None, "usage": usage(r.done.stats)}


class MessagesEncoder:
    """Events → Anthropic's stream: one content block per run of thinking, of text, per tool call."""

    media_type = SSE
    headers = SSE_HEADERS

    def __init__(self, model: str, input_estimate: int):
        self.mid = f"msg_{secrets.token_hex(12)}"
        self.model, self.input_estimate = model, input_estimate
        self.index = -1  # the open block's index
        self.open: str | None = None  # "thinking" | "text"
        self.calls = False

    @staticmethod
    def _ev(kind: str, **payload: Any) -> bytes:
        return sse({"type": kind, **payload}, event=kind)

    def head(self) -> list[bytes]:
        message: dict[str, Any] = {
            "id": self.mid, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.input_estimate, "output_tokens": 0}}
        return [self._ev("message_start", message=message), self._ev("ping")]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        frames = []
        if self.open == "thinking":
            frames.append(self._ev("content_block_delta", index=self.index,
                                   delta={"type": "signature_delta", "signature": ""}))
        self.open = None
        return frames + [self._ev("content_block_stop", index=self.index)]

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        frames = self._close()
        self.index += 1
        return frames + [self._ev("content_block_start", index=self.index, content_block=block)]

    def event(self, event: TextChunk | ToolCalls) -> list[bytes]:
        if isinstance(event, ToolCalls):
            frames: list[bytes] = []
            for block in tool_use_blocks(event.calls):
                frames += self._start({**block, "input": {}})
                frames.append(self._ev("content_block_delta", index=self.index,
                                       delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])}))
                frames.append(self._ev("content_block_stop", index=self.index))
            self.calls = self.calls or bool(event.calls)
            return frames
        if not event.text:
            return []
        kind = "thinking" if event.thinking else "text"
        frames = []
        if self.open != kind:
            frames = self._start({"type": "thinking", "thinking": "", "signature": ""} if event.thinking
                                 else {"type": "text", "text": ""})
            self.open = kind
        delta = ({"type": "thinking_delta", "thinking": event.text} if event.thinking
                 else {"type": "text_delta", "text": event.text})
        return frames + [self._ev("content_block_delta", index=self.index, delta=delta)]

    def done(self, done: Done) -> list[bytes]:
        frames = self._close()
        if self.index < 0:  # nothing was said: one empty text block
            frames += self._start({"type": "text", "text": ""}) + [self._ev("content_block_stop", index=0)]
        return frames + [self._ev("message_delta", delta={"stop_reason": stop_reason(done, self.calls),
                                                          "stop_sequence": None}, usage=usage(done.stats)),
                         self._ev("message_stop")]

    def error(self, status: int, message: str) -> list[bytes]:
        return [self._ev("error", error=error_body(status, message)["error"])]


# ------------------------------------------------------------------------------------------ routes


@router.post("/messages")
async def messages(body: AnthropicBody, request: Request) -> Response:
    call = messages_call(body)
    try:
        run = await g.begin(request, call)
    except ContextOverflowError as e:  # the context grew as far as it could first: Anthropic's words
        raise APIError(400, f"prompt is too long: {e.prompt_tokens} tokens > {e.n_ctx} maximum") from None
    if body.stream:
        return run.stream(MessagesEncoder(body.model, estimate_tokens(call.request.messages or [], call.request.tools)))
    return JSONResponse(message_object(f"msg_{secrets.token_hex(12)}", body.model, await run.collect()))


@router.post("/messages/count_tokens")
async def count_tokens(body: AnthropicCountBody, request: Request) -> dict[str, int]:
    """The prompt's size in the model's tokens: system, turns and tool schemas tokenized as plain text (the
    chat template's own markup is not counted, so this is a close estimate); images as their image tokens."""
    name, model = await g.installed(request, body.model)
    messages, _ = messages_in(body.messages or [])
    parts = [system_text(body.system)] + [str(m.get("content") or "") for m in messages]
    parts += [json.dumps(m["tool_calls"]) for m in messages if m.get("tool_calls")]
    if body.tools:
        parts.append(json.dumps(body.tools))
    text = "\n".join(p for p in parts if p)
    pics = [bytes(i) for m in messages for i in (m.get("images") or [])]
    if pics:  # image blocks count as the positions the model's projector makes of them
        g.check_capabilities(g.Call(body.model, GenerateRequest(messages=messages), images=True), model)
        check_request(messages)
    tokens = await run_sync(engine_of(request).tokenize, name, text, pics, pool="work") if text or pics else []
    return {"input_tokens": len(tokens)}
