"""The web page (``/ui/``) and the public API it uses beyond Ollama's: the conversations of the terminal app
(``/api/chats``, the same SQLite store, :mod:`localllm.chats`) and the catalog with this machine's fit verdicts
(``/api/catalog``).

The page is plain files under ``localllm/webui/`` (hand-written ES modules and CSS, no build step), served with a
strict Content-Security-Policy: scripts, styles, images and connections from this origin only, no frames, no
plugins; nothing remote, so it works offline. The files need no token (they hold no data): the page asks for the
bearer token when the API answers 401 and keeps it for the tab.

Routes (errors in Ollama's shape, ``{"error": "..."}``)::

    GET    /api/catalog                       the catalog: name, family, size, capabilities, moe, fit, installed
    GET    /api/chats?q=TEXT                  conversations, most recent first (q: title or a message holds TEXT)
    POST   /api/chats                         {"title"?, "model"?, "system"?, "params"?} -> the conversation
    GET    /api/chats/{id}                    the conversation with every message of every branch and its head
    POST   /api/chats/{id}                    {"title"?, "model"?, "system"?, "params"?, "head"?} -> changed
    DELETE /api/chats/{id}
    POST   /api/chats/{id}/messages           {"role", "content", "thinking"?, "stats"?, "parent"?, "images"?}
    DELETE /api/chats/{id}/messages/{mid}
    GET    /api/chats/{id}/export?format=json|markdown
    GET    /api/chats/images/{sha256}         an attached image's bytes

A request that carries an ``Origin`` header other than the server's own or an allowed one
(``LOCALLLM_ORIGINS``) is refused with 403 on these routes (a cross-site form cannot write to the store).
"""

from __future__ import annotations

import gzip
import re
from dataclasses import asdict
from importlib import resources
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from localllm.server.errors import APIError
from localllm.server.protocol import engine_of, run_sync

if TYPE_CHECKING:
    from localllm.chats import ChatStore, Conversation, Message

router = APIRouter()
ID_MAX = 2**63 - 1  # SQLite's largest row id

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
       "media-src 'self' data: blob:; connect-src 'self'; font-src 'self'; manifest-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
PAGE_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY",
                "Referrer-Policy": "no-referrer", "Cross-Origin-Resource-Policy": "same-origin",
                "Cross-Origin-Opener-Policy": "same-origin", "Cache-Control": "no-cache"}
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".txt": "text/plain; charset=utf-8",
         ".png": "image/png"}
_FILES: dict[str, tuple[bytes, bytes]] = {}  # name -> (bytes, gzipped), read once


def _asset(name: str) -> tuple[bytes, bytes] | None:
    if name not in _FILES:
        if not re.fullmatch(r"[a-z0-9_-]+(\.[a-z0-9]+)+", name):
            return None
        try:
            data = resources.files("localllm").joinpath("webui", name).read_bytes()
        except (OSError, ValueError):
            return None
        _FILES[name] = (data, gzip.compress(data, 9, mtime=0))
    return _FILES[name]


def wants_page(request: Request) -> bool:
    """A browser navigating (``Accept: text/html``), not a client checking that the server runs."""
    return "text/html" in request.headers.get("accept", "")


@router.api_route("/ui", methods=["GET", "HEAD"], include_in_schema=False)
async def ui_root() -> Response:
    return RedirectResponse("/ui/", status_code=302)


@router.api_route("/ui/", methods=["GET", "HEAD"], include_in_schema=False)
@router.api_route("/ui/{name}", methods=["GET", "HEAD"], include_in_schema=False)
async def ui_file(request: Request, name: str = "index.html") -> Response:
    found = _asset(name)
    ext = "." + name.rsplit(".", 1)[-1]
    if found is None or ext not in TYPES:
        return PlainTextResponse("404 page not found", status_code=404, headers=PAGE_HEADERS)
    data, packed = found
    headers = dict(PAGE_HEADERS, Vary="Accept-Encoding")
    if "gzip" in request.headers.get("accept-encoding", ""):
        headers["Content-Encoding"] = "gzip"
        data = packed
    return Response(data, media_type=TYPES[ext], headers=headers)


# ------------------------------------------------------------------------------------------ origin check


def _check_origin(request: Request) -> None:
    """403 for a request from another site's page (its ``Origin`` is neither this server nor an allowed one)."""
    origin = request.headers.get("origin")
    if origin is None:
        return
    host = request.headers.get("host", "")
    if origin in (f"http://{host}", f"https://{host}"):
        return
    allowed = getattr(request.app.state, "origin_regex", None)
    if allowed and re.fullmatch(allowed, origin):
        return
    raise APIError(403, f"requests from {origin[:100]} are not allowed (set LOCALLLM_ORIGINS to allow a site)")


# ------------------------------------------------------------------------------------------ catalog


@router.get("/api/catalog")
async def catalog(request: Request) -> dict[str, Any]:
    """The catalog with this machine's fit verdicts, as ``localllm list --catalog --json`` prints it."""
    from localllm.local import LocalAdvisor

    items = await run_sync(LocalAdvisor(engine_of(request)).catalog)  # type: ignore[arg-type]
    return {"models": [{
        "name": c.name, "family": c.family, "params": c.params, "size": c.size, "capabilities": c.capabilities,
        "think_levels": c.think_levels, "moe": c.moe or None, "installed": c.installed, "draft": c.draft,
        "fit": {"verdict": c.fit.verdict, "text": c.fit.text, "estimated": c.fit.estimated},
        "description": c.description} for c in items]}


# ------------------------------------------------------------------------------------------ conversations


def chats_of(request: Request) -> ChatStore:
    """The app's chat store (``paths().chats_db``, the terminal app's), opened on first use."""
    state = request.app.state
    store = getattr(state, "chats", None)
    if store is None:
        from localllm.chats import ChatStore

        store = state.chats = ChatStore()
    return store  # type: ignore[no-any-return]


class ConversationBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    title: str | None = None
    model: str | None = None
    system: str | None = None
    params: dict[str, Any] | None = None
    head: int | None = Field(None, ge=1, le=ID_MAX)


class ImageBody(BaseModel):
    name: str = "image"
    data: str  # base64


class MessageBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str
    content: str = ""
    thinking: str | None = None
    stats: dict[str, Any] | None = None
    parent: int | None = Field(-1, ge=-1, le=ID_MAX)  # -1: after the head; null: a first message (a new branch)
    images: list[ImageBody] | None = None


def conv_json(c: Conversation) -> dict[str, Any]:
    return {"id": c.id, "title": c.title, "model": c.model, "system": c.system, "params": c.params,
            "created_at": c.created_at, "updated_at": c.updated_at, "head": c.head_id}


def msg_json(m: Message) -> dict[str, Any]:
    return {"id": m.id, "parent": m.parent_id, "role": m.role, "content": m.content, "thinking": m.thinking,
            "stats": m.stats, "created_at": m.created_at, "images": [asdict(i) for i in m.images]}


def _conversation(store: ChatStore, cid: int) -> Conversation:
    from localllm.errors import LocalLLMError

    try:
        return store.get(cid)
    except LocalLLMError as e:
        raise APIError(404, str(e)) from None


@router.get("/api/chats")
async def list_chats(request: Request, q: str = "") -> dict[str, Any]:
    store = chats_of(request)
    return {"chats": [conv_json(c) for c in await run_sync(store.conversations, q)]}


@router.post("/api/chats")
async def create_chat(body: ConversationBody, request: Request) -> dict[str, Any]:
    _check_origin(request)
    from localllm.chats import DEFAULT_TITLE

    store = chats_of(request)
    conv = await run_sync(store.create, " ".join((body.title or "").split())[:200] or DEFAULT_TITLE, body.model,
                          body.system or "", body.params)
    return conv_json(conv)


@router.get("/api/chats/images/{sha}")
async def chat_image(sha: str, request: Request) -> Response:
    if not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise APIError(400, "an image is named by its sha256 (64 hex digits)")
    path = chats_of(request).images_dir / sha
    try:
        data = await run_sync(path.read_bytes)
    except OSError:
        raise APIError(404, f"there is no image {sha}") from None
    from localllm.images import image_size

    fmt = (image_size(data) or ("",))[0].lower()
    media = {"png": "image/png", "jpeg": "image/jpeg", "gif": "image/gif", "webp": "image/webp",
             "bmp": "image/bmp"}.get(fmt, "application/octet-stream")
    return Response(data, media_type=media, headers={"X-Content-Type-Options": "nosniff",
                                                      "Content-Security-Policy": "default-src 'none'"})


@router.get("/api/chats/{cid}")
async def get_chat(request: Request, cid: int = Path(ge=1, le=ID_MAX)) -> dict[str, Any]:
    store = chats_of(request)
    conv = await run_sync(_conversation, store, cid)
    return {**conv_json(conv), "messages": [msg_json(m) for m in await run_sync(store.all_messages, cid)]}


@router.post("/api/chats/{cid}")
async def update_chat(body: ConversationBody, request: Request, cid: int = Path(ge=1, le=ID_MAX)) -> dict[str, Any]:
    _check_origin(request)
    from localllm.errors import LocalLLMError

    store = chats_of(request)

    def change() -> Conversation:
        _conversation(store, cid)
        try:
            if body.title is not None:
                store.rename(cid, body.title)
            if body.head is not None:
                store.set_head(cid, body.head)
        except LocalLLMError as e:
            raise APIError(400, str(e)) from None
        return store.update(cid, model=body.model, system=body.system, params=body.params)

    return conv_json(await run_sync(change))


@router.delete("/api/chats/{cid}")
async def delete_chat(request: Request, cid: int = Path(ge=1, le=ID_MAX)) -> Response:
    _check_origin(request)
    store = chats_of(request)
    await run_sync(_conversation, store, cid)
    await run_sync(store.delete, cid)
    return Response(status_code=200)


@router.post("/api/chats/{cid}/messages")
async def add_message(body: MessageBody, request: Request, cid: int = Path(ge=1, le=ID_MAX)) -> dict[str, Any]:
    _check_origin(request)
    if body.role not in ("system", "user", "assistant"):
        raise APIError(400, f"role must be system, user or assistant, not {body.role[:40]!r}")
    from localllm.errors import LocalLLMError
    from localllm.server.images import from_base64

    store = chats_of(request)

    def add() -> Message:
        _conversation(store, cid)
        refs = [store.save_image(from_base64(i.data, "images"), i.name[:200]) for i in body.images or []]
        try:
            return store.add_message(cid, body.role, body.content, stats=body.stats, thinking=body.thinking,
                                     images=refs, parent_id="head" if body.parent == -1 else body.parent)
        except LocalLLMError as e:
            raise APIError(400, str(e)) from None

    return msg_json(await run_sync(add))


@router.delete("/api/chats/{cid}/messages/{mid}")
async def delete_message(request: Request, cid: int = Path(ge=1, le=ID_MAX),
                         mid: int = Path(ge=1, le=ID_MAX)) -> Response:
    _check_origin(request)
    store = chats_of(request)
    if not any(m.id == mid for m in await run_sync(store.all_messages, cid)):
        raise APIError(404, f"there is no message {mid} in conversation {cid}")
    await run_sync(store.delete_message, mid)
    return Response(status_code=200)


@router.get("/api/chats/{cid}/export")
async def export_chat(request: Request, cid: int = Path(ge=1, le=ID_MAX), format: str = Query("json")) -> Response:
    store = chats_of(request)
    conv = await run_sync(_conversation, store, cid)
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", conv.title).strip("-")[:60] or f"chat-{cid}"
    if format in ("md", "markdown"):
        text = await run_sync(store.export_markdown, cid)
        return PlainTextResponse(text, media_type="text/markdown; charset=utf-8",
                                 headers={"Content-Disposition": f'attachment; filename="{safe}.md"'})
    if format != "json":
        raise APIError(400, "format must be json or markdown")
    data = {**conv_json(conv), "messages": [msg_json(m) for m in await run_sync(store.messages, cid)],
            "branches": [msg_json(m) for m in await run_sync(store.all_messages, cid)]}
    return JSONResponse(data, headers={"Content-Disposition": f'attachment; filename="{safe}.json"'})
