"""A backend registered from the tests alone, through the public registration function, is a backend like the
built-in ones: ``localllm probe`` (text and ``--json``) lists it, ``--backend`` takes it (the choices come from
the registry), the planner plans it and the server serves a request with it over real HTTP.

The test backend is llama.cpp's token source under another name (so it runs the real default model); it counts
its loads, so a test can see that it, and not llama.cpp, served the request.
"""

from __future__ import annotations

import json

import httpx
import pytest

from backends import descriptor
from backends.descriptor import GGUF, Backend
from backends.llamacpp.source import LlamaCppSource

NAME = "testllama"


class TestLlamaSource(LlamaCppSource):
    """llama.cpp's source, registered as ``testllama``."""

    __test__ = False  # not a test class
    name = NAME
    loads = 0

    def __init__(self, spec):
        super().__init__(spec)
        type(self).loads += 1


TEST_BACKEND = Backend(name=NAME, label="Test llama", source=f"{__name__}:TestLlamaSource", weights=GGUF,
                       memory="layers", install="(registered by the tests)", priority=90,
                       schema_rules="backends.llamacpp._schema:schema_problem")


@pytest.fixture
def registered():
    from localllm.hardware import probe

    descriptor.register(TEST_BACKEND)
    probe(refresh=True)
    yield TEST_BACKEND
    descriptor.unregister(NAME)
    probe(refresh=True)


def _cli(*args: str):
    from click.testing import CliRunner

    from localllm.cli import cli

    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_the_built_in_backends_are_described_once():
    from localllm.hardware import probe
    from localllm.planner import BACKENDS, KV_TYPES

    assert list(BACKENDS) == ["auto", "llamacpp", "mlx"]
    assert KV_TYPES == ("f16", "q8_0", "q4_0") == descriptor.get("mlx").kv_cache_types
    hw = probe()
    for b in descriptor.registered():  # the probe's answer is the backend's own check
        assert hw.backends[b.name].available == b.available()[0] == b.source_class().available()[0]
    assert [b.name for b in descriptor.ranked(apple_silicon=True)] == ["mlx", "llamacpp"]


def test_a_registered_backend_shows_up_in_probe_and_plans_with_backend(registered, installed_default_model):
    r = _cli("probe", "--backend", "bogus")
    assert r.exit_code == 2 and f"'{NAME}'" in r.output  # the choices named are the registry's
    r = _cli("probe")
    assert r.exit_code == 0, r.output
    row = next(line for line in r.output.splitlines() if line.strip().startswith("Test llama"))
    assert "yes:" in row
    d = json.loads(_cli("probe", "--json").output)
    assert d["backends"][NAME]["available"] and d["backends"][NAME]["label"] == "Test llama"
    r = _cli("probe", "--backend", NAME)
    assert r.exit_code == 0, r.output
    assert "Test llama on CPU" in r.output and "asked for with --backend testllama" in r.output
    d = json.loads(_cli("probe", "--json", "--backend", NAME).output)
    assert d["plan"]["backend"] == NAME and d["plan_error"] is None
    assert NAME in _cli("serve", "--help").output  # serve's --backend takes it too


def test_auto_never_picks_a_lower_priority_backend(registered, installed_default_model):
    d = json.loads(_cli("probe", "--json").output)
    assert d["plan"]["backend"] == "llamacpp"  # priority 20 before the test backend's 90


def test_a_registered_backend_serves_a_request_over_http(registered, installed_default_model):
    from localllm.engine import Engine
    from tests.server.conftest import FAST, MODEL, start

    engine = Engine(keep_alive=300)
    # the backend for every request, as `serve --backend testllama` sets it (Engine(backend=NAME) once the loader
    # checks the name against the registry instead of its own list)
    engine.loader.backend = NAME
    srv = start(engine)
    try:
        before = TestLlamaSource.loads
        r = httpx.post(f"{srv.url}/api/generate", json={"model": MODEL, "prompt": "Say hi", "stream": False,
                                                         "options": FAST}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["done"] and r.json()["eval_count"] > 0
        assert TestLlamaSource.loads == before + 1
        assert [m.backend for m in engine.ps()] == [NAME]
        bad = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}  # its schema rules apply
        r = httpx.post(f"{srv.url}/api/generate", json={"model": MODEL, "prompt": "x", "stream": False,
                                                         "format": bad}, timeout=60)
        assert r.status_code == 400 and '"not"' in r.json()["error"]
    finally:
        srv.stop()
        engine.close()
