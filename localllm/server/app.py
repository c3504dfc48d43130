"""The FastAPI app: Ollama's ``/api/*``, OpenAI's ``/v1/*`` (Chat Completions, Completions, Responses,
Embeddings, Models) and Anthropic's ``/v1/messages`` on one engine, behind the security middleware (see
:mod:`localllm.server.security`)::

    from localllm.server.app import create_app
    app = create_app()  # an Engine on the default store

The routes come from the table of APIs (:data:`localllm.server.apis.APIS`); every error leaves in the shape of
the API whose route the request matched: ``{"error": "..."}`` for Ollama's, ``{"error": {"message", "type",
"param", "code"}}`` for OpenAI's, ``{"type": "error", "error": {"type", "message"}}`` for Anthropic's; never a
traceback or a filesystem path.
"""

from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from localllm.server import apis
from localllm.server.errors import APIError, scrub, status_of
from localllm.server.security import DEFAULT_MAX_BODY, SecurityMiddleware, origin_regex

if TYPE_CHECKING:
    from localllm.engine import Engine

log = logging.getLogger("localllm.server")


def error_response(request: Request, status: int, message: str, param: str | None = None) -> JSONResponse:
    """An error in the shape of the API whose route ``request`` matched."""
    return apis.error_response(request.scope, status, message, param)


def validation_message(exc: RequestValidationError) -> str:
    """Pydantic's errors → one sentence, as Ollama's decoder would say it."""
    errors = exc.errors()
    if not errors:
        return "invalid request"
    first = errors[0]
    kind = first.get("type", "")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if kind == "json_invalid":
        return f"invalid JSON in the request body: {first.get('ctx', {}).get('error', 'syntax error')}"
    if kind == "missing" and not loc:
        return "missing request body"
    if kind == "model_attributes_type" and not loc:
        return "the request body must be a JSON object"
    field = ".".join(loc) or "body"
    if kind == "missing":
        return f"{field} is required"
    msg = str(first.get("msg", "invalid value"))
    return scrub(f"invalid value for {field}: {msg}")


def create_app(engine: Engine | None = None, *, bound_host: str | None = None, api_key: str | None = None,
               origins: str | None = None, max_body: int | None = None, check_host: bool = True,
               context_length: int | None = None, max_upload: int | None = None,
               upload_timeout: float | None = None) -> FastAPI:
    """The app. Settings default to the environment: ``LOCALLLM_HOST`` (the bound host the Host check
    allows), ``LOCALLLM_API_KEY``, ``LOCALLLM_ORIGINS``, ``LOCALLLM_MAX_BODY``, ``LOCALLLM_CONTEXT_LENGTH``
    (the context of requests that do not set ``num_ctx``; 0 = the planner's), ``LOCALLLM_MAX_UPLOAD`` (the
    largest blob ``POST /api/blobs`` takes) and ``LOCALLLM_UPLOAD_TIMEOUT`` (seconds an upload's body may stall)."""
    from localllm import config
    from localllm.server.responses_routes import ResponseStore

    if engine is None:
        from localllm.engine import Engine

        engine = Engine()
    bound_host = bound_host if bound_host is not None else config.host().rsplit(":", 1)[0]
    api_key = api_key if api_key is not None else (os.environ.get("LOCALLLM_API_KEY") or None)
    origins = origins if origins is not None else os.environ.get("LOCALLLM_ORIGINS", "")
    max_body = max_body if max_body is not None else config.env_int("LOCALLLM_MAX_BODY", DEFAULT_MAX_BODY)
    max_upload = max_upload if max_upload is not None else config.max_upload()
    upload_timeout = upload_timeout if upload_timeout is not None else config.upload_timeout()

    app = FastAPI(title="localllm", version="0.1.0", docs_url=None, redoc_url=None,
                  description="Ollama-, OpenAI- and Anthropic-compatible API of localllm.")
    app.state.engine = engine
    app.state.max_upload = max_upload  # POST /api/blobs: the largest model file the store takes
    app.state.upload_timeout = upload_timeout  # and how long its body may stall
    app.state.responses = ResponseStore()  # /v1/responses' previous_response_id, for the server's life
    app.state.context_length = context_length if context_length is not None else (
        config.env_int("LOCALLLM_CONTEXT_LENGTH", 0) or None)  # num_ctx for requests that set none
    apis.install(app)
    from localllm.server import webui

    app.include_router(webui.router)  # the page (/ui/) and its routes beyond Ollama's (/api/chats, /api/catalog)
    app.state.origin_regex = origin_regex(origins)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request, exc.status, scrub(exc.message), exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request, 400, validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = scrub(exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail))
        if exc.status_code == 404 and message == "Not Found":  # the path the client asked for, as it wrote it
            message = "404 page not found: " + " ".join(request.url.path[:100].split())
        if exc.status_code == 400 and "parsing the body" in message:
            message = "invalid JSON in the request body"
        return error_response(request, exc.status_code, message)

    from localllm.server.generation import ClientGone

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> JSONResponse:
        return error_response(request, 499, "request canceled")

    async def _known(request: Request, exc: Exception) -> JSONResponse:
        status, message = status_of(exc)
        return error_response(request, status, message)

    from localllm.api import BackendError
    from localllm.errors import LocalLLMError

    app.add_exception_handler(LocalLLMError, _known)
    app.add_exception_handler(BackendError, _known)
    app.add_exception_handler(Exception, _known)  # a bug: logged, answered with "internal server error"

    from fastapi.responses import Response

    from localllm.server.metrics import CONTENT_TYPE, Metrics, RequestCounter

    metrics = Metrics(engine)
    app.state.metrics = metrics

    @app.get("/metrics", include_in_schema=False)
    async def _metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    app.add_middleware(RequestCounter, metrics=metrics)  # innermost: sees the route the router picked
    app.add_middleware(
        CORSMiddleware,
        allow_origin_regex=origin_regex(origins),
        allow_methods=["GET", "POST", "DELETE", "HEAD", "OPTIONS"],
        allow_headers=["Authorization", "Content-Type", "User-Agent", "Accept", "X-Requested-With",
                       "OpenAI-Beta", "x-api-key", "anthropic-version", "anthropic-beta",
                       "anthropic-dangerous-direct-browser-access",
                       "x-stainless-arch", "x-stainless-lang", "x-stainless-os",
                       "x-stainless-package-version", "x-stainless-retry-count", "x-stainless-runtime",
                       "x-stainless-runtime-version", "x-stainless-async", "x-stainless-helper-method",
                       "x-stainless-poll-helper", "x-stainless-custom-poll-interval", "x-stainless-timeout"],
    )
    app.add_middleware(SecurityMiddleware, bound_host=bound_host, api_key=api_key, max_body=max_body,
                       check_host=check_host, origins=origins)
    return app
