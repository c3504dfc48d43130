"""The table of APIs the server speaks (:data:`APIS`): a new API is its module (a :class:`~localllm.server.
translator.Translator`: routes and error shape) and one line here. :func:`install` builds the app's routes from
the table and remembers which API each route came from; :func:`api_for` answers that for a request, from the route
it matched, so that every error leaves in the shape of the API the client speaks."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.routing import BaseRoute, Match

from localllm.server import anthropic_routes, ollama_routes, openai_routes, responses_routes
from localllm.server.translator import Translator

APIS: tuple[Translator, ...] = (
    ollama_routes.API,  # /api/*: {"error": "..."}
    openai_routes.API,  # /v1/*: {"error": {"message", "type", "param", "code"}}
    responses_routes.API,  # /v1/responses: OpenAI's shape
    anthropic_routes.API,  # /v1/messages: {"type": "error", "error": {"type", "message"}}
)


def install(app: FastAPI) -> None:
    """Every API's routes on ``app``, each remembered with its API (``app.state.route_api``)."""
    route_api: dict[BaseRoute, Translator] = {}
    for api in APIS:
        before = len(app.router.routes)
        app.include_router(api.router)
        route_api.update((route, api) for route in app.router.routes[before:])
    app.state.route_api = route_api


def api_for(scope: MutableMapping[str, Any]) -> Translator:
    """The API of a request: the one that registered the route it matched (``scope["route"]``, set by the
    router), else the route it would match (before routing: the security middleware's refusals), else, for a path
    that no route knows, the API under whose prefix it is (the longest)."""
    app = scope["app"]
    route_api: dict[BaseRoute, Translator] = getattr(app.state, "route_api", {})
    route = scope.get("route")
    if route is None:
        partial = None
        for candidate in app.router.routes:
            match, _ = candidate.matches(scope)
            if match == Match.FULL:
                route = candidate
                break
            if match == Match.PARTIAL and partial is None:
                partial = candidate  # the path matches, the method does not (a 405)
        route = route or partial
    if route in route_api:
        return route_api[route]
    path = scope.get("path", "")
    return max((api for api in APIS if api.owns(path)), key=lambda api: len(api.prefix))


def error_response(scope: MutableMapping[str, Any], status: int, message: str,
                   param: str | None = None) -> JSONResponse:
    """An error in the shape of the request's API."""
    return JSONResponse(api_for(scope).error_body(status, message, param), status_code=status)
