"""OpenAI's API (``/v1/*``) on the same engine: SSE streams (``data: {...}\\n\\n`` … ``data: [DONE]``),
errors as ``{"error": {"message", "type", "param", "code"}}``.

Extensions (not in OpenAI's API; the README documents them): ``num_ctx`` sets the context size,
``options`` takes any Ollama option, ``keep_alive`` is Ollama's.
"""

from __future__ import annotations

import base64
import json
import secrets
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from localllm.engine import Done, GenerateRequest, TextChunk, ToolCalls
from localllm.server import common as c
from localllm.server.ollama_routes import cap_ctx, collect, embed_texts, first_event, normalize_calls, shorten
from localllm.server.schemas import ChatCompletionBody, CompletionBody, EmbeddingsOAIBody

router = APIRouter(prefix="/v1")
FINGERPRINT = "fp_ollama"


def _engine(request: Request) -> Any:
    return request.app.state.engine


def sampling_of(body: Any, extra_defaults: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """OpenAI fields (+ the ``options``/``num_ctx`` extensions) → (Sampling, LoadOptions).
    OpenAI's defaults: temperature 1.0, top_p 1.0; explicit top-level fields win over ``options``."""
    opts: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, **(extra_defaults or {})}
    if body.options is not None:
        if not isinstance(body.options, dict):
            raise c.bad_request("options must be an object")
        opts.update(body.options)
    for field, key in (("temperature", "temperature"), ("top_p", "top_p"), ("seed", "seed"),
                       ("frequency_penalty", "frequency_penalty"), ("presence_penalty", "presence_penalty"),
                       ("num_ctx", "num_ctx")):
        value = getattr(body, field, None)
        if value is not None:
            opts[key] = value
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
    if max_tokens is not None:
        if max_tokens < 1:
            raise c.bad_request("max_tokens must be at least 1")
        opts["num_predict"] = max_tokens
    if body.stop is not None:
        opts["stop"] = [body.stop] if isinstance(body.stop, str) else body.stop
        if len(opts["stop"]) > 16:
            raise c.bad_request("stop takes at most 16 sequences")
    return c.options_of(opts)


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
            raise c.bad_request("response_format.json_schema.schema must be a JSON schema object")
        return schema
    raise c.bad_request(f"response_format.type must be text, json_object or json_schema, got {str(kind)[:40]!r}")


def oai_messages(messages: list[Any]) -> tuple[list[dict[str, Any]], bool]:
    """OpenAI messages → backend messages (text parts joined); also whether any has an image."""
    out: list[dict[str, Any]] = []
    images = False
    for m in messages:
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type == "text":
                    texts.append(part.text or "")
                elif part.type in ("image_url", "input_image"):
                    images = True
                else:
                    raise c.bad_request(f"unsupported content part type {part.type[:40]!r}")
            content = "\n".join(texts)
        msg: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.tool_calls:
            calls = []
            for t in m.tool_calls:
                args = t.function.arguments
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError:
                        raise c.bad_request(f"tool call arguments for {t.function.name!r} are not valid JSON") from None
                calls.append({"type": "function", **({"id": t.id} if t.id else {}),
                              "function": {"name": t.function.name, "arguments": args}})
            msg["tool_calls"] = calls
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.name:
            msg["name"] = m.name
        out.append(msg)
    return out, images


def oai_tool_calls(calls: list[dict[str, Any]], *, with_index: bool = False) -> list[dict[str, Any]]:
    out = []
    for i, call in enumerate(normalize_calls(calls)):
        fn = call["function"]
        entry: dict[str, Any] = {"id": call.get("id") or f"call_{secrets.token_hex(6)}", "type": "function",
                                 "function": {"name": fn["name"], "arguments": json.dumps(fn["arguments"])}}
        if with_index:
            entry["index"] = i
        out.append(entry)
    return out


def usage(stats: Any) -> dict[str, int]:
    p, e = int(stats.prompt_eval_count), int(stats.eval_count)
    return {"prompt_tokens": p, "completion_tokens": e, "total_tokens": p + e}


def finish(done: Done, tool_calls: bool) -> str:
    if tool_calls:
        return "tool_calls"
    return "length" if done.finish_reason == "length" else "stop"


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def sse_stream(first: Any, agen: AsyncIterator[Any], chunk: Any, final: Any) -> AsyncIterator[bytes]:
    """Events → SSE chunks, then ``[DONE]``; an error mid-stream is sent as an error object."""
    try:
        event = first
        while True:
            if isinstance(event, Done):
                if event.finish_reason == "error":
                    yield sse({"error": {"message": c.scrub(event.error or "generation failed"), "type": "api_error",
                                         "param": None, "code": None}})
                else:
                    for obj in final(event):
                        yield sse(obj)
                yield b"data: [DONE]\n\n"
                return
            obj = chunk(event)
            if obj is not None:
                yield sse(obj)
            try:
                event = await agen.__anext__()
            except StopAsyncIteration:
                yield b"data: [DONE]\n\n"
                return
    except Exception as e:  # noqa: BLE001 - reported in the stream
        _, message = c.status_of(e)
        yield sse({"error": {"message": message, "type": "api_error", "param": None, "code": None}})
    finally:
        await agen.aclose()


async def check_caps(request: Request, name: str, model_label: str, *, images: bool, tools: bool) -> None:
    if not (images or tools):
        return
    model = await c.run_sync(_engine(request).store.get, name)
    caps = c.capabilities(model)
    if images and "vision" not in caps:
        raise c.bad_request(f'"{model_label}" does not support images (it is not a multimodal model)')
    if tools and "tools" not in caps:
        raise c.bad_request(f'"{model_label}" does not support tools')


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionBody, request: Request) -> Response:
    name = c.check_name(body.model)
    if not body.messages:
        raise c.bad_request("[] is too short - 'messages'")
    keep_alive = c.keep_alive_of(body.keep_alive)
    sampling, load_options = sampling_of(body)
    load_options = await cap_ctx(request, name, load_options)
    fmt = response_format(body.response_format)
    messages, images = oai_messages(body.messages)
    tools = body.tools if body.tools and body.tool_choice != "none" else None
    await check_caps(request, name, body.model, images=images, tools=bool(tools))
    req = GenerateRequest(messages=messages, sampling=sampling, format=fmt, tools=tools)
    agen = _engine(request).agenerate(name, req, load_options, keep_alive=keep_alive)
    first = await first_event(agen, request)
    cid = f"chatcmpl-{secrets.token_hex(8)}"
    created = int(time.time())
    base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": body.model,
            "system_fingerprint": FINGERPRINT}

    if body.stream:
        state = {"role_sent": False, "tools": False}
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(event: Any) -> dict[str, Any] | None:
            delta: dict[str, Any] = {}
            if not state["role_sent"]:
                delta["role"] = "assistant"
                state["role_sent"] = True
            if isinstance(event, TextChunk):
                if not event.text and "role" not in delta:
                    return None
                delta["content"] = event.text
            elif isinstance(event, ToolCalls):
                state["tools"] = True
                delta["tool_calls"] = oai_tool_calls(event.calls, with_index=True)
            else:
                return None
            return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}

        def final(done: Done) -> list[dict[str, Any]]:
            out = [{**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish(done, state["tools"])}]}]
            if include_usage:
                out.append({**base, "choices": [], "usage": usage(done.stats)})
            return out

        return StreamingResponse(sse_stream(first, agen, chunk, final), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    text, calls, done = await collect(first, agen)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = oai_tool_calls(calls)
    return JSONResponse({"id": cid, "object": "chat.completion", "created": created, "model": body.model,
                         "system_fingerprint": FINGERPRINT,
                         "choices": [{"index": 0, "message": message, "logprobs": None,
                                      "finish_reason": finish(done, bool(calls))}],
                         "usage": usage(done.stats)})


@router.post("/completions")
async def completions(body: CompletionBody, request: Request) -> Response:
    name = c.check_name(body.model)
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise c.bad_request("prompt must be a string")
        prompt = prompt[0]
    if body.suffix:
        raise c.bad_request(f'"{body.model}" does not support insert')
    keep_alive = c.keep_alive_of(body.keep_alive)
    sampling, load_options = sampling_of(body)
    load_options = await cap_ctx(request, name, load_options)
    if not prompt:
        raise c.bad_request("prompt must not be empty")
    req = GenerateRequest(prompt=prompt, sampling=sampling)
    agen = _engine(request).agenerate(name, req, load_options, keep_alive=keep_alive)
    first = await first_event(agen, request)
    cid = f"cmpl-{secrets.token_hex(8)}"
    created = int(time.time())
    base = {"id": cid, "object": "text_completion", "created": created, "model": body.model,
            "system_fingerprint": FINGERPRINT}

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        echoed = {"done": not body.echo}

        def chunk(event: Any) -> dict[str, Any] | None:
            if not isinstance(event, TextChunk):
                return None
            text = event.text
            if not echoed["done"]:
                text, echoed["done"] = prompt + text, True
            return {**base, "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": None}]}

        def final(done: Done) -> list[dict[str, Any]]:
            out = [{**base, "choices": [{"text": "", "index": 0, "logprobs": None,
                                         "finish_reason": finish(done, False)}]}]
            if include_usage:
                out.append({**base, "choices": [], "usage": usage(done.stats)})
            return out

        return StreamingResponse(sse_stream(first, agen, chunk, final), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    text, _, done = await collect(first, agen)
    if body.echo:
        text = prompt + text
    return JSONResponse({**base, "choices": [{"text": text, "index": 0, "logprobs": None,
                                              "finish_reason": finish(done, False)}], "usage": usage(done.stats)})


def model_entry(model: Any) -> dict[str, Any]:
    return {"id": model.name, "object": "model", "created": c.modified_ts(model), "owned_by": "library"}


@router.get("/models")
async def models(request: Request) -> dict[str, Any]:
    listed = await c.run_sync(_engine(request).store.list)
    return {"object": "list", "data": [model_entry(m) for m in listed]}


@router.get("/models/{model:path}")
async def model(model: str, request: Request) -> dict[str, Any]:
    name = c.check_name(model)
    return model_entry(await c.run_sync(_engine(request).store.get, name))


@router.post("/embeddings")
async def embeddings(body: EmbeddingsOAIBody, request: Request) -> Response:
    name = c.check_name(body.model)
    texts = [body.input] if isinstance(body.input, str) else list(body.input)
    if not texts or any(not t for t in texts):
        raise c.bad_request("invalid input: expected a non-empty string or a list of non-empty strings")
    if body.encoding_format not in (None, "float", "base64"):
        raise c.bad_request("encoding_format must be float or base64")
    vectors, tokens, _ = await embed_texts(request, name, texts, None, None)
    vectors = shorten(vectors, body.dimensions)
    data = []
    for i, v in enumerate(vectors):
        emb: Any = v
        if body.encoding_format == "base64":
            emb = base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()
        data.append({"object": "embedding", "embedding": emb, "index": i})
    return {"object": "list", "data": data, "model": body.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
