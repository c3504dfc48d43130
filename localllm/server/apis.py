"""The table of APIs the server speaks (:data:`APIS`): a new API is its module (a :class:`~localllm.server.
translator.Translator`: routes and error shape) and one line here. :func:`install` builds the app's routes from
the table; :func:`api_for` says which API a request speaks, from the route it matched (the one that registered
it), so that every error leaves in the shape of that API."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.routing import Match, Route

from localllm.server import (
    anthropic_routes,
    ollama_routes,
    openai_routes,
    rerank_routes,
    responses_routes,
    transcriptions,
)
from localllm.server.translator import Translator

APIS: tuple[Translator, ...] = (
    ollama_routes.API,  # /api/*: {"error": "..."}
    openai_routes.API,  # /v1/*: {"error": {"message", "type", "param", "code"}}
    responses_routes.API,  # /v1/responses: OpenAI's shape
    anthropic_routes.API,  # /v1/messages: {"type": "error", "error": {"type", "message"}}
    transcriptions.API,  # /v1/audio/transcriptions (multipart): OpenAI's shape
    rerank_routes.API,  # /v1/rerank, /v1/reranking, /rerank, /reranking: OpenAI's shape (llama-server's paths)
    rerank_routes.OLLAMA_API,  # /api/rerank: Ollama's shape
)


def install(app: FastAPI) -> None:
    """Every API's routes on ``app``."""
    for api in APIS:
        app.include_router(api.router)


_BY_ENDPOINT: dict[Callable[..., Any], Translator] = {
    route.endpoint: api for api in APIS for route in api.router.routes if isinstance(route, Route)}


def api_for(scope: MutableMapping[str, Any]) -> Translator:
    """The API of a request: the one that registered the route it matched (``scope["route"]``, set by the
    router), else the route it would match (before routing: the security middleware's refusals; a wrong method
    counts), else, for a path that no route knows, the API under whose prefix it is (the longest)."""
    endpoint = getattr(scope.get("route"), "endpoint", None)
    if endpoint is not None and endpoint in _BY_ENDPOINT:
        return _BY_ENDPOINT[endpoint]
    partial = None
    for api in APIS:
        for route in api.router.routes:
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return api
            if match == Match.PARTIAL and partial is None:
                partial = api  # the path is the route's, the method is not (a 405)
    if partial is not None:
        return partial
    path = scope.get("path", "")
    return max((api for api in APIS if api.owns(path)), key=lambda api: len(api.prefix))


def error_response(scope: MutableMapping[str, Any], status: int, message: str,
                   param: str | None = None) -> JSONResponse:
    """An error in the shape of the request's API."""
    return JSONResponse(api_for(scope).error_body(status, message, param), status_code=status)
