"""``localllm.client`` (what the faces use with ``--host``) and ``localllm ps/stop/serve`` against a real
server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from localllm.api import Done, GenerateRequest, Sampling, TextChunk
from localllm.cli import cli
from localllm.client import Client, connect
from localllm.errors import LocalLLMError, ModelNotFoundError
from localllm.loader import LoadOptions
from tests.server.conftest import MODEL

FAST = Sampling(temperature=0, max_tokens=6, seed=1)


@pytest.fixture(scope="module")
def client(url):
    with Client(url) as c:
        yield c


def test_generate_yields_the_engine_event_types(client, server):
    req = GenerateRequest(messages=[{"role": "user", "content": "Say hi"}], sampling=FAST)
    events = list(client.generate(MODEL, req, LoadOptions(num_ctx=2048), keep_alive=60))
    assert isinstance(events[-1], Done) and all(isinstance(e, TextChunk) for e in events[:-1])
    assert events[-1].stats.eval_count <= 6 and events[-1].stats.eval_duration > 0
    remote = "".join(e.text for e in events[:-1])
    local = "".join(e.text for e in server.engine.generate(MODEL, req, LoadOptions(num_ctx=2048))
                    if isinstance(e, TextChunk))
    assert remote == local  # the same engine, through HTTP or not
    raw = list(client.generate(MODEL, GenerateRequest(prompt="1, 2, 3,", sampling=FAST)))
    assert raw[-1].finish_reason in ("stop", "length")


def test_store_operations(client):
    assert MODEL in [m.name for m in client.list()]
    shown = client.show(MODEL)
    assert (shown.architecture, shown.short_id, shown.context_length) == ("llama", "b179c9523d0e", 8192)
    assert shown.capabilities[0] == "completion" and "thinking" not in shown.capabilities
    seen = []
    assert client.pull(MODEL, progress=seen.append).name == MODEL
    assert seen[-1].status == "success"
    client.copy(MODEL, "client-copy:x")
    assert "client-copy:x" in [m.name for m in client.list()]
    with pytest.raises(LocalLLMError, match=r"^client-copy:x exists already; remove it first, or copy with --force"):
        client.copy(MODEL, "client-copy:x")  # the server's /api/copy would replace it: the client asks first
    assert client.copy(MODEL, "client-copy:x", force=True) == "client-copy:x"
    client.remove("client-copy:x")
    with pytest.raises(ModelNotFoundError):
        client.show("client-copy:x")
    assert len(client.embed(MODEL, ["a"])[0]) == 576


def test_ps_load_and_unload(client):
    client.load(MODEL, keep_alive=240)
    (m,) = [m for m in client.ps() if m.name == MODEL]
    assert m.processor == "100% CPU" and m.context_length > 0
    assert m.until.endswith("minutes from now") and m.short_id == "b179c9523d0e"
    assert client.unload(MODEL) is True
    assert not client.is_loaded(MODEL)


def test_connect(url, monkeypatch):
    monkeypatch.delenv("LOCALLLM_HOST", raising=False)
    assert connect(None) is None  # in-process
    monkeypatch.setenv("LOCALLLM_HOST", url)
    c = connect(None)
    assert c is not None and c.url == url
    monkeypatch.setenv("LOCALLLM_HOST", "127.0.0.1:1")  # nothing answers: in-process
    assert connect(None) is None
    assert connect(url).url == url
    with pytest.raises(LocalLLMError, match="No server is answering"):
        connect("127.0.0.1:1")


def test_cli_ps_and_stop(url, client, monkeypatch):
    monkeypatch.delenv("LOCALLLM_HOST", raising=False)
    runner = CliRunner()
    client.load(MODEL, keep_alive=300)
    out = runner.invoke(cli, ["ps", "--host", url])
    assert out.exit_code == 0, out.output
    header, row = out.output.splitlines()[:2]
    assert header.split() == ["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "SLOTS", "PROMPT", "CACHE", "UNTIL"]
    assert row.startswith(MODEL) and "100% CPU" in row and "minutes from now" in row
    assert re.search(r"\s0/[1-9]\d*\s", row), row  # idle slots: busy/total from the server's /api/ps
    assert [m.batched for m in client.ps()] == [True] and "taking turns" not in row  # llama.cpp batches
    out = runner.invoke(cli, ["stop", MODEL, "--host", url])
    assert out.exit_code == 0, out.output
    assert not client.is_loaded(MODEL)
    out = runner.invoke(cli, ["stop", MODEL, "--host", url])
    assert out.exit_code == 1 and "not running" in out.output
    monkeypatch.setenv("LOCALLLM_HOST", url)  # attaches through the environment too
    assert runner.invoke(cli, ["ps"]).output.startswith("NAME")
    client.load(MODEL, keep_alive=300)  # the catalog alias finds the model loaded under its full name
    out = runner.invoke(cli, ["stop", "smollm2"])
    assert out.exit_code == 0, out.output
    assert not client.is_loaded(MODEL)


def test_serve_busy_port_and_exposure_warning(url):
    from localllm.server.run import exposure_warning

    port = url.rsplit(":", 1)[1]
    env = {**os.environ, "LOCALLLM_HOST": f"127.0.0.1:{port}"}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "localllm", "serve"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and time.monotonic() - t0 < 30
    (line,) = r.stderr.strip().splitlines()
    assert f"Port {port} on 127.0.0.1 is already in use" in line and "LOCALLLM_HOST=127.0.0.1:" in line
    assert exposure_warning("127.0.0.1", None) is None
    loud = exposure_warning("0.0.0.0", None)
    assert "WARNING" in loud and "LOCALLLM_API_KEY" in loud
