"""Ollama's native API (``/api/*``): NDJSON streams by default, ``{"error": "..."}`` errors, metrics
in nanoseconds. Each handler translates HTTP to engine / store calls and back; nothing else."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from localllm.engine import Done, GenerateRequest, TextChunk, ToolCalls
from localllm.server import common as c
from localllm.server.schemas import ChatBody, CopyBody, EmbedBody, EmbeddingsBody, GenerateBody, ModelBody, PullBody

router = APIRouter()
NDJSON = "application/x-ndjson"


def _engine(request: Request) -> Any:
    return request.app.state.engine


def _store(request: Request) -> Any:
    return request.app.state.engine.store


def metrics(stats: Any) -> dict[str, int]:
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


def normalize_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Backend tool calls (``{"name", "arguments"}`` or ``{"function": {...}}``) → Ollama's shape."""
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


class ClientGone(Exception):
    """The client disconnected before the first byte (answered 499, which nobody reads)."""


async def first_event(agen: AsyncIterator[Any], request: Request | None = None) -> Any:
    """The first event, so errors before the first byte get their real status. While waiting (in the
    queue, for a load, for the prompt) a client that disconnects cancels the request at once."""
    task = asyncio.ensure_future(agen.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.2)
            if done:
                return task.result()
            if request is not None and await request.is_disconnected():
                task.cancel()
                raise ClientGone()
    except BaseException:
        if not task.done():
            task.cancel()
        await agen.aclose()
        raise


async def ndjson_stream(first: Any, agen: AsyncIterator[Any], render: Any) -> AsyncIterator[bytes]:
    """Render events as NDJSON lines; an error mid-stream becomes the last line ``{"error": ...}``."""
    try:
        event = first
        while True:
            if isinstance(event, Done) and event.finish_reason == "error":
                yield (json.dumps({"error": c.scrub(event.error or "generation failed")}) + "\n").encode()
                return
            line = render(event)
            if line is not None:
                yield (json.dumps(line) + "\n").encode()
            if isinstance(event, Done):
                return
            try:
                event = await agen.__anext__()
            except StopAsyncIteration:
                return
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except Exception as e:  # noqa: BLE001 - reported in the stream
        _, message = c.status_of(e)
        yield (json.dumps({"error": message}) + "\n").encode()
    finally:
        await agen.aclose()


async def collect(first: Any, agen: AsyncIterator[Any]) -> tuple[str, list[dict[str, Any]], Done]:
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    event = first
    try:
        while True:
            if isinstance(event, TextChunk):
                text.append(event.text)
            elif isinstance(event, ToolCalls):
                calls.extend(event.calls)
            elif isinstance(event, Done):
                if event.finish_reason == "error":
                    raise c.APIError(500, event.error or "generation failed")
                return "".join(text), calls, event
            try:
                event = await agen.__anext__()
            except StopAsyncIteration:
                raise c.APIError(500, "the generation ended without a result") from None
    finally:
        await agen.aclose()


async def load_or_unload(request: Request, name: str, keep_alive: float | None, load_options: Any) -> str:
    """An empty prompt loads the model (``load``); with ``keep_alive: 0`` it unloads it (``unload``)."""
    engine = _engine(request)
    if keep_alive == 0:
        model = await c.run_sync(engine.store.get, name)  # 404 for an unknown model
        await c.run_sync(engine.unload, name)
        await c.run_sync(engine.unload, model.name)  # loaded under its canonical name
        return "unload"
    await c.run_sync(engine.load, name, load_options, keep_alive=keep_alive)
    return "load"


async def installed(request: Request, name: str) -> Any:
    return await c.run_sync(_store(request).get, name)


async def cap_ctx(request: Request, name: str, load_options: Any) -> Any:
    """Like Ollama, a ``num_ctx`` above the model's trained context is capped to it."""
    if load_options.num_ctx is None:
        return load_options
    from dataclasses import replace

    trained = c.info_of(await installed(request, name)).get("context_length") or 0
    if trained and load_options.num_ctx > trained:
        return replace(load_options, num_ctx=int(trained))
    return load_options


def check_think(think: Any, name: str) -> None:
    if think not in (None, False, "", "false", "none"):
        raise c.bad_request(f'"{name}" does not support thinking')


# ------------------------------------------------------------------------------------------ routes


@router.api_route("/", methods=["GET", "HEAD"], response_class=PlainTextResponse, include_in_schema=False)
async def root() -> str:
    return "Ollama is running"


@router.get("/api/version")
@router.head("/api/version", include_in_schema=False)
async def version() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as pkg_version

    try:
        ours = pkg_version("localllm")
    except PackageNotFoundError:
        ours = "0"
    return {"version": c.OLLAMA_COMPAT_VERSION, "localllm": ours}


@router.get("/api/status")
async def status() -> dict[str, Any]:
    return {"cloud": {"disabled": True, "source": "localllm"}}


@router.post("/api/generate")
async def generate(body: GenerateBody, request: Request) -> Response:
    name = c.check_name(body.model)
    keep_alive = c.keep_alive_of(body.keep_alive)
    sampling, load_options = c.options_of(body.options)
    load_options = await cap_ctx(request, name, load_options)
    fmt = c.check_format(body.format)
    check_think(body.think, body.model)
    if body.raw and (body.template or body.system or body.context):
        raise c.bad_request("raw mode does not support template, system, or context")
    if body.images:
        model = await installed(request, name)
        if "vision" not in c.capabilities(model):
            raise c.bad_request(f'"{body.model}" does not support images (it is not a multimodal model)')
    if body.suffix:
        await installed(request, name)
        raise c.bad_request(f'"{body.model}" does not support insert')
    if not body.prompt:
        reason = await load_or_unload(request, name, keep_alive, load_options)
        return JSONResponse({"model": body.model, "created_at": c.now_rfc3339(), "response": "", "done": True,
                             "done_reason": reason})
    if body.raw:
        req = GenerateRequest(prompt=body.prompt, sampling=sampling, format=fmt)
    else:
        messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
            {"role": "user", "content": body.prompt}]
        req = GenerateRequest(messages=messages, sampling=sampling, format=fmt)
    agen = _engine(request).agenerate(name, req, load_options, keep_alive=keep_alive)
    first = await first_event(agen, request)

    def render(event: Any) -> dict[str, Any] | None:
        base = {"model": body.model, "created_at": c.now_rfc3339()}
        if isinstance(event, TextChunk):
            return {**base, "response": event.text, "done": False}
        if isinstance(event, ToolCalls):
            return {**base, "response": "", "tool_calls": normalize_calls(event.calls), "done": False}
        if isinstance(event, Done):
            return {**base, "response": "", "done": True, "done_reason": done_reason(event), **metrics(event.stats)}
        return None

    if body.stream:
        return StreamingResponse(ndjson_stream(first, agen, render), media_type=NDJSON)
    text, calls, done = await collect(first, agen)
    out = {"model": body.model, "created_at": c.now_rfc3339(), "response": text, "done": True,
           "done_reason": done_reason(done), **metrics(done.stats)}
    if calls:
        out["tool_calls"] = normalize_calls(calls)
    return JSONResponse(out)


def chat_messages(messages: list[Any]) -> tuple[list[dict[str, Any]], bool]:
    """Ollama messages → backend messages; also whether any carries images."""
    out: list[dict[str, Any]] = []
    images = False
    for m in messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.images:
            images = True
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


@router.post("/api/chat")
async def chat(body: ChatBody, request: Request) -> Response:
    name = c.check_name(body.model)
    keep_alive = c.keep_alive_of(body.keep_alive)
    sampling, load_options = c.options_of(body.options)
    load_options = await cap_ctx(request, name, load_options)
    fmt = c.check_format(body.format)
    check_think(body.think, body.model)
    if not body.messages:
        reason = await load_or_unload(request, name, keep_alive, load_options)
        return JSONResponse({"model": body.model, "created_at": c.now_rfc3339(),
                             "message": {"role": "assistant", "content": ""}, "done": True, "done_reason": reason})
    messages, images = chat_messages(body.messages)
    if images or body.tools:
        model = await installed(request, name)
        caps = c.capabilities(model)
        if images and "vision" not in caps:
            raise c.bad_request(f'"{body.model}" does not support images (it is not a multimodal model)')
        if body.tools and "tools" not in caps:
            raise c.bad_request(f'"{body.model}" does not support tools')
    req = GenerateRequest(messages=messages, sampling=sampling, format=fmt, tools=body.tools or None)
    agen = _engine(request).agenerate(name, req, load_options, keep_alive=keep_alive)
    first = await first_event(agen, request)

    def render(event: Any) -> dict[str, Any] | None:
        base = {"model": body.model, "created_at": c.now_rfc3339()}
        if isinstance(event, TextChunk):
            return {**base, "message": {"role": "assistant", "content": event.text}, "done": False}
        if isinstance(event, ToolCalls):
            return {**base, "message": {"role": "assistant", "content": "",
                                        "tool_calls": normalize_calls(event.calls)}, "done": False}
        if isinstance(event, Done):
            return {**base, "message": {"role": "assistant", "content": ""}, "done": True,
                    "done_reason": done_reason(event), **metrics(event.stats)}
        return None

    if body.stream:
        return StreamingResponse(ndjson_stream(first, agen, render), media_type=NDJSON)
    text, calls, done = await collect(first, agen)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = normalize_calls(calls)
    return JSONResponse({"model": body.model, "created_at": c.now_rfc3339(), "message": message, "done": True,
                         "done_reason": done_reason(done), **metrics(done.stats)})


def shorten(vectors: list[list[float]], dimensions: int | None) -> list[list[float]]:
    """Matryoshka-style truncation to ``dimensions``, renormalised."""
    if not dimensions:
        return vectors
    out = []
    for v in vectors:
        v = v[:dimensions]
        norm = sum(x * x for x in v) ** 0.5 or 1.0
        out.append([x / norm for x in v])
    return out


async def embed_texts(request: Request, name: str, texts: list[str], options: dict[str, Any] | None,
                      keep_alive: float | None) -> tuple[list[list[float]], int, int]:
    """(vectors, prompt tokens, load ns)."""
    engine = _engine(request)
    _, load_options = c.options_of(options)
    load_options = await cap_ctx(request, name, load_options)
    was_loaded = engine.is_loaded(name)
    vectors = await c.run_sync(engine.embed, name, texts, load_options, keep_alive=keep_alive)
    tokens = 0
    for t in texts:
        tokens += len(await c.run_sync(engine.tokenize, name, t))
    running = None if was_loaded else next((m for m in engine.ps() if m.name == name), None)
    load_ns = running.load_duration_ns if running is not None else 0
    return vectors, tokens, load_ns


@router.post("/api/embed")
async def embed(body: EmbedBody, request: Request) -> Response:
    import time

    t0 = time.perf_counter_ns()
    name = c.check_name(body.model)
    keep_alive = c.keep_alive_of(body.keep_alive)
    texts = [body.input] if isinstance(body.input, str) else list(body.input)
    if not texts or texts == [""]:
        await c.run_sync(_engine(request).load, name, c.options_of(body.options)[1], keep_alive=keep_alive)
        return JSONResponse({"model": body.model, "embeddings": []})
    vectors, tokens, load_ns = await embed_texts(request, name, texts, body.options, keep_alive)
    return JSONResponse({"model": body.model, "embeddings": shorten(vectors, body.dimensions),
                         "total_duration": time.perf_counter_ns() - t0, "load_duration": load_ns,
                         "prompt_eval_count": tokens})


@router.post("/api/embeddings")
async def embeddings(body: EmbeddingsBody, request: Request) -> Response:
    name = c.check_name(body.model)
    keep_alive = c.keep_alive_of(body.keep_alive)
    if not body.prompt:
        return JSONResponse({"embedding": []})
    vectors, _, _ = await embed_texts(request, name, [body.prompt], body.options, keep_alive)
    return JSONResponse({"embedding": vectors[0]})


def tag_entry(model: Any) -> dict[str, Any]:
    return {"name": model.name, "model": model.name, "modified_at": c.modified_of(model),
            "size": c.size_of(model), "digest": c.digest_hex(model), "details": c.details_of(model),
            "capabilities": c.capabilities(model)}


@router.get("/api/tags")
@router.head("/api/tags", include_in_schema=False)
async def tags(request: Request) -> dict[str, Any]:
    models = await c.run_sync(_store(request).list)
    return {"models": [tag_entry(m) for m in models]}


@router.post("/api/show")
async def show(body: ModelBody, request: Request) -> Response:
    name = c.check_name(body.model or body.name)
    model = await installed(request, name)
    info = c.info_of(model)
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
    return JSONResponse({
        "license": info.get("license") or "",
        "modelfile": f"# Modelfile generated by localllm\nFROM {model.name}\n",
        "parameters": "",
        "template": template,
        "system": "",
        "details": c.details_of(model),
        "model_info": model_info,
        "capabilities": c.capabilities(model),
        "modified_at": c.modified_of(model),
    })


@router.get("/api/ps")
async def ps(request: Request) -> dict[str, Any]:
    out = []
    for m in _engine(request).ps():
        out.append({
            "name": m.name, "model": m.name, "size": int(m.size), "digest": c.digest_hex(m),
            "details": c.details_of(m.installed) if m.installed is not None else {},
            "expires_at": c.rfc3339(m.expires_at_wall), "size_vram": int(m.size_vram),
            "context_length": int(m.info.n_ctx),
        })
    return {"models": out}


def progress_line(p: Any) -> dict[str, Any]:
    """The store's PullProgress → Ollama's ``{status, digest?, total?, completed?}``."""
    if isinstance(p, dict):
        d = dict(p)
    else:
        d = {k: getattr(p, k) for k in ("status", "digest", "total", "completed") if getattr(p, k, None) is not None}
        if "completed" not in d and getattr(p, "done", None) is not None:
            d["completed"] = p.done
    out: dict[str, Any] = {"status": str(d.get("status") or "pulling")}
    digest = d.get("digest")
    if digest:
        out["digest"] = str(digest) if str(digest).startswith("sha256:") else f"sha256:{digest}"
        if out["status"] in ("downloading", "pulling"):
            out["status"] = f"pulling {str(digest).removeprefix('sha256:')[:12]}"
    total = d.get("total")
    if isinstance(total, int) and total > 0:  # Ollama omits them on phases without a byte count
        out["total"] = total
        if isinstance(d.get("completed"), int):
            out["completed"] = d["completed"]
    return out


@router.post("/api/pull")
async def pull(body: PullBody, request: Request) -> Response:
    name = c.check_name(body.model or body.name)
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
            yield (json.dumps({"status": "pulling manifest"}) + "\n").encode()
            while True:
                kind, value = await queue.get()
                if kind == "progress":
                    line = progress_line(value)
                    if line["status"] == "pulling manifest" and not seen_manifest:
                        seen_manifest = True
                        continue
                    yield (json.dumps(line) + "\n").encode()
                elif kind == "done":
                    yield (json.dumps({"status": "success"}) + "\n").encode()
                    return
                else:
                    _, message = c.status_of(value)
                    yield (json.dumps({"error": message}) + "\n").encode()
                    return
        finally:
            if not finished.is_set():
                cancel.set()
            finished.set()

    return StreamingResponse(lines(), media_type=NDJSON)


@router.delete("/api/delete")
async def delete(body: ModelBody, request: Request) -> Response:
    name = c.check_name(body.model or body.name)
    store = _store(request)
    model = await c.run_sync(store.get, name)  # 404 first
    await c.run_sync(_engine(request).unload, name)
    await c.run_sync(_engine(request).unload, model.name)
    await c.run_sync(store.remove, name)
    return Response(status_code=200)


@router.post("/api/copy")
async def copy(body: CopyBody, request: Request) -> Response:
    source = c.check_name(body.source, "source")
    destination = c.check_name(body.destination, "destination")
    await c.run_sync(_store(request).copy, source, destination)
    return Response(status_code=200)


@router.head("/api/blobs/{digest:path}")
async def blob_exists(digest: str, request: Request) -> Response:
    d = c.check_digest(digest)
    store = _store(request)
    blob_path = getattr(store, "blob_path", None)
    if blob_path is not None:
        exists = await c.run_sync(lambda: blob_path(d).is_file())
    else:
        from localllm.config import paths

        exists = (paths().blobs / ("sha256-" + d.split(":", 1)[1])).is_file()
    return Response(status_code=200 if exists else 404)
