"""The REST server: Ollama's API (``/api/*``), OpenAI's (``/v1/*``, Responses included) and Anthropic's
Messages (``/v1/messages``) over one :class:`~localllm.engine.Engine`.

    >>> from localllm.server import create_app, serve
    >>> serve("127.0.0.1:11434")  # doctest: +SKIP  (blocks; ``localllm serve`` calls it)

Modules:

* ``generation`` -- the one generation path every API's chat/completion handler ends in: name check,
  context, capability checks, the engine call, the first event, streaming or collecting, disconnects;
* translators, each body in and events out with pure functions: ``ollama_routes`` (the native API, and
  model management), ``openai_routes`` (Chat Completions, Completions, Embeddings, Models),
  ``responses_routes`` (the Responses API and its store of earlier responses), ``anthropic_routes``
  (Messages);
* ``common`` (what the translators share: errors and their shape per API, options, checks, frames),
  ``schemas`` (request bodies), ``app`` (the FastAPI app), ``security`` (Host check, keys, body limit),
  ``metrics`` (``/metrics``), ``run`` (binding and uvicorn).
"""

from __future__ import annotations

from typing import Any


def create_app(*args: Any, **kwargs: Any) -> Any:
    from localllm.server.app import create_app as _create

    return _create(*args, **kwargs)


def serve(*args: Any, **kwargs: Any) -> None:
    from localllm.server.run import serve as _serve

    _serve(*args, **kwargs)
