"""``localllm serve`` configured only through its environment, as a user starts it, met over real HTTP.

One server process, started with ``LOCALLLM_HOST``, ``API_KEY``, ``ORIGINS``, ``CONTEXT_LENGTH``,
``MAX_QUEUE``, ``NUM_PARALLEL``, ``MAX_BODY``, ``MAX_LOADED_MODELS``, ``KV_CACHE_TYPE``,
``PROMPT_CACHE_SIZE`` and ``KEEP_ALIVE`` set, and no flag but the subcommand; each test checks what one
variable changes for a client (the official ``ollama`` and ``openai`` clients where they apply). A bad
value is one sentence and a non-zero exit.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from tests.support import DEFAULT_MODEL, TEST_HOME, install_copy

KEY = "s3cret-token"
AUTH = {"Authorization": f"Bearer {KEY}"}
ENV = {
    "LOCALLLM_API_KEY": KEY,
    "LOCALLLM_ORIGINS": "https://app.example",
    "LOCALLLM_CONTEXT_LENGTH": "1024",
    "LOCALLLM_MAX_QUEUE": "1",
    "LOCALLLM_NUM_PARALLEL": "1",
    "LOCALLLM_MAX_BODY": "8192",
    "LOCALLLM_MAX_LOADED_MODELS": "1",
    "LOCALLLM_KV_CACHE_TYPE": "q8_0",
    "LOCALLLM_PROMPT_CACHE_SIZE": "0",
    "LOCALLLM_KEEP_ALIVE": "1h",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALLLM_") or k == "LOCALLLM_TEST_CACHE"}
    env.update(LOCALLLM_HOME=str(home), PYTHONUNBUFFERED="1", **extra)
    return env


@pytest.fixture(scope="module")
def served(tmp_path_factory, installed_default_model):
    """(url, home) of ``localllm serve`` in a private home holding the default model."""
    home = tmp_path_factory.mktemp("serve-env")
    install_copy(home / "data" / "models", TEST_HOME / "data" / "models")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    p = subprocess.Popen([sys.executable, "-m", "localllm", "serve"], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env=_env(home, LOCALLLM_HOST=f"127.0.0.1:{port}", **ENV))
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(url + "/", timeout=2)
                break
            except httpx.HTTPError:
                assert p.poll() is None, p.communicate()[1]
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.1)
        yield url, home
    finally:
        p.terminate()
        try:
            _, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        assert "Traceback" not in err, err[-3000:]


def _generate(url: str, prompt: str = "Say hello.", n: int = 4, **extra) -> httpx.Response:
    return httpx.post(url + "/api/generate", headers=AUTH, timeout=600, json={
        "model": DEFAULT_MODEL, "prompt": prompt, "stream": False,
        "options": {"num_predict": n, "temperature": 0}, **extra})


def test_api_key_is_required_and_the_clients_pass_it(served):
    import ollama
    import openai

    url, _ = served
    r = httpx.get(url + "/api/tags", timeout=10)
    assert r.status_code == 401 and "error" in r.json()
    r = httpx.get(url + "/v1/models", timeout=10, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["message"]
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=url).list()
    assert e.value.status_code == 401
    names = [m.model for m in ollama.Client(host=url, headers=AUTH).list().models]
    assert DEFAULT_MODEL in names
    oa = openai.OpenAI(base_url=url + "/v1", api_key=KEY)
    assert DEFAULT_MODEL in [m.id for m in oa.models.list()]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope").models.list()
    assert httpx.get(url + "/", timeout=10).status_code == 200  # the root stays open (health checks)


def test_origins_extend_the_cors_allowlist(served):
    url, _ = served
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    ok = httpx.options(url + "/api/chat", timeout=10, headers={"Origin": "https://app.example", **pre})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
    bad = httpx.options(url + "/api/chat", timeout=10, headers={"Origin": "https://evil.example", **pre})
    assert bad.headers.get("access-control-allow-origin") != "https://evil.example"
    assert bad.status_code >= 400


def test_context_length_and_keep_alive_show_in_ps(served):
    url, _ = served
    r = _generate(url)
    assert r.status_code == 200, r.text
    assert r.json()["response"].strip()
    (m,) = httpx.get(url + "/api/ps", headers=AUTH, timeout=10).json()["models"]
    assert m["context_length"] == 1024
    assert m["slots"] == 1
    expires = datetime.fromisoformat(m["expires_at"].replace("Z", "+00:00"))
    left = expires - datetime.now(UTC)
    assert timedelta(minutes=50) < left <= timedelta(hours=1, minutes=1), left


def test_max_body_refuses_a_larger_request(served):
    url, _ = served
    big = json.dumps({"model": DEFAULT_MODEL, "prompt": "x" * 20000, "stream": False})
    r = httpx.post(url + "/api/generate", headers={**AUTH, "Content-Type": "application/json"}, content=big,
                   timeout=60)
    assert r.status_code == 413 and "error" in r.json()


def test_a_full_queue_answers_503(served):
    """One slot (NUM_PARALLEL=1) and MAX_QUEUE=1: a stream runs, one request waits, the next gets 503."""
    url, _ = served
    assert _generate(url).status_code == 200  # loaded
    first_token = threading.Event()
    results: dict[str, int] = {}

    def stream() -> None:
        with httpx.stream("POST", url + "/api/generate", headers=AUTH, timeout=600, json={
                "model": DEFAULT_MODEL, "prompt": "Count to one thousand.", "stream": True,
                "options": {"num_predict": 400, "temperature": 0, "stop": []}}) as r:
            results["a"] = r.status_code
            for _ in r.iter_lines():
                first_token.set()

    def waiting() -> None:
        results["b"] = _generate(url, n=2).status_code

    a = threading.Thread(target=stream)
    a.start()
    assert first_token.wait(120)
    b = threading.Thread(target=waiting)
    b.start()
    deadline = time.monotonic() + 60
    while httpx.get(url + "/api/ps", headers=AUTH, timeout=10).json()["models"][0].get("queued", 0) < 1:
        assert time.monotonic() < deadline and a.is_alive(), "the second request never queued"
        time.sleep(0.02)
    r = _generate(url, n=2)
    assert r.status_code == 503 and "error" in r.json()
    a.join(600)
    b.join(600)
    assert results == {"a": 200, "b": 200}


def test_prompt_cache_size_zero_saves_nothing(served):
    url, home = served
    long_prompt = " ".join(f"word{i}" for i in range(180))  # ~700 tokens: over the 512-token save threshold
    r = _generate(url, prompt=long_prompt, n=2)
    assert r.status_code == 200, r.text
    time.sleep(1)  # a save would run in the background after the answer
    saved = [p for p in home.rglob("*") if "prompt-cache" in p.parts and p.is_file()]
    assert saved == []


def test_max_loaded_models_keeps_one(served):
    url, _ = served
    assert httpx.post(url + "/api/copy", headers=AUTH, timeout=60,
                      json={"source": DEFAULT_MODEL, "destination": "second:latest"}).status_code == 200
    assert _generate(url).status_code == 200
    r = httpx.post(url + "/api/generate", headers=AUTH, timeout=600, json={
        "model": "second:latest", "prompt": "Hi", "stream": False, "options": {"num_predict": 2}})
    assert r.status_code == 200, r.text
    names = [m["name"] for m in httpx.get(url + "/api/ps", headers=AUTH, timeout=10).json()["models"]]
    assert names == ["second:latest"]


@pytest.mark.parametrize("var,value,word", [
    ("LOCALLLM_KV_CACHE_TYPE", "q3_x", "LOCALLLM_KV_CACHE_TYPE"),
    ("LOCALLLM_PROMPT_CACHE_SIZE", "lots", "LOCALLLM_PROMPT_CACHE_SIZE"),
    ("LOCALLLM_KEEP_ALIVE", "forever", "keep_alive"),
    ("LOCALLLM_MAX_QUEUE", "many", "LOCALLLM_MAX_QUEUE"),
    ("LOCALLLM_NUM_PARALLEL", "-2", "LOCALLLM_NUM_PARALLEL"),
    ("LOCALLLM_HOST", "127.0.0.1:notaport", "HOST:PORT"),
])
def test_a_bad_value_is_one_sentence_and_a_non_zero_exit(tmp_path, var, value, word):
    """Refused at start, before anything binds (a server that started would answer at the free port)."""
    env = _env(tmp_path, LOCALLLM_HOST=f"127.0.0.1:{_free_port()}")
    env[var] = value
    r = subprocess.run([sys.executable, "-m", "localllm", "serve"], stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and word in lines[0], r.stderr
