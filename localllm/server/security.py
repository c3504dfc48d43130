"""Security middleware (pure ASGI, so streaming and disconnects pass through untouched).

In order, for every HTTP request:

1. **Host check** (DNS rebinding, CVE-2024-28224): the ``Host`` header must name this machine — an IP
   literal that is loopback, private, unspecified or the bound address; ``localhost`` / ``*.localhost``;
   this machine's hostname; or the bound host. Anything else is a 403 with an empty body. A page on
   ``evil.example`` that rebinds its name to 127.0.0.1 sends ``Host: evil.example`` and is refused.
2. **Cross-site requests** (a web page on another site): a request whose ``Origin`` is not allowed, or a POST /
   DELETE / PUT marked ``Sec-Fetch-Site: cross-site`` without an allowed ``Origin``, is a 403 in the API's own error
   shape, before it runs: CORS alone only hides the answer from the page, the request would still copy, delete,
   pull or generate. Allowed: the page's own origin (the ``Host`` it was served from, as the web UI at ``/ui/``),
   Ollama's defaults (``http(s)://`` localhost, 127.0.0.1, [::1], 0.0.0.0 on any port; ``app://``, ``file://``,
   ``tauri://``, ``vscode-webview://``, ``vscode-file://``) and ``LOCALLLM_ORIGINS`` (comma separated; ``*``
   wildcards allowed, ``*`` alone allows all). Clients that are not browsers send no ``Origin`` and are unchanged.
   **CORS** (Starlette's ``CORSMiddleware``, added by the app) answers the allowed origins' preflights.
3. **Bearer token**: with ``LOCALLLM_API_KEY`` set, every endpoint but ``/`` and the web page's files (``/ui/``)
   needs ``Authorization: Bearer <key>`` or ``x-api-key: <key>`` (Anthropic's SDKs and Claude Code send
   that), compared in constant time; CORS preflights pass.
4. **JSON bodies**: a POST/DELETE body from a client that is not a browser (no ``Origin``) is read as JSON
   whatever its ``Content-Type`` (as Ollama; ``curl -d`` sends a form type). A page's request (it has an
   ``Origin``) must say ``application/json`` (or ``multipart/form-data`` for a transcription): a 415 otherwise, so
   that a "simple" cross-site request (``text/plain``, a form), which needs no CORS preflight, never runs.
5. **Body limit**: ``LOCALLLM_MAX_BODY`` bytes (default 32 MiB), by ``Content-Length`` and while
   reading a chunked body: 413. Not for ``POST /api/blobs/:digest`` (a model file, streamed to disk and
   sha256-checked by its route).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import re
import socket
from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]

DEFAULT_MAX_BODY = 32 * 1024 * 1024
LOOPBACK_ORIGIN_RE = (r"(https?://(localhost|127\.0\.0\.1|\[::1\]|0\.0\.0\.0)(:\d+)?)"
                      r"|((app|file|tauri|vscode-webview|vscode-file)://.*)")


def split_host(host_header: str) -> str:
    """``"[::1]:8080"`` → ``"::1"``, ``"Localhost:11434"`` → ``"localhost"``."""
    h = host_header.strip().lower()
    if h.startswith("["):
        return h[1:h.index("]")] if "]" in h else h
    if h.count(":") == 1:
        return h.split(":", 1)[0]
    return h


def host_allowed(host_header: str, bound_host: str) -> bool:
    """Does ``Host`` name this machine?

    >>> host_allowed("localhost:11434", "127.0.0.1"), host_allowed("127.0.0.1", "127.0.0.1")
    (True, True)
    >>> host_allowed("evil.example:11434", "127.0.0.1"), host_allowed("[::1]:11434", "127.0.0.1")
    (False, True)
    """
    h = split_host(host_header)
    bound = split_host(bound_host) if bound_host else ""
    if not h:
        return False
    if h == bound or h == "localhost" or h.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        pass
    else:
        return ip.is_loopback or ip.is_private or ip.is_unspecified or ip.is_link_local
    try:
        name = socket.gethostname().lower()
    except OSError:
        name = ""
    return bool(name) and (h == name or h == name.split(".")[0])


def origin_regex(extra: str | None) -> str:
    """One regex for the allowed origins: Ollama's defaults plus ``LOCALLLM_ORIGINS`` (globs with ``*``).

    >>> import re
    >>> allowed = re.compile(origin_regex("https://app.example,https://*.corp.example"))
    >>> [bool(allowed.fullmatch(o)) for o in ("http://localhost:3000", "http://0.0.0.0:8080", "tauri://localhost",
    ...                                        "https://app.example", "https://a.corp.example", "null",
    ...                                        "https://evil.example", "http://localhost.evil.example")]
    [True, True, True, True, True, False, False, False]
    """
    parts = [LOOPBACK_ORIGIN_RE]
    for item in (extra or "").split(","):
        item = item.strip().rstrip("/")
        if not item:
            continue
        if item == "*":
            return ".*"
        parts.append("(" + ".*".join(re.escape(p) for p in item.split("*")) + ")")
    return "^(" + "|".join(parts) + ")$"


def same_origin(origin: str, host_header: str) -> bool:
    """Is ``origin`` the page's own server, the one the request's ``Host`` names (a page this server served)?

    >>> same_origin("http://127.0.0.1:11434", "127.0.0.1:11434"), same_origin("http://evil.example", "127.0.0.1")
    (True, False)
    """
    for scheme in ("http://", "https://"):
        if origin.lower().startswith(scheme):
            return bool(host_header) and origin[len(scheme):].lower() == host_header.strip().lower()
    return False


class SecurityMiddleware:
    """Host check, cross-site refusal, bearer token and body limit (see the module docstring)."""

    def __init__(self, app: ASGIApp, *, bound_host: str, api_key: str | None, max_body: int,
                 check_host: bool = True, origins: str | None = None):
        self.app = app
        self.bound_host = bound_host
        self.api_key = api_key or None
        self.max_body = max_body
        self.check_host = check_host
        self.allowed_origin = re.compile(origin_regex(origins))

    def cross_site(self, headers: dict[str, str], method: str) -> bool:
        """Does this request come from a web page whose origin is not allowed?"""
        origin = headers.get("origin")
        if origin is not None:
            host = headers.get("host", "")  # same origin only for a Host that names this machine (no rebinding)
            own = same_origin(origin, host) and host_allowed(host, self.bound_host)
            return not (own or self.allowed_origin.fullmatch(origin))
        # no Origin: a client that is not a browser, or a browser's navigation (a GET); a state-changing request a
        # browser marks as another site's without an Origin is refused all the same
        return method not in ("GET", "HEAD", "OPTIONS") and headers.get("sec-fetch-site", "") == "cross-site"

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        if self.check_host and "host" in headers and not host_allowed(headers["host"], self.bound_host):
            await _send(send, 403, b"", "text/plain")
            return
        method = scope.get("method", "GET")
        if self.cross_site(headers, method):
            await _send_error(send, scope, 403, "this request comes from a web page whose origin is not allowed "
                              "here (add it to LOCALLLM_ORIGINS to allow it)")
            return
        preflight = method == "OPTIONS" and "access-control-request-method" in headers
        if self.api_key and path != "/" and not preflight and not _page_file(path):
            auth = headers.get("authorization", "")
            token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            key = headers.get("x-api-key", "").strip()
            if not (hmac.compare_digest(token.encode(), self.api_key.encode())
                    or hmac.compare_digest(key.encode(), self.api_key.encode())):
                await _send_error(send, scope, 401, "unauthorized: this server needs an Authorization: Bearer <key> "
                                  "(or x-api-key: <key>) header with the key in LOCALLLM_API_KEY")
                return
        length = headers.get("content-length")
        if method == "POST" and path.startswith("/api/blobs/"):
            # a model file for /api/create: streamed to disk by the route (sha256-checked, under the models dir
            # only), so neither the body limit nor the buffering of a chunked body applies
            await self.app(scope, receive, send)
            return
        if length is not None:
            try:
                too_big = int(length) > self.max_body
            except ValueError:
                await _send_error(send, scope, 400, "invalid Content-Length header")
                return
            if too_big:
                await _send_error(send, scope, 413, f"request body too large (limit {self.max_body} bytes)")
                return
        ctype = headers.get("content-type", "").split(";", 1)[0].strip().lower()  # the media type
        json_type = ctype == "application/json" or ctype.endswith("+json")
        if method in ("POST", "DELETE", "PUT") and not json_type and not ctype.startswith("multipart/"):
            if "origin" in headers and ctype:
                # a page's request: only JSON (a "simple" text/plain or form request needs no preflight)
                await _send_error(send, scope, 415, "a request from a web page must send its body as JSON "
                                  "(Content-Type: application/json)")
                return
            # Ollama reads every body as JSON whatever the Content-Type (``curl -d`` sends a form type); a
            # multipart upload (``/v1/audio/transcriptions``) keeps its own
            scope = dict(scope)
            scope["headers"] = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-type"]
            scope["headers"].append((b"content-type", b"application/json"))
        if method in ("GET", "HEAD", "OPTIONS") or length is not None:
            await self.app(scope, receive, send)
            return
        # chunked body: read it here (up to the limit), then hand it on
        chunks: list[bytes] = []
        received = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # client went away
            body = message.get("body", b"")
            received += len(body)
            if received > self.max_body:
                await _send_error(send, scope, 413, f"request body too large (limit {self.max_body} bytes)")
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _page_file(path: str) -> bool:
    """The web page's own files (``/ui/...``): no data in them, so no token (the page asks for it)."""
    return path == "/ui" or path.startswith("/ui/")


async def _send(send: Any, status: int, body: bytes, content_type: str) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _send_error(send: Any, scope: Scope, status: int, message: str) -> None:
    """A refusal in the shape of the API of the route the request would match."""
    from localllm.server.apis import api_for

    body = api_for(scope).error_body(status, message, None)
    await _send(send, status, json.dumps(body).encode(), "application/json")
