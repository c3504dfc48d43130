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
    # KIND follows when the shared test home also holds an embedding model (another module may have pulled one)
    assert out.output.splitlines()[0].split() in (["NAME", "ID", "SIZE", "MODIFIED"],
                                                  ["NAME", "ID", "SIZE", "MODIFIED", "KIND"])
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


def test_run_with_host_says_the_server_does_not_take_its_draft(url, empty_home):
    out = CliRunner().invoke(cli, ["run", MODEL, "--host", url, "--draft", "ngram", "--temperature", "0",
                                   "--num-predict", "4", "Say hello."])
    assert out.exit_code == 0, out.output
    assert "Note: --draft is not sent to the server" in out.output


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


# ------------------------------------------------------------------------------------------ thinking over --host

THINKER = "smollm2-think:135m"


@pytest.fixture(scope="module")
def think_url(default_model_path, tmp_path_factory):
    """A server whose one model thinks: the default GGUF with Qwen3's template and the thinking grammar."""
    from tests.fixtures_thinking import THINK_GBNF, write_thinking_model
    from tests.server.derived import grammar_backend, install_derived, serve

    store = install_derived(write_thinking_model(default_model_path), THINKER, tmp_path_factory.mktemp("think"))
    srv = serve(store, grammar_backend(THINK_GBNF))
    yield srv.url
    srv.stop()
    srv.engine.close()


def test_run_with_host_prints_the_servers_reasoning(think_url, empty_home):
    from localllm.cli.answer import THINKING_CLOSE, THINKING_OPEN

    out = CliRunner().invoke(cli, ["run", THINKER, "--host", think_url, "--think", "--verbose", "--temperature", "0",
                                   "--seed", "1", "What is two plus two?"])
    assert out.exit_code == 0, out.output
    assert out.stdout.startswith(THINKING_OPEN) and THINKING_CLOSE in out.stdout and "think>" not in out.stdout
    thought, answer = out.stdout[len(THINKING_OPEN):].split(THINKING_CLOSE)
    assert thought.strip() and answer.strip().endswith(".")
    assert "thinking tokens:" in out.stderr  # counted from the stream's thinking lines


@pytest.mark.asyncio
async def test_async_stream_from_a_server_carries_thinking_apart(think_url):
    from localllm.api import Done, GenerateRequest, Sampling, TextChunk
    from localllm.client import Client

    req = GenerateRequest(messages=[{"role": "user", "content": "What is two plus two?"}], think=True,
                          sampling=Sampling(temperature=0, seed=1))
    with Client(think_url) as client:
        events = [e async for e in client.agenerate(THINKER, req)]
        sync = list(client.generate(THINKER, req))
    kinds = ["thinking" if e.thinking else "content" for e in events if isinstance(e, TextChunk)]
    assert kinds[0] == "thinking" and kinds[-1] == "content" and kinds == sorted(kinds, key=lambda k: k == "content")
    assert isinstance(events[-1], Done) and events[-1].stats.thinking_tokens == kinds.count("thinking")
    text = lambda evs, t: "".join(e.text for e in evs if isinstance(e, TextChunk) and e.thinking == t)  # noqa: E731
    assert (text(events, True), text(events, False)) == (text(sync, True), text(sync, False))  # one decoder
