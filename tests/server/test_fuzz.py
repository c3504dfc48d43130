"""A bounded property-based run (schemathesis) over the server's own OpenAPI spec: whatever the
generated request, the answer is never a 5xx and the server keeps answering.

Twice: against an empty store (names, bodies and validation: model routes stop at 404), and against a
store holding the default model, with the generated requests aimed at it (its name put in ``model``,
answers capped at a few tokens) so generation, embeddings and show run for real, and widened with what reaches
llama.cpp: the load options (``num_ctx``, ``num_batch``, ``num_thread``, ``num_gpu``), ``keep_alive``, and images
and audio clips (valid, cut short, forged headers, random bytes) in every API's form.

Each server is ``localllm serve`` in a process of its own (:class:`tests.support_serve.ServeProcess`): a request
that crashes it (an abort inside llama.cpp) fails the test naming that request and quoting the server's last words,
instead of killing the pytest worker."""

from __future__ import annotations

import base64
import time
from collections import Counter, defaultdict
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.server.conftest import MODEL
from tests.support_serve import ServeProcess


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    """A server over an empty, private store: generated names never touch the real test models."""
    home = tmp_path_factory.mktemp("fuzz-home")
    (home / "data" / "models" / "manifests").mkdir(parents=True)
    with ServeProcess(home, keep_alive="0") as srv:
        yield srv


def call(case: Any, srv: ServeProcess, timeout: float) -> Any:
    """``case.call``; a server that died on it (or dropped the connection) fails naming the request."""
    try:
        response = case.call(timeout=timeout)
    except Exception as e:  # noqa: BLE001 - requests' ConnectionError and kin: the server's fault or death
        time.sleep(0.5)
        raise AssertionError(f"{case.method} {case.path} {case.body!r:.500}: no answer ({type(e).__name__}); the "
                             f"server {'is still running' if srv.alive() else 'died'}: {srv.last_words()}") from None
    assert srv.alive(), f"{case.method} {case.path} {case.body!r:.500}: the server died: {srv.last_words()}"
    return response


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_no_server_errors(case, fuzz_server):
    response = call(case, fuzz_server, 30)
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


AUDIO_MODEL = "fuzz-audio:latest"  # the default model's weights with the made audio projector (MODEL: the vision one)


@pytest.fixture(scope="module")
def model_fuzz_server(tmp_path_factory, installed_default_model, test_projector, audio_projector):
    """A server over a private store that holds the default model (manifest copied, blob hard-linked) with the made
    vision projector, and a copy of it with the made audio projector: images and clips reach mtmd's decoders."""
    from localllm.store import Store
    from tests.support import TEST_HOME, install_copy, private_paths

    home = tmp_path_factory.mktemp("fuzz-model-home")
    pp = private_paths(home)
    install_copy(pp.models, TEST_HOME / "data" / "models")
    store = Store(paths=pp)
    store.copy(MODEL, AUDIO_MODEL)
    store.set_projector(MODEL, test_projector)
    store.set_projector(AUDIO_MODEL, audio_projector)
    with ServeProcess(home, keep_alive="300") as srv:
        assert sorted(m["name"] for m in srv.call("GET", "/api/tags").json()["models"]) == [AUDIO_MODEL, MODEL]
        yield srv


def _media() -> dict[str, tuple[str, bytes]]:
    """What a client may send as an image or a clip: kind ("image" / "audio") and bytes, valid and not."""
    from tests.support_audio import forged_wav, wav
    from tests.support_vision import png

    good_png, good_wav = png(16, 16), wav(0.5)
    return {
        "png": ("image", good_png), "png-cut": ("image", good_png[:60]),
        "jpeg-header": ("image", b"\xff\xd8\xff\xe0" + b"\0" * 40),
        "random": ("image", bytes(range(256)) * 3), "empty": ("image", b""),
        "wav": ("audio", good_wav), "wav-cut": ("audio", good_wav[:300]),
        "wav-forged-byte-rate": ("audio", forged_wav(8, 0xFFFFFFF0, 6000)),  # 750 s: refused
        "wav-2-hz": ("audio", forged_wav(2, 4, 60)),  # 30 s at 2 Hz: resampled to 16 kHz by mtmd
        "mp3-junk": ("audio", b"ID3\x04\0\0\0\0\0\0" + b"\xff\xfb" + b"\x90" * 100),
        "flac-junk": ("audio", b"fLaC" + b"\0" * 60),
    }


# what reaches llama.cpp beyond a body's own fields, each drawn rarely (None: left as generated), so that most
# requests keep the loaded model and the run stays short
def _rare(*values: Any) -> st.SearchStrategy[Any]:
    return st.sampled_from([None] * (2 * len(values)) + list(values))


EXTRA = st.fixed_dictionaries({
    "num_ctx": _rare(1, 2, 100, 257, 300, 511, 1000, 1023, 2049, 8192),
    "num_batch": _rare(1, 7, 257, 100_000),
    "num_thread": _rare(0, 1, 3, -1, 1025),  # never 1024: accepted, and a machine of 2 cores crawls
    "num_gpu": _rare(0, 1, 999, -1),
    "keep_alive": _rare(0, "0", -1, "5m", "bogus", 3.5),
    "media": _rare("png", "png-cut", "jpeg-header", "random", "empty", "wav", "wav-cut", "wav-forged-byte-rate",
                   "wav-2-hz", "mp3-junk", "flac-junk"),
})


def widen(case: Any, extra: dict[str, Any], media: dict[str, tuple[str, bytes]]) -> None:
    """Put ``extra``'s load options and keep_alive into an Ollama body, and its image or clip into a request that
    can carry one (Ollama's ``images``, OpenAI chat's ``image_url`` / ``input_audio`` parts); a clip goes to the
    model with the audio projector."""
    body = case.body
    if case.path not in MODEL_ROUTES or not isinstance(body, dict):
        return
    extra = {k: v for k, v in extra.items() if v is not None}
    if case.path.startswith("/api/"):
        opts = body.get("options") if isinstance(body.get("options"), dict) else {}
        opts.update({k: v for k, v in extra.items() if k.startswith("num_")})
        body["options"] = opts
        if "keep_alive" in extra:
            body["keep_alive"] = extra["keep_alive"]
    if "media" not in extra:
        return
    kind, data = media[extra["media"]]
    b64 = base64.b64encode(data).decode()
    if kind == "audio":
        body["model"] = AUDIO_MODEL
    if case.path == "/api/generate":
        body["images"] = [b64]
    elif case.path == "/api/chat" and isinstance(body.get("messages"), list):
        body["messages"].append({"role": "user", "content": "What is this?", "images": [b64]})
    elif case.path == "/v1/chat/completions" and isinstance(body.get("messages"), list):
        part = ({"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}} if kind == "audio" else
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64}})
        body["messages"].append({"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]})


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
    """Every operation of the spec, generated bodies aimed at the installed model and widened with load options,
    keep_alive and media (:data:`EXTRA`): no 5xx, the server alive after each, and the model routes did run (each
    answered 200 at least once)."""
    schema = schemathesis.openapi.from_url(model_fuzz_server.url + "/openapi.json")
    statuses: dict[str, Counter[int]] = defaultdict(Counter)
    errors: list[str] = []
    media = _media()
    t0 = time.monotonic()
    for result in schema.get_all_operations():
        operation = result.ok()
        # bodies with many nested parts are mostly invalid when generated at random (rightly 400s): more
        # examples there, so that valid ones reach the model too (~1 in 5 is valid: 0.8^60 ≈ 1e-6 of none)
        examples = 60 if operation.path in ("/v1/chat/completions", "/v1/completions", "/v1/responses",
                                            "/v1/messages") else 20

        @given(case=operation.as_strategy(), extra=EXTRA)
        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                  phases=[Phase.explicit, Phase.generate])  # no shrinking: each step is a real request
        def run(case: Any, extra: dict[str, Any]) -> None:
            aim_at_the_model(case)
            widen(case, extra, media)
            response = call(case, model_fuzz_server, 120)
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
