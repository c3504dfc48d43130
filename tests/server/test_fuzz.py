"""A bounded property-based run (schemathesis) over the server's own OpenAPI spec: whatever the
generated request, the answer is never a 5xx and the server keeps answering.

Twice: against an empty store (names, bodies and validation: model routes stop at 404), and against a
store holding the default model, with the generated requests aimed at it (its name put in ``model``,
answers capped at a few tokens) so generation, embeddings and show run for real."""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from tests.server.conftest import MODEL, start


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


# ------------------------------------------------------------------------------------------ with the model

# routes whose body (or path) names a model to run or describe: aimed at the installed one
MODEL_ROUTES = {"/api/generate", "/api/chat", "/api/embed", "/api/embeddings", "/api/show",
                "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models/{model}",
                "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"}
MAX_TOKENS = 4  # what any generated request may generate at most: the run stays short


@pytest.fixture(scope="module")
def model_fuzz_server(tmp_path_factory, installed_default_model):
    """A server over a private store that holds the default model (manifest copied, blob hard-linked)."""
    from localllm.engine import Engine
    from localllm.store import Store
    from tests.support import in_test_home, install_copy, private_paths

    own = private_paths(tmp_path_factory.mktemp("fuzz-model-home"))
    install_copy(own.models, in_test_home(lambda store: store.paths.models))
    store = Store(paths=own)
    assert [m.name for m in store.list()] == [MODEL]
    srv = start(Engine(store=store, keep_alive=300))
    yield srv
    srv.stop()
    srv.engine.close()


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def aim_at_the_model(case: Any) -> None:
    """Put the installed model's name where a model is named, and bound what may be generated: every
    request that could generate gets at most ``MAX_TOKENS`` (an explicit ``null`` or a negative count,
    "until the context is full", included); values that are invalid stay as generated (they must be 400s)."""
    if case.path == "/v1/models/{model}":
        case.path_parameters["model"] = MODEL
    body = case.body
    if case.path not in MODEL_ROUTES or not isinstance(body, dict):
        return
    body["model"] = MODEL
    if case.path.startswith("/api/"):
        if not isinstance(body.get("options"), dict):
            body["options"] = {}
        n = body["options"].get("num_predict")
        if n is None or (_number(n) and (n < 0 or n > MAX_TOKENS)):
            body["options"]["num_predict"] = MAX_TOKENS
    else:
        n = body.get("max_tokens")
        if n is None or (_number(n) and n > MAX_TOKENS):
            body["max_tokens"] = MAX_TOKENS
        n = body.get("max_completion_tokens")
        if _number(n) and n > MAX_TOKENS:
            body["max_completion_tokens"] = MAX_TOKENS
        n = body.get("max_output_tokens")  # the Responses API's name
        if n is None or (_number(n) and n > MAX_TOKENS):
            body["max_output_tokens"] = MAX_TOKENS


def test_no_server_errors_with_the_model_installed(model_fuzz_server):
    """Every operation of the spec, generated bodies aimed at the installed model: no 5xx, and the model
    routes did run (each answered 200 at least once)."""
    schema = schemathesis.openapi.from_url(model_fuzz_server.url + "/openapi.json")
    statuses: dict[str, Counter[int]] = defaultdict(Counter)
    errors: list[str] = []
    t0 = time.monotonic()
    for result in schema.get_all_operations():
        operation = result.ok()
        # bodies with many nested parts are mostly invalid when generated at random (rightly 400s): more
        # examples there, so that valid ones reach the model too (~1 in 5 is valid: 0.8^60 ≈ 1e-6 of none)
        examples = 60 if operation.path in ("/v1/chat/completions", "/v1/completions", "/v1/responses",
                                            "/v1/messages") else 20

        @given(case=operation.as_strategy())
        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                  phases=[Phase.explicit, Phase.generate])  # no shrinking: each step is a real request
        def run(case: Any) -> None:
            aim_at_the_model(case)
            response = case.call(timeout=120)
            statuses[f"{case.method} {case.path}"][response.status_code] += 1
            if response.status_code >= 500:
                errors.append(f"{case.method} {case.path} {case.body!r:.300} -> {response.status_code}: "
                              f"{response.text[:300]}")
            assert response.status_code < 500, errors[-1]

        run()
    elapsed = time.monotonic() - t0
    assert errors == []
    for route in ("POST /api/generate", "POST /api/chat", "POST /api/embed", "POST /api/embeddings",
                  "POST /api/show", "POST /v1/chat/completions", "POST /v1/completions", "POST /v1/embeddings",
                  "GET /v1/models/{model}"):
        assert statuses[route][200] > 0, (route, dict(statuses[route]))  # reached the model, not a 404
    assert httpx.get(model_fuzz_server.url + "/").status_code == 200
    print(f"fuzzed {sum(sum(c.values()) for c in statuses.values())} requests in {elapsed:.0f} s")
