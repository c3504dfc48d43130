"""``localllm launch AGENT``: the configuration it passes each agent (``--config``), and the one sentence when the
agent is not installed. (The agents launched for real on a server: tests/server/test_coding_agents.py.)"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

URL = "http://127.0.0.1:18999"


def launch(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "localllm", "launch", *args], capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL, env={**os.environ, **env})


def _exports(out: str) -> tuple[dict[str, str], list[str]]:
    lines = out.strip().splitlines()
    env = {}
    for line in lines[:-1]:
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = shlex.split(value)[0]
    return env, shlex.split(lines[-1])


def test_claude_config_is_environment_for_this_run():
    r = launch("claude", "--config", "--model", "qwen3:8b", "--host", URL, "--", "-p", "hi")
    assert r.returncode == 0, r.stderr
    env, cmd = _exports(r.stdout)
    assert env["ANTHROPIC_BASE_URL"] == URL and env["ANTHROPIC_MODEL"] == "qwen3:8b"
    assert env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == "qwen3:8b" and env["DISABLE_TELEMETRY"] == "1"
    assert env["ANTHROPIC_AUTH_TOKEN"]  # Claude Code wants one; the server needs none without LOCALLLM_API_KEY
    assert cmd == ["claude", "--model", "qwen3:8b", "-p", "hi"]


def test_codex_config_is_a_responses_provider_on_the_command_line():
    r = launch("codex", "--config", "--host", URL, "-m", "qwen3:8b", LOCALLLM_API_KEY="sekrit")
    assert r.returncode == 0, r.stderr
    env, cmd = _exports(r.stdout)
    assert env == {"LOCALLLM_API_KEY": "sekrit"}
    assert cmd[:2] == ["codex", "-c"] and cmd[-2:] == ["-m", "qwen3:8b"]
    provider = cmd[4]
    assert provider.startswith("model_providers.localllm={") and f'base_url="{URL}/v1"' in provider
    assert 'wire_api="responses"' in provider and 'env_key="LOCALLLM_API_KEY"' in provider


def test_opencode_config_is_inline_json():
    r = launch("opencode", "--config", "-m", "qwen3:8b", "--host", URL)
    assert r.returncode == 0, r.stderr
    env, cmd = _exports(r.stdout)
    config = json.loads(env["OPENCODE_CONFIG_CONTENT"])
    assert config["model"] == "localllm/qwen3:8b"
    provider = config["provider"]["localllm"]
    assert provider["npm"] == "@ai-sdk/openai-compatible" and provider["options"]["baseURL"] == URL + "/v1"
    assert list(provider["models"]) == ["qwen3:8b"] and cmd == ["opencode"]


@pytest.mark.parametrize(("agent", "install"), [("claude", "npm install -g @anthropic-ai/claude-code"),
                                                ("codex", "npm install -g @openai/codex"),
                                                ("opencode", "npm install -g opencode-ai")])
def test_an_agent_that_is_not_installed_is_one_sentence(agent, install, tmp_path):
    r = launch(agent, "--host", URL, PATH=str(tmp_path))  # nothing on PATH
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().endswith(f"install it with: {install}") and len(r.stderr.strip().splitlines()) == 1


def test_an_unknown_agent_is_refused():
    r = launch("aider")
    assert r.returncode == 2 and "'aider' is not one of 'claude', 'codex', 'opencode'" in r.stderr


def test_without_a_model_launch_takes_an_installed_one_that_can_use_tools(home, default_model_path):
    """The default model cannot use tools (the server refuses them to it): with it alone installed, launch names two
    catalog models with tools that fit this machine and how to get one (one sentence, exit 1); with a tools-capable
    model installed beside it, that one is taken."""
    from tests.server.derived import install_derived, tool_model
    from tests.support import TEST_HOME, install_copy

    install_copy(home / "data" / "models", TEST_HOME / "data" / "models")
    r = launch("codex", "--config", "--host", URL)
    assert r.returncode == 1 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
    msg = r.stderr.strip()
    assert msg.startswith("Error: No installed model can use tools, which Codex CLI needs; two that fit this machine: ")
    first = msg.split("`localllm pull ")[1].split("`")[0]
    assert msg.endswith(f"then run `localllm launch codex --model {first}`.") and "smollm2" not in msg
    gguf, wheel = tool_model(default_model_path)
    install_derived(gguf, "smollm2-tools:135m", home, **wheel)
    r = launch("codex", "--config", "--host", URL)
    assert r.returncode == 0, r.stderr
    assert _exports(r.stdout)[1][-2:] == ["-m", "smollm2-tools:135m"]


def test_a_named_model_without_tools_is_refused_before_the_agent_runs(tmp_path, installed_default_model):
    fake = tmp_path / "codex"
    fake.write_text('#!/bin/sh\necho ran\n')
    fake.chmod(0o755)
    import os

    from tests.server.conftest import start

    srv = start()
    try:
        r = launch("codex", "--host", srv.url, "-m", "smollm2:135m", PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    finally:
        srv.stop()
        srv.engine.close()
    assert r.returncode == 1 and "ran" not in r.stdout
    assert r.stderr.strip().splitlines()[-1] == ("Error: smollm2:135m cannot use tools (its chat template has none), "
                                                 "which Codex CLI needs; run `localllm launch codex` without --model "
                                                 "to pick one that can.")


def test_launch_starts_a_server_when_none_answers(tmp_path, coder_model):
    """No server at --host: launch starts `localllm serve` there in the background, then runs the agent (a stand-in
    that prints its arguments and environment), and leaves the server running for the next launch."""
    import os
    import socket

    import httpx
    import psutil

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fake = tmp_path / "bin" / "codex"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "args: $*"\n')
    fake.chmod(0o755)
    r = launch("codex", "--host", f"127.0.0.1:{port}", "-m", coder_model.name, "--", "exec", "hi",
               PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    server = [c.pid for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port and c.status == "LISTEN"]
    try:
        assert r.returncode == 0, r.stderr
        assert f"localllm: server http://127.0.0.1:{port} started (log: " in r.stderr
        assert r.stdout.startswith("args: -c model_provider=\"localllm\" -c model_providers.localllm={")
        assert r.stdout.rstrip().endswith(f"-m {coder_model.name} exec hi")
        assert httpx.get(f"http://127.0.0.1:{port}/api/version").json()["localllm"]  # still serving
        again = launch("codex", "--host", f"127.0.0.1:{port}", "-m", coder_model.name,
                       PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
        assert f"localllm: server http://127.0.0.1:{port} found" in again.stderr
    finally:
        for pid in server:
            psutil.Process(pid).terminate()
            psutil.Process(pid).wait(20)
    assert server
