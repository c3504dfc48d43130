"""Faces attach to a server with --host: list, pull, rm and run talk the Ollama API instead of running
in-process. The CLI here gets an empty LOCALLLM_HOME, so anything it shows came from the server."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from localllm.cli import cli

MODEL = "smollm2:135m"


@pytest.fixture
def empty_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LOCALLLM_HOST", raising=False)
    return tmp_path / "home"


def test_list_with_host_shows_the_servers_models(url, empty_home):
    runner = CliRunner()
    local = runner.invoke(cli, ["list"])
    assert local.exit_code == 0 and MODEL not in local.output  # nothing installed in-process
    out = runner.invoke(cli, ["list", "--host", url])
    assert out.exit_code == 0, out.output
    assert out.output.splitlines()[0].split() == ["NAME", "ID", "SIZE", "MODIFIED"]
    assert any(line.startswith(MODEL) and "b179c9523d0e" in line for line in out.output.splitlines())


def test_run_with_host_answers_from_the_server(url, empty_home):
    from localllm.client import Client

    out = CliRunner().invoke(cli, ["run", MODEL, "--host", url, "--seed", "1", "--temperature", "0",
                                   "--num-predict", "8", "Say hello."])
    assert out.exit_code == 0, out.output
    assert out.output.strip()
    with Client(url) as client:
        assert client.is_loaded(MODEL)  # the server did the work
    assert not (empty_home / "data" / "models" / "blobs").exists()  # nothing pulled in-process


def test_pull_and_rm_with_host(url, empty_home):
    from localllm.client import Client

    runner = CliRunner()
    out = runner.invoke(cli, ["pull", MODEL, "--host", url, "--quiet"])  # already there: a no-op pull
    assert out.exit_code == 0 and "success" in out.output, out.output
    with Client(url) as client:
        client.copy(MODEL, "attach-copy:latest")
        assert any(m.name == "attach-copy:latest" for m in client.list())
        out = runner.invoke(cli, ["rm", "attach-copy:latest", "--host", url])
        assert out.exit_code == 0, out.output
        assert not any(m.name == "attach-copy:latest" for m in client.list())
        assert any(m.name == MODEL for m in client.list())  # the shared file still serves the original


def test_host_with_no_server_is_one_sentence(empty_home):
    out = CliRunner().invoke(cli, ["list", "--host", "127.0.0.1:1"])
    assert out.exit_code == 1
    assert "No server is answering" in out.output and len(out.output.strip().splitlines()) == 1


def test_too_small_context_is_a_400_not_a_crash(url):
    import httpx

    r = httpx.post(f"{url}/api/chat", json={"model": MODEL, "stream": False, "options": {"num_ctx": 16},
                                             "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert r.status_code == 400
    assert r.json() == {"error": "num_ctx must be at least 256 tokens, got 16."}
