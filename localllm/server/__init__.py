"""The REST server: Ollama's API (``/api/*``) and OpenAI's (``/v1/*``) over one :class:`~localllm.engine.Engine`.

    >>> from localllm.server import create_app, serve
    >>> serve("127.0.0.1:11434")  # doctest: +SKIP  (blocks; ``localllm serve`` calls it)

Modules: ``app`` (the FastAPI app, error shapes), ``ollama_routes``, ``openai_routes``, ``schemas``
(request bodies), ``security`` (Host check, bearer token, body limit, CORS), ``common`` (shared
translation), ``run`` (binding and uvicorn).
"""

from __future__ import annotations

from typing import Any


def create_app(*args: Any, **kwargs: Any) -> Any:
    from localllm.server.app import create_app as _create

    return _create(*args, **kwargs)


def serve(*args: Any, **kwargs: Any) -> None:
    from localllm.server.run import serve as _serve

    _serve(*args, **kwargs)
