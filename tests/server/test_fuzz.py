"""A bounded property-based run (schemathesis) over the server's own OpenAPI spec: whatever the
generated request, the answer is never a 5xx and the server keeps answering."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tests.server.conftest import start


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    """A server over an empty, private store: generated names never touch the real test models."""
    from localllm.config import Paths
    from localllm.engine import Engine
    from localllm.store import Store

    root = tmp_path_factory.mktemp("fuzz-home")
    paths = Paths(data=root / "data", cache=root / "cache", config=root / "config", models=root / "data" / "models")
    srv = start(Engine(store=Store(paths=paths), keep_alive=0))
    yield srv
    srv.stop()
    srv.engine.close()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_no_server_errors(case, fuzz_server):
    response = case.call(timeout=30)
    assert response.status_code < 500, f"{case.method} {case.path} -> {response.status_code}: {response.text[:300]}"
    json_body = "application/json" in str(response.headers.get("content-type"))
    if response.status_code >= 400 and case.method != "HEAD" and json_body:
        body = response.json()
        assert "error" in body and "Traceback" not in response.text


def test_server_still_answers_after_fuzzing(fuzz_server):
    assert httpx.get(fuzz_server.url + "/").status_code == 200
