"""Server fixtures: a real server (uvicorn in a thread, a random free port) over a real engine and the
real default model in the test home."""

from __future__ import annotations

import pytest

MODEL = "smollm2:135m"
FAST = {"temperature": 0, "num_predict": 6, "seed": 1}


def start(engine=None, **app_kwargs):
    """A started ServerThread on a free port; defaults: no API key, no extra origins."""
    from localllm.engine import Engine
    from localllm.server.app import create_app
    from localllm.server.run import ServerThread

    engine = engine or Engine(keep_alive=300)
    app_kwargs.setdefault("api_key", "")
    app_kwargs.setdefault("origins", "")
    app = create_app(engine, bound_host="127.0.0.1", **app_kwargs)
    return ServerThread(app).start()


@pytest.fixture(scope="session")
def server(installed_default_model):
    srv = start()
    yield srv
    srv.stop()
    srv.engine.close()


@pytest.fixture(scope="session")
def url(server) -> str:
    return server.url


@pytest.fixture(scope="module")
def tool_server(default_model_path, tmp_path_factory):
    """A server over a private store holding the default model with Qwen2.5's tool-capable chat template
    (``tests.server.test_tool_choice.TOOL_MODEL``), one per module."""
    from tests.server.derived import install_derived, serve, tool_model
    from tests.server.test_tool_choice import TOOL_MODEL

    gguf, wheel = tool_model(default_model_path)
    srv = serve(install_derived(gguf, TOOL_MODEL, tmp_path_factory.mktemp("tool-server-home"), **wheel))
    yield srv
    srv.stop()
    srv.engine.close()
