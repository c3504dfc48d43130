"""OpenAI's Chat Completions, Completions, Embeddings and Models (``/v1/*``, its translator :data:`API`) in front
of the same path as Ollama's handlers: SSE streams (``data: {...}\\n\\n`` … ``data: [DONE]``), errors as
``{"error": {"message", "type", "param", "code"}}``. Each handler translates the body into a
:class:`~localllm.server.generation.Call` and the events back (pure functions below).

Reasoning arrives in ``message.reasoning`` / ``delta.reasoning`` (Ollama's name) and, with the same text,
``reasoning_content`` (llama-server's and DeepSeek's), so clients of either find it; assistant turns sent back
may carry either. ``reasoning_effort`` (or ``reasoning.effort``) sets ``think``.

Extensions (not in OpenAI's API; the README documents them): ``num_ctx`` sets the context size,
``options`` takes any Ollama option, ``keep_alive`` is Ollama's.
"""

from __future__ import annotations

import base64
import json
import secrets
import struct
import time
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from localllm.api import (
    ContextOverflowError,
    Done,
    GenerateRequest,
    Sampling,
    Stats,
    TextChunk,
    TokenLogprob,
    ToolCalls,
)
from localllm.loader import LoadOptions
from localllm.server import generation as g
from localllm.server.audio import from_input_audio
from localllm.server.checks import check_format, check_tools, forced_tools
from localllm.server.errors import APIError, bad_request
from localllm.server.framing import SSE, SSE_HEADERS, call_id, logprob_item, normalize_calls, rfc3339, sse
from localllm.server.images import from_url
from localllm.server.modelinfo import capabilities, modified_ts
from localllm.server.options import api_options, check_top_logprobs, keep_alive_of, logit_bias, think_from_effort
from localllm.server.protocol import engine_of, run_sync
from localllm.server.schemas import ChatCompletionBody, CompletionBody, EmbeddingsOAIBody
from localllm.server.translator import Translator
from localllm.store import InstalledModel

router = APIRouter(prefix="/v1")
FINGERPRINT = "fp_ollama"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error", 503: "api_error"}


TOO_LONG = "This model's maximum context length is "  # how OpenAI's context_length_exceeded errors begin


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``; a prompt longer than the
    model's context has OpenAI's code and words (:func:`begin`).

    >>> error_body(404, "no such model")["error"]["type"]
    'not_found_error'
    """
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    code = "context_length_exceeded" if status == 400 and message.startswith(TOO_LONG) else None
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def begin(http: Request, call: g.Call) -> g.Run:
    """:func:`~localllm.server.generation.begin`, with a prompt that cannot fit the model at all (the context
    grows first, up to the trained one and what memory holds) in OpenAI's words."""
    try:
        return await g.begin(http, call)
    except ContextOverflowError as e:
        raise APIError(400, f"{TOO_LONG}{e.n_ctx} tokens. However, your messages resulted in {e.prompt_tokens} "
                       "tokens. Please reduce the length of the messages.", param="messages") from None


API = Translator("openai", router, error_body, prefix="/v1")


# ------------------------------------------------------------------------------------ requests (pure)


def sampling_of(body: ChatCompletionBody | CompletionBody) -> tuple[Sampling, LoadOptions]:
    """OpenAI fields (+ the ``options``/``num_ctx`` extensions) → (Sampling, LoadOptions); OpenAI's
    defaults: temperature 1.0, top_p 1.0, under a created model's PARAMETERs (Ollama's OpenAI layer sends them as
    if the client had, so they override a Modelfile's ``temperature 0``; here a field the client left out takes the
    model's PARAMETER first, OpenAI's default only where the model has none)."""
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
    sampling, load = api_options(body.options, {"temperature": 1.0, "top_p": 1.0}, max_tokens=max_tokens,
                                 stop=body.stop, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                                 frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty,
                                 num_ctx=body.num_ctx)
    sampling.logit_bias = logit_bias(body.logit_bias)
    return sampling, load


def response_format(value: dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not value:
        return None
    kind = value.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return "json"
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                              param="response_format")
        return check_format(schema, "response_format")
    raise bad_request(f"response_format.type must be text, json_object or json_schema, got {str(kind)[:40]!r}",
                      param="response_format")


def tool_calls_in(calls: list[Any]) -> list[dict[str, Any]]:
    """An assistant turn's OpenAI tool calls (arguments as a JSON string) → the backend's."""
    out = []
    for t in calls:
        args = t.function.arguments
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise bad_request(f"tool call arguments for {t.function.name!r} are not valid JSON",
                                  param="messages") from None
        out.append({"type": "function", **({"id": t.id} if t.id else {}),
                    "function": {"name": t.function.name, "arguments": args}})
    return out


def oai_messages(messages: list[Any]) -> tuple[list[dict[str, Any]], bool]:
    """OpenAI messages → backend messages (text parts joined); also whether any has an image or audio clip."""
    out: list[dict[str, Any]] = []
    images = False
    names: dict[str, str] = {}  # tool call id -> function name, for the tool turns that answer them
    for i, m in enumerate(messages):
        content = m.content
        pics: list[Any] = []
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type in ("text", "input_text"):
                    texts.append(part.text or "")
                elif part.type in ("image_url", "input_image"):
                    images = True
                    url = part.image_url.get("url") if isinstance(part.image_url, dict) else part.image_url
                    pics.append(from_url(url, f"messages[{i}].content[{j}].image_url"))
                elif part.type == "input_audio":  # a clip rides with the images (told apart by its bytes)
                    images = True
                    pics.append(from_input_audio(part.input_audio, f"messages[{i}].content[{j}].input_audio"))
                else:
                    raise bad_request(f"unsupported content part type {part.type[:40]!r}", param="messages")
            content = "\n".join(texts)
        msg: dict[str, Any] = {"role": m.role, "content": content or ""}
        if pics:
            msg["images"] = pics
        reasoning = m.reasoning or m.reasoning_content
        if reasoning and m.role == "assistant":
            msg["thinking"] = msg["reasoning_content"] = reasoning
        if m.tool_calls:
            msg["tool_calls"] = tool_calls_in(m.tool_calls)
            names.update({t.id: t.function.name for t in m.tool_calls if t.id})
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
            if m.tool_call_id in names and not m.name:
                msg["name"] = msg["tool_name"] = names[m.tool_call_id]
        if m.name:
            msg["name"] = m.name
        out.append(msg)
    return out, images


def chat_call(body: ChatCompletionBody) -> g.Call:
    if not body.messages:
        raise bad_request("[] is too short - 'messages'", param="messages")
    sampling, options = sampling_of(body)
    messages, images = oai_messages(body.messages)
    tools = check_tools(body.tools) if body.tools and body.tool_choice != "none" else None
    effort = body.reasoning_effort if body.reasoning_effort is not None else (
        body.reasoning.effort if body.reasoning is not None else None)
    top = check_top_logprobs(body.top_logprobs)
    req = GenerateRequest(messages=messages, sampling=sampling, format=response_format(body.response_format),
                          tools=tools, think=think_from_effort(effort), logprobs=bool(body.logprobs),
                          top_logprobs=top if body.logprobs else 0)
    return g.Call(body.model, req, options, keep_alive_of(body.keep_alive), images=images,
                  force_tools=forced_tools(body.tool_choice) if tools else None)


def completion_call(body: CompletionBody) -> tuple[g.Call, str]:
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise bad_request("prompt must be a string", param="prompt")
        prompt = prompt[0]
    if body.suffix:
        raise bad_request(f'"{body.model}" does not support insert', param="suffix")
    sampling, options = sampling_of(body)
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    top = check_top_logprobs(body.logprobs, "logprobs") if body.logprobs is not None else 0
    req = GenerateRequest(prompt=prompt, sampling=sampling, logprobs=body.logprobs is not None, top_logprobs=top)
    return g.Call(body.model, req, options, keep_alive_of(body.keep_alive)), prompt


# ------------------------------------------------------------------------------------ answers (pure)


def tool_calls_out(calls: list[dict[str, Any]], *, start: int = 0, with_index: bool = False) -> list[dict[str, Any]]:
    """Backend tool calls → OpenAI's (arguments re-serialised as a JSON string)."""
    out = []
    for i, call in enumerate(normalize_calls(calls)):
        fn = call["function"]
        entry: dict[str, Any] = {"id": call_id(call), "type": "function",
                                 "function": {"name": fn["name"], "arguments": json.dumps(fn["arguments"])}}
        if with_index:
            entry["index"] = start + i
        out.append(entry)
    return out


def usage(stats: Stats) -> dict[str, Any]:
    p, e = int(stats.prompt_eval_count), int(stats.eval_count)
    return {"prompt_tokens": p, "completion_tokens": e, "total_tokens": p + e,
            "prompt_tokens_details": {"cached_tokens": int(stats.prompt_cached_tokens)},
            "completion_tokens_details": {"reasoning_tokens": int(stats.thinking_tokens)}}


def finish(done: Done, tool_calls: bool) -> str:
    if tool_calls:
        return "tool_calls"
    return "length" if done.finish_reason == "length" else "stop"


def chat_logprobs(lps: list[TokenLogprob] | None, top: bool) -> dict[str, Any] | None:
    """``choices[].logprobs`` of Chat Completions: ``{"content": [...], "refusal": None}``."""
    if not lps:
        return None
    return {"content": [logprob_item(lp, top) for lp in lps], "refusal": None}


def legacy_logprobs(lps: list[TokenLogprob] | None, top: bool, offset: int) -> dict[str, Any] | None:
    """``choices[].logprobs`` of (legacy) Completions: parallel lists, ``text_offset`` from ``offset``."""
    if not lps:
        return None
    offsets = []
    for lp in lps:
        offsets.append(offset)
        offset += len(lp.token)
    return {"tokens": [lp.token for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{t: p for t, p, _ in lp.top} for lp in lps] if top else None, "text_offset": offsets}


def chat_completion(model: str, r: g.Result, cid: str, created: int, top: bool) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": r.content}
    if r.thinking:
        message["reasoning"] = message["reasoning_content"] = r.thinking
    if r.calls:
        message["tool_calls"] = tool_calls_out(r.calls)
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": FINGERPRINT,
            "choices": [{"index": 0, "message": message, "logprobs": chat_logprobs(r.logprobs, top),
                         "finish_reason": finish(r.done, bool(r.calls))}],
            "usage": usage(r.done.stats)}


def error_frame(message: str, status: int = 500) -> bytes:
    """A stream's last event when it fails after it began (no ``[DONE]`` follows)."""
    return sse(error_body(status, message))


class ChatEncoder:
    """Events → ``chat.completion.chunk`` SSE frames: the role first, reasoning and content deltas apart,
    tool calls with a running index, then the finish reason, usage if asked, ``[DONE]``."""

    media_type = SSE
    headers = SSE_HEADERS

    def __init__(self, model: str, top: bool, include_usage: bool):
        self.base = {"id": f"chatcmpl-{secrets.token_hex(8)}", "object": "chat.completion.chunk",
                     "created": int(time.time()), "model": model, "system_fingerprint": FINGERPRINT}
        self.top, self.include_usage = top, include_usage
        self.role_sent = False
        self.calls = 0

    def _chunk(self, delta: dict[str, Any], logprobs: Any = None, finish_reason: str | None = None) -> bytes:
        if not self.role_sent:
            delta = {"role": "assistant", **delta}
            self.role_sent = True
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        if logprobs is not None:
            choice["logprobs"] = logprobs
        return sse({**self.base, "choices": [choice]})

    def head(self) -> list[bytes]:
        return []

    def event(self, event: TextChunk | ToolCalls) -> list[bytes]:
        if isinstance(event, ToolCalls):
            calls = tool_calls_out(event.calls, start=self.calls, with_index=True)
            self.calls += len(calls)
            return [self._chunk({"tool_calls": calls})]
        if not event.text and not event.logprobs:
            return []
        delta = ({"reasoning": event.text, "reasoning_content": event.text} if event.thinking
                 else {"content": event.text})
        return [self._chunk(delta, chat_logprobs(event.logprobs, self.top))]

    def done(self, done: Done) -> list[bytes]:
        out = [self._chunk({}, finish_reason=finish(done, self.calls > 0))]
        if self.include_usage:
            out.append(sse({**self.base, "choices": [], "usage": usage(done.stats)}))
        return out + [b"data: [DONE]\n\n"]

    def error(self, status: int, message: str) -> list[bytes]:
        return [error_frame(message, status)]  # the last event (no [DONE]: the stream failed)


class CompletionEncoder:
    """Events → ``text_completion`` SSE frames (the prompt first with ``echo``); reasoning is not text here."""

    media_type = SSE
    headers = SSE_HEADERS

    def __init__(self, model: str, prompt: str, echo: bool, logprobs: bool, top: bool, include_usage: bool):
        self.base = {"id": f"cmpl-{secrets.token_hex(8)}", "object": "text_completion", "created": int(time.time()),
                     "model": model, "system_fingerprint": FINGERPRINT}
        self.prompt, self.echo, self.logprobs, self.top, self.include_usage = prompt, echo, logprobs, top, include_usage
        self.offset = len(prompt) if echo else 0

    def head(self) -> list[bytes]:
        return []

    def event(self, event: TextChunk | ToolCalls) -> list[bytes]:
        if not isinstance(event, TextChunk) or event.thinking:
            return []
        text = event.text
        if self.echo:
            text, self.echo = self.prompt + text, False
        lp = legacy_logprobs(event.logprobs, self.top, self.offset) if self.logprobs else None
        self.offset += len(event.text)
        return [sse({**self.base, "choices": [{"text": text, "index": 0, "logprobs": lp, "finish_reason": None}]})]

    def done(self, done: Done) -> list[bytes]:
        out = [sse({**self.base, "choices": [{"text": "", "index": 0, "logprobs": None,
                                              "finish_reason": finish(done, False)}]})]
        if self.include_usage:
            out.append(sse({**self.base, "choices": [], "usage": usage(done.stats)}))
        return out + [b"data: [DONE]\n\n"]

    def error(self, status: int, message: str) -> list[bytes]:
        return [error_frame(message, status)]  # the last event (no [DONE]: the stream failed)


# ------------------------------------------------------------------------------------------ routes


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionBody, request: Request) -> Response:
    call = chat_call(body)
    run = await begin(request, call)
    top = call.request.top_logprobs > 0
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return run.stream(ChatEncoder(body.model, top, include_usage))
    result = await run.collect()
    return JSONResponse(chat_completion(body.model, result, f"chatcmpl-{secrets.token_hex(8)}", int(time.time()), top))


@router.post("/completions")
async def completions(body: CompletionBody, request: Request) -> Response:
    call, prompt = completion_call(body)
    run = await begin(request, call)
    want_lp, top = call.request.logprobs, call.request.top_logprobs > 0
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return run.stream(CompletionEncoder(body.model, prompt, body.echo, want_lp, top, include_usage))
    r = await run.collect()
    text = prompt + r.content if body.echo else r.content
    lp = legacy_logprobs(r.logprobs, top, len(prompt) if body.echo else 0) if want_lp else None
    return JSONResponse({"id": f"cmpl-{secrets.token_hex(8)}", "object": "text_completion",
                         "created": int(time.time()), "model": body.model, "system_fingerprint": FINGERPRINT,
                         "choices": [{"text": text, "index": 0, "logprobs": lp,
                                      "finish_reason": finish(r.done, False)}],
                         "usage": usage(r.done.stats)})


def model_entry(model: InstalledModel) -> dict[str, Any]:
    """A model as OpenAI lists it, plus the fields Anthropic's SDK reads from the same ``/v1/models``."""
    created = modified_ts(model)
    return {"id": model.name, "object": "model", "created": created, "owned_by": "library",
            "type": "model", "display_name": model.name, "created_at": rfc3339(float(created)) if created else None,
            "capabilities": capabilities(model)}


@router.get("/models")
async def models(request: Request) -> dict[str, Any]:
    listed = await run_sync(engine_of(request).store.list)
    data = [model_entry(m) for m in listed]
    return {"object": "list", "data": data, "has_more": False,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


@router.get("/models/{model:path}")
async def model(model: str, request: Request) -> dict[str, Any]:
    return model_entry((await g.installed(request, model))[1])


@router.post("/embeddings")
async def embeddings(body: EmbeddingsOAIBody, request: Request) -> dict[str, Any]:
    texts = [body.input] if isinstance(body.input, str) else list(body.input)
    if not texts or any(not t for t in texts):
        raise bad_request("invalid input: expected a non-empty string or a list of non-empty strings", param="input")
    if body.encoding_format not in (None, "float", "base64"):
        raise bad_request("encoding_format must be float or base64", param="encoding_format")
    pooled, _, found = await g.embed_texts(request, body.model, texts, None, None)
    vectors, tokens = g.shorten(body.model, found, pooled.vectors, body.dimensions), pooled.tokens
    data = []
    for i, v in enumerate(vectors):
        emb: Any = v
        if body.encoding_format == "base64":
            emb = base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()
        data.append({"object": "embedding", "embedding": emb, "index": i})
    return {"object": "list", "data": data, "model": body.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
