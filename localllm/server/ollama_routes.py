"""Ollama's native API (``/api/*``, its translator :data:`API`): NDJSON streams by default, ``{"error": "..."}``
errors, metrics in nanoseconds. The generate and chat handlers translate a body into a
:class:`~localllm.server.generation.Call` and events back into Ollama's lines (pure functions below); the path
between is :mod:`localllm.server.generation`. The model-management handlers call the store."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from localllm.api import Done, GenerateRequest, Stats, TextChunk, ToolCalls, drafting_text
from localllm.errors import InvalidModelFileError, LocalLLMError
from localllm.local import device_use, modelfile_of
from localllm.modelfile import ROLES, Modelfile, ModelfileError, check_parameters, check_template
from localllm.residency import Resident
from localllm.server import generation as g
from localllm.server.checks import check_digest, check_format, check_name, check_ref, check_tools
from localllm.server.errors import bad_request, status_of
from localllm.server.framing import NDJSON, logprob_item, ndjson, normalize_calls, now_rfc3339, rfc3339
from localllm.server.images import from_base64
from localllm.server.modelinfo import (
    capabilities,
    details_of,
    digest_hex,
    info_of,
    modified_of,
    projector_info,
    size_of,
)
from localllm.server.options import check_think, check_top_logprobs, keep_alive_of, options_of
from localllm.server.protocol import engine_of, run_sync
from localllm.server.schemas import (
    ChatBody,
    CopyBody,
    CreateBody,
    EmbedBody,
    EmbeddingsBody,
    GenerateBody,
    ModelBody,
    PullBody,
)
from localllm.server.translator import Translator
from localllm.store import InstalledModel, PullProgress, Store

router = APIRouter()
# our answer to /api/version: clients gate features on it (Codex's --oss needs Ollama 0.13.4 or newer for the
# Responses API), so it is the current Ollama release whose API we follow; our own version goes beside it
OLLAMA_COMPAT_VERSION = "0.33.1"


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """Ollama's error shape: ``{"error": "<one sentence>"}``."""
    return {"error": message}


API = Translator("ollama", router, error_body, prefix="")


def _store(request: Request) -> Store:
    return engine_of(request).store


# ------------------------------------------------------------------------------------ converters (pure)


def metrics(stats: Stats) -> dict[str, int]:
    return {
        "total_duration": int(stats.total_duration),
        "load_duration": int(stats.load_duration),
        "prompt_eval_count": int(stats.prompt_eval_count),
        "prompt_eval_duration": int(stats.prompt_eval_duration),
        "eval_count": int(stats.eval_count),
        "eval_duration": int(stats.eval_duration),
    }


def done_reason(done: Done) -> str:
    return "length" if done.finish_reason == "length" else "stop"


def chat_messages(messages: list[Any]) -> tuple[list[dict[str, Any]], bool]:
    """Ollama messages → backend messages; also whether any carries images. An assistant turn's
    ``thinking`` goes to the template as ``thinking`` and ``reasoning_content`` (the names templates read)."""
    out: list[dict[str, Any]] = []
    images = False
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.images:
            images = True
            msg["images"] = [from_base64(x, f"messages[{i}].images[{j}]") for j, x in enumerate(m.images)]
        if m.thinking and m.role == "assistant":
            msg["thinking"] = msg["reasoning_content"] = m.thinking
        if m.tool_calls:
            msg["tool_calls"] = [{"type": "function", **({"id": t.id} if t.id else {}),
                                  "function": {"name": t.function.name, "arguments": t.function.arguments}}
                                 for t in m.tool_calls]
        if m.tool_name:
            msg["name"] = m.tool_name
            msg["tool_name"] = m.tool_name
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out, images


def _common(body: GenerateBody | ChatBody) -> dict[str, Any]:
    """What generate and chat read alike: sampling, load options, keep-alive, format, think, logprobs."""
    sampling, options = options_of(body.options)
    top = check_top_logprobs(body.top_logprobs)
    return {"sampling": sampling, "options": options, "keep_alive": keep_alive_of(body.keep_alive),
            "format": check_format(body.format), "think": check_think(body.think),
            "logprobs": bool(body.logprobs), "top_logprobs": top if body.logprobs else 0}


def generate_call(body: GenerateBody) -> g.Call:
    """``/api/generate``'s body → the generation (``raw`` sends the prompt untemplated)."""
    k = _common(body)
    if body.raw and (body.template or body.system or body.context):
        raise bad_request("raw mode does not support template, system, or context")
    fields = {"sampling": k["sampling"], "format": k["format"], "logprobs": k["logprobs"],
              "top_logprobs": k["top_logprobs"]}
    pics = [from_base64(x, f"images[{j}]") for j, x in enumerate(body.images or [])]
    if body.raw:
        req = GenerateRequest(prompt=body.prompt or "", images=pics or None, **fields)
    else:
        user: dict[str, Any] = {"role": "user", "content": body.prompt or ""}
        if pics:
            user["images"] = pics
        messages = ([{"role": "system", "content": body.system}] if body.system else []) + [user]
        req = GenerateRequest(messages=messages, think=k["think"], **fields)
    return g.Call(body.model, req, k["options"], k["keep_alive"], images=bool(body.images))


def chat_call(body: ChatBody) -> g.Call:
    """``/api/chat``'s body → the generation."""
    k = _common(body)
    messages, images = chat_messages(body.messages or [])
    req = GenerateRequest(messages=messages, sampling=k["sampling"], format=k["format"],
                          tools=check_tools(body.tools), think=k["think"], logprobs=k["logprobs"],
                          top_logprobs=k["top_logprobs"])
    return g.Call(body.model, req, k["options"], k["keep_alive"], images=images)


def _logprobs(event: TextChunk, top: bool) -> dict[str, Any]:
    return {"logprobs": [logprob_item(lp, top) for lp in event.logprobs]} if event.logprobs else {}


def chat_line(model: str, event: TextChunk | ToolCalls | Done, top: bool = False) -> dict[str, Any]:
    """One ``/api/chat`` stream line: reasoning in ``message.thinking``, the answer in ``message.content``."""
    base = {"model": model, "created_at": now_rfc3339()}
    if isinstance(event, TextChunk):
        message: dict[str, Any] = {"role": "assistant", "content": "" if event.thinking else event.text}
        if event.thinking:
            message["thinking"] = event.text
        return {**base, "message": message, "done": False, **_logprobs(event, top)}
    if isinstance(event, ToolCalls):
        return {**base, "message": {"role": "assistant", "content": "",
                                    "tool_calls": normalize_calls(event.calls)}, "done": False}
    # beyond Ollama's fields (its clients ignore them): the prompt tokens reused from the KV cache
    return {**base, "message": {"role": "assistant", "content": ""}, "done": True,
            "done_reason": done_reason(event), **metrics(event.stats),
            "prompt_cached_count": int(event.stats.prompt_cached_tokens)}


def generate_line(model: str, event: TextChunk | ToolCalls | Done, top: bool = False) -> dict[str, Any]:
    """One ``/api/generate`` stream line: reasoning in ``thinking``, the answer in ``response``."""
    base = {"model": model, "created_at": now_rfc3339()}
    if isinstance(event, TextChunk):
        line = {**base, "response": "" if event.thinking else event.text, "done": False}
        if event.thinking:
            line["thinking"] = event.text
        return {**line, **_logprobs(event, top)}
    if isinstance(event, ToolCalls):
        return {**base, "response": "", "tool_calls": normalize_calls(event.calls), "done": False}
    return {**base, "response": "", "done": True, "done_reason": done_reason(event), **metrics(event.stats)}


def chat_result(model: str, r: g.Result, top: bool = False) -> dict[str, Any]:
    """The non-streaming ``/api/chat`` answer: thinking and content joined apart."""
    message: dict[str, Any] = {"role": "assistant", "content": r.content}
    if r.thinking:
        message["thinking"] = r.thinking
    if r.calls:
        message["tool_calls"] = normalize_calls(r.calls)
    out = {"model": model, "created_at": now_rfc3339(), "message": message, "done": True,
           "done_reason": done_reason(r.done), **metrics(r.done.stats)}
    if r.logprobs:
        out["logprobs"] = [logprob_item(lp, top) for lp in r.logprobs]
    return out


def generate_result(model: str, r: g.Result, top: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"model": model, "created_at": now_rfc3339(), "response": r.content}
    if r.thinking:
        out["thinking"] = r.thinking
    out.update({"done": True, "done_reason": done_reason(r.done), **metrics(r.done.stats)})
    if r.calls:
        out["tool_calls"] = normalize_calls(r.calls)
    if r.logprobs:
        out["logprobs"] = [logprob_item(lp, top) for lp in r.logprobs]
    return out


class LineEncoder:
    """Events → Ollama's NDJSON lines (``line`` is :func:`chat_line` or :func:`generate_line`); an error after
    the first line is the last line ``{"error": ...}``."""

    media_type = NDJSON
    headers: dict[str, str] = {}

    def __init__(self, model: str, line: Any, top: bool):
        self.model, self.line, self.top = model, line, top

    def head(self) -> list[bytes]:
        return []

    def event(self, event: TextChunk | ToolCalls) -> list[bytes]:
        return [ndjson(self.line(self.model, event, self.top))]

    def done(self, done: Done) -> list[bytes]:
        return [ndjson(self.line(self.model, done, self.top))]

    def error(self, status: int, message: str) -> list[bytes]:
        return [ndjson(error_body(status, message))]


# ------------------------------------------------------------------------------------------ routes


@router.api_route("/", methods=["GET", "HEAD"], response_class=PlainTextResponse, include_in_schema=False)
async def root(request: Request) -> Response:
    """``Ollama is running`` to every client that checks it; a browser (``Accept: text/html``) goes to the page."""
    from localllm.server.webui import wants_page

    if wants_page(request):
        from fastapi.responses import RedirectResponse

        return RedirectResponse("/ui/", status_code=302)
    return PlainTextResponse("Ollama is running")


@router.get("/api/version")
@router.head("/api/version", include_in_schema=False)
async def version() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as pkg_version

    try:
        ours = pkg_version("localllm")
    except PackageNotFoundError:
        ours = "0"
    return {"version": OLLAMA_COMPAT_VERSION, "localllm": ours}


@router.get("/api/status")
async def status() -> dict[str, Any]:
    return {"cloud": {"disabled": True, "source": "localllm"}}


@router.post("/api/generate")
async def generate(body: GenerateBody, request: Request) -> Response:
    call = generate_call(body)
    if body.suffix:
        await g.installed(request, body.model)
        raise bad_request(f'"{body.model}" does not support insert')
    if not body.prompt:
        reason = await g.load_or_unload(request, body.model, call.keep_alive, call.options)
        return JSONResponse({"model": body.model, "created_at": now_rfc3339(), "response": "", "done": True,
                             "done_reason": reason})
    run = await g.begin(request, call)
    top = call.request.top_logprobs > 0
    if body.stream:
        return run.stream(LineEncoder(body.model, generate_line, top))
    return JSONResponse(generate_result(body.model, await run.collect(), top))


@router.post("/api/chat")
async def chat(body: ChatBody, request: Request) -> Response:
    call = chat_call(body)
    if not body.messages:
        reason = await g.load_or_unload(request, body.model, call.keep_alive, call.options)
        return JSONResponse({"model": body.model, "created_at": now_rfc3339(),
                             "message": {"role": "assistant", "content": ""}, "done": True, "done_reason": reason})
    run = await g.begin(request, call)
    top = call.request.top_logprobs > 0
    if body.stream:
        return run.stream(LineEncoder(body.model, chat_line, top))
    return JSONResponse(chat_result(body.model, await run.collect(), top))


@router.post("/api/embed")
async def embed(body: EmbedBody, request: Request) -> Response:
    import time

    t0 = time.perf_counter_ns()
    keep_alive = keep_alive_of(body.keep_alive)
    texts = [body.input] if isinstance(body.input, str) else list(body.input)
    if not texts or texts == [""]:  # loads the model for the embeddings to come
        await g.embed_texts(request, body.model, [], body.options, keep_alive)
        return JSONResponse({"model": body.model, "embeddings": []})
    pooled, load_ns, found = await g.embed_texts(request, body.model, texts, body.options, keep_alive,
                                                 truncate=body.truncate)
    return JSONResponse({"model": body.model, "embeddings": g.shorten(body.model, found, pooled.vectors,
                                                                      body.dimensions),
                         "total_duration": time.perf_counter_ns() - t0, "load_duration": load_ns,
                         "prompt_eval_count": pooled.tokens})


@router.post("/api/embeddings")
async def embeddings(body: EmbeddingsBody, request: Request) -> Response:
    keep_alive = keep_alive_of(body.keep_alive)
    if not body.prompt:
        check_name(body.model)
        return JSONResponse({"embedding": []})
    pooled, _, _ = await g.embed_texts(request, body.model, [body.prompt], body.options, keep_alive)
    return JSONResponse({"embedding": pooled.vectors[0]})


def tag_entry(model: InstalledModel) -> dict[str, Any]:
    return {"name": model.name, "model": model.name, "modified_at": modified_of(model),
            "size": size_of(model), "digest": digest_hex(model.model_digest),
            "details": details_of(model),
            "capabilities": capabilities(model)}


@router.get("/api/tags")
@router.head("/api/tags", include_in_schema=False)
async def tags(request: Request) -> dict[str, Any]:
    models = await run_sync(_store(request).list)
    return {"models": [tag_entry(m) for m in models]}


def parameters_text(params: dict[str, Any]) -> str:
    """Ollama's ``parameters`` of ``/api/show``: one ``name value`` line per value (``stop`` once per string).

    >>> print(parameters_text({"temperature": 0.0, "stop": ["<|im_end|>", "User:"]}))
    temperature                    0
    stop                           "<|im_end|>"
    stop                           "User:"
    """
    import json

    lines = []
    for key, value in params.items():
        for v in value if isinstance(value, list) else [value]:
            text = json.dumps(v) if isinstance(v, str) else ("true" if v is True else "false" if v is False else
                                                             f"{v:g}" if isinstance(v, float) else str(v))
            lines.append(f"{key:<30} {text}")
    return "\n".join(lines)


@router.post("/api/show")
async def show(body: ModelBody, request: Request) -> Response:
    _, model = await g.installed(request, body.model or body.name)
    info = info_of(model)
    arch = info.get("architecture") or "unknown"
    model_info: dict[str, Any] = {"general.architecture": arch}
    if info.get("parameters"):
        model_info["general.parameter_count"] = info["parameters"]
    if info.get("name"):
        model_info["general.name"] = info["name"]
    for key, field in (("context_length", "context_length"), ("block_count", "n_layers"),
                       ("embedding_length", "n_embd"), ("attention.head_count", "n_head"),
                       ("attention.head_count_kv", "n_head_kv"), ("attention.key_length", "head_dim_k"),
                       ("attention.value_length", "head_dim_v"), ("vocab_size", "vocab_size")):
        if info.get(field) is not None:
            model_info[f"{arch}.{key}"] = info[field]
    if info.get("tokenizer_model"):
        model_info["tokenizer.ggml.model"] = info["tokenizer_model"]
    template = info.get("chat_template") or ""
    proj = projector_info(model)
    derived = model.derived
    return JSONResponse({
        **({"projector_info": proj} if proj is not None else {}),
        "license": info.get("license") or "",
        "modelfile": modelfile_of(model),
        "parameters": parameters_text(derived.parameters) if derived is not None else "",
        "template": template,
        "system": (derived.system or "") if derived is not None else "",
        **({"messages": derived.messages} if derived is not None and derived.messages else {}),
        "details": details_of(model),
        "model_info": model_info,
        "capabilities": capabilities(model),
        "modified_at": modified_of(model),
    })


def _slots(m: Resident) -> dict[str, Any]:
    try:
        lm = m.metrics
    except Exception:  # noqa: BLE001 - unloading right now
        return {}
    return {"slots": lm.slots, "slots_busy": lm.slots_busy, "batched": m.batched, "queued": lm.waiting,
            "kv_cells": lm.kv_cells,
            "kv_cells_used": lm.kv_tokens_active, "kv_cells_cached": lm.kv_tokens_idle,
            "kv_tokens_parked": lm.kv_tokens_parked,
            "prompt_cache": {"entries": lm.prompt_cache_entries, "bytes": lm.prompt_cache_bytes,
                             "hits": lm.prompt_cache_hits, "misses": lm.prompt_cache_misses}}


@router.get("/api/ps")
async def ps(request: Request) -> dict[str, Any]:
    out = []
    for m in engine_of(request).ps():
        out.append({
            "name": m.name, "model": m.name, "size": int(m.size), "digest": digest_hex(m.digest),
            "details": details_of(m.installed) if m.installed is not None else {},
            "expires_at": rfc3339(m.expires_at_wall), "size_vram": int(m.size_vram),
            "context_length": int(m.info.n_ctx),
            # beyond Ollama's fields: what llama.cpp allocated per device, beside the planner's estimate
            "devices": [asdict(d) for d in device_use(m)],
            # a mixture of experts: the first N layers' experts kept in RAM (0: none)
            "n_cpu_moe": int(m.plan.n_cpu_moe),
            # with the layers offloaded (llama.cpp's n_gpu_layers) of all: fewer layers, their experts in RAM
            "n_gpu_layers": int(m.info.n_gpu_layers), "n_layers": int(m.info.n_layers),
            # speculative decoding now: the draft, on or paused, or why it is off ("" without one)
            "drafting": drafting_text(m.info.draft, m.metrics.drafting, m.info.draft_off or None),
            # beyond Ollama's fields (its clients ignore them): the decode loop's slots and KV pool
            **_slots(m),
        })
    return {"models": out}


def progress_line(p: PullProgress) -> dict[str, Any]:
    """The store's PullProgress → Ollama's ``{status, digest?, total?, completed?}``."""
    out: dict[str, Any] = {"status": p.status or "pulling"}
    if p.digest:
        out["digest"] = p.digest if p.digest.startswith("sha256:") else f"sha256:{p.digest}"
        if out["status"] in ("downloading", "pulling"):
            out["status"] = f"pulling {p.digest.removeprefix('sha256:')[:12]}"
    if p.total > 0:  # Ollama omits them on phases without a byte count
        out["total"] = p.total
        out["completed"] = p.completed
    return out


@router.post("/api/pull")
async def pull(body: PullBody, request: Request) -> Response:
    name = check_name(body.model or body.name)
    store = _store(request)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    finished = threading.Event()
    cancel = threading.Event()  # a client that goes away stops the download (a later pull resumes it)

    def put(item: tuple[str, Any]) -> None:
        if not finished.is_set():
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def work() -> None:
        try:
            store.pull(name, progress=lambda p: put(("progress", p)), cancel=cancel)
            put(("done", None))
        except BaseException as e:  # noqa: BLE001 - reported to the client
            put(("error", e))

    threading.Thread(target=work, name=f"localllm-pull-{name}", daemon=True).start()

    if not body.stream:
        try:
            while True:
                kind, value = await queue.get()
                if kind == "done":
                    finished.set()
                    return JSONResponse({"status": "success"})
                if kind == "error":
                    finished.set()
                    raise value
        finally:
            if not finished.is_set():
                cancel.set()
            finished.set()

    async def lines() -> AsyncIterator[bytes]:
        seen_manifest = False
        try:
            yield ndjson({"status": "pulling manifest"})
            while True:
                kind, value = await queue.get()
                if kind == "progress":
                    line = progress_line(value)
                    if line["status"] == "pulling manifest" and not seen_manifest:
                        seen_manifest = True
                        continue
                    yield ndjson(line)
                elif kind == "done":
                    yield ndjson({"status": "success"})
                    return
                else:
                    status, message = status_of(value)
                    yield ndjson(error_body(status, message))
                    return
        finally:
            if not finished.is_set():
                cancel.set()
            finished.set()

    return StreamingResponse(lines(), media_type=NDJSON)


@router.delete("/api/delete")
async def delete(body: ModelBody, request: Request) -> Response:
    name = check_name(body.model or body.name)
    store = _store(request)
    model = await run_sync(store.get, name)  # 404 first
    await run_sync(engine_of(request).unload, name, pool="load")
    await run_sync(engine_of(request).unload, model.name, pool="load")
    await run_sync(store.remove, name)
    return Response(status_code=200)


@router.post("/api/copy")
async def copy(body: CopyBody, request: Request) -> Response:
    source = check_name(body.source, "source")
    destination = check_name(body.destination, "destination")
    await run_sync(_store(request).copy, source, destination)
    return Response(status_code=200)


@router.head("/api/blobs/{digest:path}")
async def blob_exists(digest: str, request: Request) -> Response:
    d = check_digest(digest)
    store = _store(request)
    exists = await run_sync(lambda: store.blob_path(d).is_file())
    return Response(status_code=200 if exists else 404)


UPLOAD_FLUSH = 1 << 20  # bytes of a blob's body gathered on the loop before one write on the upload pool


@router.post("/api/blobs/{digest:path}")
async def blob_upload(digest: str, request: Request) -> Response:
    """An upload for ``/api/create``'s ``files``: 201 when stored, 200 when the blob was there, 400 (Ollama's
    ``digest mismatch``) when the body's sha256 is another; the file goes under the models directory only, named
    by the checked digest. Bounded: 413 past ``LOCALLLM_MAX_UPLOAD`` (by ``Content-Length`` at once, else as the
    body arrives), 408 when the body stalls for ``LOCALLLM_UPLOAD_TIMEOUT`` seconds, 507 when the disk cannot take
    it; what a refused, cut or stalled upload wrote is removed. The body is read on the event loop (a slow client
    holds no thread) and written a MiB at a time on the upload pool."""
    from starlette.requests import ClientDisconnect

    from localllm.download import DiskFull
    from localllm.server.errors import APIError
    from localllm.store.create import UploadTooLarge, upload_too_large

    d = check_digest(digest)
    store = _store(request)
    limit: int = request.app.state.max_upload
    timeout: float = request.app.state.upload_timeout
    length = request.headers.get("content-length")
    size = int(length) if length and length.isdigit() else None
    try:
        upload = await run_sync(store.begin_upload, d, size=size, limit=limit, pool="upload")
    except UploadTooLarge as e:
        raise APIError(413, str(e)) from None
    except DiskFull as e:
        raise APIError(507, str(e)) from None
    try:
        body = request.stream().__aiter__()
        pending: list[bytes] = []
        held = received = 0
        while True:
            try:
                chunk = await asyncio.wait_for(body.__anext__(), timeout)
            except StopAsyncIteration:
                break
            except TimeoutError:
                raise APIError(408, f"the upload stalled: no data for {timeout:g} s; nothing was kept") from None
            received += len(chunk)
            if received > limit:  # a chunked body (no Content-Length) past the limit: refused as it arrives
                raise UploadTooLarge(upload_too_large(limit))
            pending.append(chunk)
            held += len(chunk)
            if held >= UPLOAD_FLUSH:
                await run_sync(upload.write, b"".join(pending), pool="upload")
                pending, held = [], 0
        if pending:
            await run_sync(upload.write, b"".join(pending), pool="upload")
        written = await run_sync(upload.finish, pool="upload")
    except UploadTooLarge as e:
        raise APIError(413, str(e)) from None
    except DiskFull as e:
        raise APIError(507, str(e)) from None
    except ClientDisconnect:
        raise g.ClientGone() from None
    except LocalLLMError as e:
        raise bad_request(str(e)) from None
    finally:
        upload.close()  # a close and an unlink, on the loop: done even when the request is cancelled
    return Response(status_code=201 if written else 200)


@router.post("/api/push")
async def push(request: Request) -> Response:
    """No registry to push to: Ollama's error shape, said plainly."""
    return JSONResponse({"error": "push is not supported: localllm has no registry to upload to (models stay on "
                                  "this machine; `localllm cp` names a copy)"}, status_code=400)


DRAFT_WORDS = ("auto", "none", "ngram", "mtp")  # a DRAFT that is not a model (as `run --draft` takes it)


def create_modelfile(body: CreateBody) -> Modelfile:
    """``/api/create``'s JSON → the :class:`Modelfile` the store takes (a 400 with one sentence when it cannot)."""
    files = body.files or {}
    ggufs = [(n, check_digest(dg, "files")) for n, dg in files.items()]
    if len(ggufs) > 1:
        raise bad_request("files takes one model file (a GGUF); safetensors directories are not supported")
    adapters = [check_digest(dg, "adapters") for dg in (body.adapters or {}).values()]  # LoRAs uploaded as blobs
    # names and digests only: a request never names a file on the server (the CLI's `create -f` reads the user's
    # own files and uploads them to /api/blobs first)
    draft = check_ref(body.draft, "draft", words=DRAFT_WORDS) if body.draft else None
    projector = check_digest(body.projector, "projector") if body.projector else None  # an uploaded blob only
    if ggufs:
        source = ggufs[0][1]
    elif body.from_:
        source = check_ref(body.from_, "from")
    else:
        raise bad_request("neither 'from' or 'files' was specified")
    try:
        params = check_parameters(body.parameters or {})
        messages = []
        for i, m in enumerate(body.messages or []):
            role, content = m.get("role"), m.get("content")
            if role not in ROLES or not isinstance(content, str):
                raise ModelfileError(f"messages[{i}] needs a role ({', '.join(ROLES)}) and a text content.")
            messages.append({"role": role, "content": content})
        template = check_template(body.template) if body.template is not None else None
    except ModelfileError as e:
        raise bad_request(str(e)) from None
    lic = [body.license] if isinstance(body.license, str) else list(body.license or [])
    return Modelfile(from_=source, parameters=params, system=body.system, template=template,
                     messages=messages, license=lic, adapters=adapters, draft=draft, projector=projector)


@router.post("/api/create")
async def create(body: CreateBody, request: Request) -> Response:
    """Make a model as Ollama's ``/api/create`` does (``from`` an installed or catalog model, or ``files`` naming
    an uploaded GGUF blob; ``quantize``: its F32/F16 weights quantized by llama.cpp), streaming status lines
    (``gathering model components``, ..., ``success``)."""
    name = check_name(body.model or body.name)
    mf = create_modelfile(body)
    store = _store(request)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    cancel = threading.Event()

    def put(item: tuple[str, Any]) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, item)

    def work() -> None:
        try:
            store.create(name, mf, progress=lambda p: put(("progress", p)), cancel=cancel, quantize=body.quantize)
            put(("done", None))
        except InvalidModelFileError as e:  # the client's file: a 400, not the server's fault
            put(("error", bad_request(str(e))))
        except BaseException as e:  # noqa: BLE001 - reported to the client
            put(("error", e))

    threading.Thread(target=work, name=f"localllm-create-{name}", daemon=True).start()
    await run_sync(engine_of(request).unload, name, pool="load")  # a model loaded under this name reloads as newly made

    if not body.stream:
        while True:
            kind, value = await queue.get()
            if kind == "done":
                return JSONResponse({"status": "success"})
            if kind == "error":
                raise value

    async def lines() -> AsyncIterator[bytes]:
        try:
            yield ndjson({"status": "gathering model components"})
            while True:
                kind, value = await queue.get()
                if kind == "progress":
                    if value.status != "success":
                        yield ndjson(progress_line(value))
                elif kind == "done":
                    yield ndjson({"status": "success"})
                    return
                else:
                    status, message = status_of(value)
                    yield ndjson(error_body(status, message))
                    return
        finally:
            cancel.set()

    return StreamingResponse(lines(), media_type=NDJSON)
