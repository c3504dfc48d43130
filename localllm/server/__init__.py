"""The REST server: Ollama's API (``/api/*``), OpenAI's (``/v1/*``, Responses included) and Anthropic's
Messages (``/v1/messages``) over one :class:`~localllm.engine.Engine`::

    from localllm.server import serve
    serve("127.0.0.1:11434")  # blocks; ``localllm serve`` calls it

Modules:

* ``generation`` -- the one generation path every API's chat/completion handler ends in: name check,
  context, capability checks, the engine call, the first event, streaming or collecting, disconnects;
* translators, each body in and events out with pure functions: ``ollama_routes`` (the native API, and
  model management), ``openai_routes`` (Chat Completions, Completions, Embeddings, Models),
  ``responses_routes`` (the Responses API and its store of earlier responses), ``anthropic_routes``
  (Messages);
* ``apis`` (the table of translators: each API's routes and error shape, :class:`~localllm.server.translator.
  Translator`; which API a request speaks, from the route it matched);
* what the translators share: ``errors`` (request errors, safe messages), ``options`` (options, ``think``,
  logprobs), ``checks`` (names, formats and schemas, tools), ``framing`` (NDJSON and SSE frames, times, tool
  calls), ``modelinfo`` (an installed model as the APIs describe it), ``protocol`` (the engine as the server uses
  it), ``schemas`` (request bodies);
* ``app`` (the FastAPI app), ``security`` (Host check, keys, body limit), ``metrics`` (``/metrics``), ``run``
  (binding and uvicorn).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI

    from localllm.engine import Engine


def create_app(engine: Engine | None = None, **kwargs: Any) -> FastAPI:
    from localllm.server.app import create_app as _create

    return _create(engine, **kwargs)


def serve(*args: Any, **kwargs: Any) -> None:
    from localllm.server.run import serve as _serve

    _serve(*args, **kwargs)
