"""``/api/create``, ``/api/blobs/:digest``, ``/api/push`` and ``/api/show`` of a created model, over real HTTP with
the official ``ollama`` client, on a private store holding the default model."""

from __future__ import annotations

import hashlib

import httpx
import ollama
import pytest

from localllm.modelfile import Modelfile
from tests.support import DEFAULT_MODEL, TEST_HOME, install_copy, private_paths


@pytest.fixture(scope="module")
def srv(installed_default_model, tmp_path_factory):
    from localllm.store import Store
    from tests.server.derived import serve

    pp = private_paths(tmp_path_factory.mktemp("create-home"))
    install_copy(pp.models, TEST_HOME / "data" / "models")
    s = serve(Store(paths=pp))
    yield s
    s.stop()
    s.engine.close()


@pytest.fixture(scope="module")
def client(srv) -> ollama.Client:
    return ollama.Client(host=srv.url)


def test_create_from_a_model_streams_status_and_show_round_trips(srv, client):
    lines = list(client.create(model="pirate", from_=DEFAULT_MODEL, system="You are a pirate.",
                               parameters={"temperature": 0, "stop": ["<|im_end|>", "User:"], "num_ctx": 512},
                               messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Arr."}],
                               license="MIT", stream=True))
    statuses = [p.status for p in lines]
    assert statuses[0] == "gathering model components" and statuses[-1] == "success"
    assert "writing manifest" in statuses
    shown = client.show("pirate")  # the client's ShowResponse has no system/messages fields: read them raw
    raw = httpx.post(f"{srv.url}/api/show", json={"model": "pirate"}).json()
    assert raw["system"] == "You are a pirate."
    assert shown.license == "MIT"
    assert shown.parameters is not None
    assert shown.parameters.splitlines() == [f"{'num_ctx':<30} 512", f"{'stop':<30} \"<|im_end|>\"",
                                             f"{'stop':<30} \"User:\"", f"{'temperature':<30} 0"]
    assert raw["messages"] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Arr."}]
    assert shown.modelfile is not None and f"FROM {DEFAULT_MODEL}" in shown.modelfile
    assert shown.details is not None and shown.details.parent_model == DEFAULT_MODEL
    listed = {m.model: m for m in client.list().models}
    assert listed["pirate"].details is not None and listed["pirate"].details.parent_model == DEFAULT_MODEL
    assert listed["pirate"].digest != listed[DEFAULT_MODEL].digest  # its own, as Ollama's manifest digest
    client.chat(model="pirate", messages=[{"role": "user", "content": "Hi"}], options={"num_predict": 1})
    loaded = {m.model: m for m in client.ps().models}
    assert loaded["pirate"].digest == listed["pirate"].digest


def test_create_with_files_uploads_the_blob_first(srv, client, tmp_path):
    src = srv.engine.store.get(DEFAULT_MODEL).path
    copy = tmp_path / "mine.gguf"
    copy.write_bytes(src.read_bytes())
    digest = client.create_blob(copy)  # a 100 MB POST (past the 32 MiB body limit of other routes): 200, it is there
    assert digest == "sha256:" + hashlib.sha256(copy.read_bytes()).hexdigest()
    done = client.create(model="fromfile", files={"mine.gguf": digest}, system="Hi there.")
    assert done.status == "success"
    shown = client.show("fromfile")
    assert shown.modelfile is not None and "FROM /" in shown.modelfile and "SYSTEM Hi there." in shown.modelfile
    r = client.chat(model="fromfile", messages=[{"role": "user", "content": "Hello"}],
                    options={"temperature": 0, "num_predict": 4})
    assert r.message.content


def test_blob_upload_checks_its_digest_and_stays_in_the_models_dir(srv):
    store = srv.engine.store
    data = b"GGUF" + b"\0" * 60
    good = "sha256:" + hashlib.sha256(data).hexdigest()
    assert httpx.head(f"{srv.url}/api/blobs/{good}").status_code == 404
    wrong = "sha256:" + hashlib.sha256(b"other").hexdigest()
    r = httpx.post(f"{srv.url}/api/blobs/{wrong}", content=data)
    assert r.status_code == 400 and r.json()["error"].startswith("digest mismatch")
    assert not store.blob_path(wrong).exists()
    r = httpx.post(f"{srv.url}/api/blobs/{good}", content=data)
    assert r.status_code == 201 and store.blob_path(good).read_bytes() == data
    assert httpx.head(f"{srv.url}/api/blobs/{good}").status_code == 200
    for bad in ("sha256:..%2F..%2Fescape", "sha256-" + "0" * 63, "md5:" + "0" * 32):
        r = httpx.post(f"{srv.url}/api/blobs/{bad}", content=data)
        assert r.status_code == 400 and "invalid digest" in r.json()["error"], (bad, r.text)
    assert not (store.paths.models.parent / "escape").exists()
    assert not any(store.paths.downloads.glob("*.partial"))
    # a 4-byte "GGUF" upload (CVE-2024-39720) cannot become a model: refused at create, in Ollama's shape
    tiny = b"GGUF"
    d = "sha256:" + hashlib.sha256(tiny).hexdigest()
    assert httpx.post(f"{srv.url}/api/blobs/{d}", content=tiny).status_code == 201
    r = httpx.post(f"{srv.url}/api/create", json={"model": "tiny", "files": {"t.gguf": d}, "stream": False})
    assert r.status_code == 400 and "error" in r.json()
    assert "tiny" not in {m["name"] for m in httpx.get(f"{srv.url}/api/tags").json()["models"]}


def test_bad_create_bodies_and_push(srv, client):
    with pytest.raises(ollama.ResponseError) as e:
        client.create(model="x")
    assert e.value.status_code == 400 and "neither 'from' or 'files'" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.create(model="x", from_=DEFAULT_MODEL, parameters={"temperature": "hot"})
    assert e.value.status_code == 400 and "temperature" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.create(model="x", from_=DEFAULT_MODEL, template="{{ with .System }}{{ . }}{{ end }}")
    assert e.value.status_code == 400 and "Go-template" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.create(model="x", from_="nosuchmodel:1b", stream=False)
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        client.push("pirate")
    assert e.value.status_code == 400 and "not supported" in e.value.error


def test_the_created_models_settings_apply_over_the_api(srv, client):
    """Ollama's layering on the server: the model's system prompt and history reach the prompt (more prompt
    tokens than the base model), its temperature 0 gives the same answer twice, and a request's options win."""
    client.create(model="hist", from_=DEFAULT_MODEL, system="You are a pirate.",
                  parameters={"temperature": 0, "num_predict": 6},
                  messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Arr."}])
    ask = [{"role": "user", "content": "Who are you?"}]
    base = client.chat(model=DEFAULT_MODEL, messages=ask, options={"temperature": 0, "num_predict": 6})
    a = client.chat(model="hist", messages=ask)
    b = client.chat(model="hist", messages=ask)
    assert a.message.content == b.message.content and a.eval_count <= 6
    assert a.prompt_eval_count > base.prompt_eval_count
    by_hand = client.chat(model=DEFAULT_MODEL, messages=[
        {"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Arr."}, *ask], options={"temperature": 0, "num_predict": 6})
    assert by_hand.message.content == a.message.content and by_hand.prompt_eval_count == a.prompt_eval_count
    short = client.chat(model="hist", messages=ask, options={"num_predict": 2})
    assert short.eval_count <= 2


def test_a_models_temperature_holds_over_openai_unless_the_request_sends_one(srv, client):
    """``PARAMETER temperature 0``: an OpenAI request without ``temperature`` stays greedy (OpenAI's default 1.0
    does not override the model's), Anthropic's too; a request that sends a value (OpenAI's 1.0, or 0.8, the
    engine's default, through Ollama's options) gets it: the same text as the base model at that temperature with
    the same seed, which is not the greedy text."""
    import anthropic
    import openai

    client.create(model="cold", from_=DEFAULT_MODEL, parameters={"temperature": 0})
    oa = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    an = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "Write one unusual word."}]

    def openai_text(model: str, **kw) -> str:
        r = oa.chat.completions.create(model=model, messages=ask, max_tokens=12, **kw)
        return r.choices[0].message.content or ""

    def ollama_text(model: str, **options) -> str:
        return client.chat(model=model, messages=ask, options={"num_predict": 12, **options}).message.content or ""

    greedy = ollama_text(DEFAULT_MODEL, temperature=0)
    assert openai_text("cold") == openai_text("cold", seed=7) == greedy
    r = an.messages.create(model="cold", max_tokens=12, messages=ask)
    assert r.content[0].text == greedy
    hot = openai_text("cold", temperature=1.0, seed=7)
    assert hot == openai_text(DEFAULT_MODEL, temperature=1.0, seed=7) != greedy
    warm = ollama_text("cold", temperature=0.8, seed=7)
    assert warm == ollama_text(DEFAULT_MODEL, temperature=0.8, seed=7) != greedy


def test_create_with_quantize_streams_byte_progress(srv, client, monkeypatch):
    """``/api/create`` with ``quantize``: the quantizing phase streams ``total`` (llama.cpp's planned size of the
    file, which is the result's size) and a climbing ``completed``, as ``/api/pull`` streams a download."""
    import backends.llamacpp.quantize

    monkeypatch.setattr(backends.llamacpp.quantize, "POLL_SECONDS", 0.01)
    srv.engine.store.create("smol-f32", Modelfile(from_=DEFAULT_MODEL), quantize="f32", requantize=True)
    lines = list(client.create(model="smol-q8", from_="smol-f32", quantize="q8_0", stream=True))
    phase = [(p.completed, p.total) for p in lines if p.status == "quantizing F32 model to Q8_0"]
    size = srv.engine.store.get("smol-q8").size
    assert phase and all(total == size for _, total in phase) and phase[-1] == (size, size)
    assert any(0 < (done or 0) < size for done, _ in phase)
    assert lines[-1].status == "success"


def test_create_host_uploads_the_projector_and_the_api_takes_only_a_digest(srv, client, tmp_path, test_projector):
    """``localllm create --host`` with a ``PROJECTOR`` line uploads the file to /api/blobs and sends its digest: the
    server's model says vision. ``projector`` as a server path is refused (400, one sentence), whether or not the
    file exists; a blob that is no projector is a 400 too."""
    import subprocess
    import sys

    mfile = tmp_path / "Modelfile"
    mfile.write_text(f"FROM {DEFAULT_MODEL}\nPROJECTOR {test_projector}\n")
    r = subprocess.run([sys.executable, "-m", "localllm", "create", "seeing", "-f", str(mfile), "--host", srv.url],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "vision" in (client.show("seeing").capabilities or [])
    for path in (str(test_projector), "/etc/hostname"):
        resp = httpx.post(f"{srv.url}/api/create", json={"model": "x", "from": DEFAULT_MODEL, "projector": path})
        assert resp.status_code == 400 and "never a file path" in resp.json()["error"], resp.text
    weights = srv.engine.store.get(DEFAULT_MODEL).weights_digest
    resp = httpx.post(f"{srv.url}/api/create", json={"model": "x", "from": DEFAULT_MODEL, "projector": weights,
                                                     "stream": False})
    assert resp.status_code == 400 and "is not a vision or audio projector" in resp.json()["error"], resp.text
    assert not [m.model for m in client.list().models if m.model.split(":")[0] == "x"]
