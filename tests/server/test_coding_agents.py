"""The real coding agents on a real server: Codex CLI (``codex exec``, its ``--oss`` Ollama provider and a plain
Responses provider) and Claude Code (``claude -p``), installed from npm into the test cache, exit 0 with the
answer; a scripted tool call makes the agent run a real tool (a file appears in the work tree). No setting:
the server reloads the model with a context that fits an agent's prompt (and says what cannot fit at all in
each API's own words).

The model is made (:func:`tests.support_agents.long_context_model`: the default model's tokenizer, a tool
template, a 32k trained context, random weights) and runs on llama.cpp for real, the answers scripted
(:func:`tests.support_agents.scripted_backend`)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.server.derived import install_derived
from tests.support_agents import CLAUDE_QUIET, Script, agent_bin, agent_env, long_context_model, tool_call

AGENT_MODEL = "agent-llama:tiny"
ANSWER = "The file is there."


def decide(prompt: str) -> str:
    """Ask for a file: the model calls the agent's file tool; once the tool's result is back, it answers."""
    turn = prompt.rsplit("<|im_start|>user", 1)[-1]
    if "<tool_response>" in turn or "<|im_start|>tool" in turn:
        return ANSWER
    if "Create hello.txt" not in prompt:
        return "OK"  # a side request (a title, a check): anything
    if "exec_command" in prompt:  # Codex
        return tool_call("exec_command", {"cmd": "printf hi > hello.txt"})
    if '"name": "Write"' in prompt:  # Claude Code
        cwd = re.search(r"Primary working directory: (\S+)", prompt)
        return tool_call("Write", {"file_path": f"{cwd.group(1) if cwd else '.'}/hello.txt", "content": "hi"})
    if '"name": "write"' in prompt:  # OpenCode
        cwd = re.search(r"Working directory: (\S+)", prompt)
        return tool_call("write", {"filePath": f"{cwd.group(1) if cwd else '.'}/hello.txt", "content": "hi"})
    return "no tool to call"


@pytest.fixture(scope="module")
def agent_server(default_model_path, tmp_path_factory):
    from tests.support_agents import scripted_backend

    script = Script(decide)
    gguf = long_context_model(default_model_path)
    store = install_derived(gguf, AGENT_MODEL, tmp_path_factory.mktemp("agent-home"),
                            member="agent_llama/model.gguf")
    from localllm.engine import Engine
    from tests.server.conftest import start

    srv = start(Engine(store=store, keep_alive=300, backend_class=scripted_backend(script)), context_length=0)
    srv.script = script
    yield srv
    srv.stop()
    srv.engine.close()


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _work(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=work, check=True)
    return work


PROMPT = "Create hello.txt containing hi."


@pytest.mark.parametrize("provider", ["oss", "responses"])
def test_codex_exec_runs_a_tool_and_answers(agent_server, tmp_path, provider):
    codex = agent_bin("codex")
    work = _work(tmp_path)
    env = {"CODEX_HOME": str(tmp_path / "codex-home"), "NO_COLOR": "1"}
    (tmp_path / "codex-home").mkdir()
    args = [str(codex), "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
            "-m", AGENT_MODEL]
    if provider == "oss":
        env["CODEX_OSS_BASE_URL"] = agent_server.url + "/v1"
        args += ["--oss", "--local-provider", "ollama"]
    else:
        args += ["-c", "model_provider=localllm", "-c", 'model_providers.localllm={name="localllm",base_url="'
                 + agent_server.url + '/v1",wire_api="responses"}']
    stats: list = []
    observe = lambda model, st: stats.append(st)  # noqa: E731
    agent_server.engine.observers.append(observe)
    try:
        r = _run([*args, PROMPT], work, env)
    finally:
        agent_server.engine.observers.remove(observe)
    assert r.returncode == 0, r.stderr[-3000:]
    assert ANSWER in r.stdout, (r.stdout[-2000:], r.stderr[-2000:])
    assert (work / "hello.txt").read_text() == "hi"
    # the agent's second turn re-sent the whole prefix: only what is new was evaluated
    turn1, turn2 = stats[-2:]
    assert turn2.prompt_eval_count > turn1.prompt_eval_count > 5000
    assert turn2.prompt_eval_count - turn2.prompt_cached_tokens <= 0.05 * turn1.prompt_eval_count


def test_claude_p_runs_a_tool_and_answers(agent_server, tmp_path):
    claude = agent_bin("claude")
    work = _work(tmp_path)
    home = tmp_path / "home"
    home.mkdir()
    env = {**CLAUDE_QUIET, "HOME": str(home), "ANTHROPIC_BASE_URL": agent_server.url, "ANTHROPIC_API_KEY": "local",
           "ANTHROPIC_DEFAULT_HAIKU_MODEL": AGENT_MODEL, "ANTHROPIC_SMALL_FAST_MODEL": AGENT_MODEL}
    stats: list = []
    observe = lambda model, st: stats.append(st)  # noqa: E731
    agent_server.engine.observers.append(observe)
    try:
        r = _run([str(claude), "-p", "--model", AGENT_MODEL, "--permission-mode", "acceptEdits", PROMPT], work, env)
    finally:
        agent_server.engine.observers.remove(observe)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert ANSWER in r.stdout, (r.stdout[-2000:], r.stderr[-2000:])
    assert (work / "hello.txt").read_text() == "hi"
    turn1, turn2 = stats[-2:]  # the tool call, then the answer: only what is new was evaluated
    assert turn2.prompt_eval_count > turn1.prompt_eval_count > 5000
    assert turn2.prompt_eval_count - turn2.prompt_cached_tokens <= 0.05 * turn1.prompt_eval_count
    assert "x-anthropic-billing-header" not in agent_server.script.prompts[-1]


def test_opencode_run_runs_a_tool_and_answers(agent_server, tmp_path):
    """OpenCode on /v1/chat/completions, its provider given inline (OPENCODE_CONFIG_CONTENT), as launch does."""
    import json

    opencode = agent_bin("opencode")
    work = _work(tmp_path)
    home = tmp_path / "home"
    home.mkdir()
    config = {"model": f"localllm/{AGENT_MODEL}", "provider": {"localllm": {
        "npm": "@ai-sdk/openai-compatible", "options": {"baseURL": agent_server.url + "/v1", "apiKey": "x"},
        "models": {AGENT_MODEL: {}}}}}
    env = {"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".data"),
           "OPENCODE_CONFIG_CONTENT": json.dumps(config), "NO_COLOR": "1", "PWD": str(work),  # (it reads PWD)
           **agent_env("opencode")}
    r = _run([str(opencode), "run", PROMPT], work, env)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert ANSWER in r.stdout + r.stderr, (r.stdout[-2000:], r.stderr[-2000:])
    assert (work / "hello.txt").read_text() == "hi"


# ------------------------------------------------------------------------------------------ agent-sized prompts

WORD = "lorem "  # two tokens of the default model's vocabulary


def _ps(url: str) -> int:
    """The loaded context of the agent model (other models of this module's tests may be loaded beside it)."""
    import httpx

    (m,) = [m for m in httpx.get(url + "/api/ps").json()["models"] if m["name"] == AGENT_MODEL]
    return int(m["context_length"])


def test_a_prompt_beyond_the_loaded_context_reloads_it_larger(agent_server):
    import anthropic

    from localllm.planner import DEFAULT_CTX

    client = anthropic.Anthropic(base_url=agent_server.url, api_key="x", max_retries=0)
    client.messages.create(model=AGENT_MODEL, max_tokens=16, messages=[{"role": "user", "content": "hi"}],
                           extra_body={"keep_alive": 0})  # unloaded: the next load is the planner's default
    small = client.messages.create(model=AGENT_MODEL, max_tokens=16, messages=[{"role": "user", "content": "hi"}])
    assert small.content[0].text == "OK" and _ps(agent_server.url) == DEFAULT_CTX
    system = WORD * 3000 + "END-OF-SYSTEM"
    r = client.messages.create(model=AGENT_MODEL, max_tokens=16, system=system,
                               messages=[{"role": "user", "content": "hi"}])
    assert r.content[0].text == "OK" and r.usage.input_tokens > 6000 > DEFAULT_CTX
    assert _ps(agent_server.url) == 2 * DEFAULT_CTX  # the smallest power of two that holds it
    assert "END-OF-SYSTEM" in agent_server.script.prompts[-1]  # nothing was cut


def test_what_cannot_fit_at_all_is_each_apis_own_error(agent_server):
    import anthropic
    import httpx
    import openai

    from tests.support_agents import LONG_CTX

    huge = WORD * (LONG_CTX // 2 + 500)
    # from the default load: an earlier test of this module may have grown the context (any order)
    httpx.post(agent_server.url + "/api/generate", json={"model": AGENT_MODEL, "keep_alive": 0}, timeout=60)
    httpx.post(agent_server.url + "/api/generate", json={"model": AGENT_MODEL}, timeout=120).raise_for_status()
    loaded = _ps(agent_server.url)
    assert loaded < LONG_CTX
    claude = anthropic.Anthropic(base_url=agent_server.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=AGENT_MODEL, max_tokens=16, messages=[{"role": "user", "content": huge}])
    err = e.value.body["error"]
    assert err["type"] == "invalid_request_error"
    assert re.fullmatch(rf"prompt is too long: \d+ tokens > {LONG_CTX} maximum", err["message"]), err
    oai = openai.OpenAI(base_url=agent_server.url + "/v1", api_key="x", max_retries=0)
    for create in (lambda: oai.chat.completions.create(model=AGENT_MODEL, messages=[{"role": "user", "content": huge}]),
                   lambda: oai.responses.create(model=AGENT_MODEL, input=huge)):
        with pytest.raises(openai.BadRequestError) as oe:
            create()
        assert oe.value.code == "context_length_exceeded"
        assert f"maximum context length is {LONG_CTX} tokens" in oe.value.message
    assert _ps(agent_server.url) == loaded  # not loaded again at its largest context for nothing (issue 46)


# ------------------------------------------------------------------------------------------ localllm launch


@pytest.mark.parametrize("agent", ["codex", "claude", "opencode"])
def test_localllm_launch_runs_the_agent_on_the_server(agent_server, tmp_path, agent):
    """``localllm launch AGENT`` finds the server, passes the configuration and execs the agent (here with the
    agent's own one-shot arguments after ``--``)."""
    import sys

    binary = agent_bin(agent)
    work = _work(tmp_path)
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": f"{binary.parent}{os.pathsep}{os.environ['PATH']}", "HOME": str(home),
           "CODEX_HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".data"),
           "NO_COLOR": "1", **agent_env(agent)}
    own = {"codex": ["exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"],
           "claude": ["-p", "--permission-mode", "acceptEdits"], "opencode": ["run"]}[agent]
    r = _run([sys.executable, "-m", "localllm", "launch", agent, "--host", agent_server.url, "--model", AGENT_MODEL,
              "--", *own, PROMPT], work, env)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert ANSWER in r.stdout and (work / "hello.txt").read_text() == "hi"
    assert f"localllm: server {agent_server.url} found" in r.stderr


# ------------------------------------------------------------------------------------------ agent turns are cheap


def test_turn_two_evaluates_only_what_is_new_with_sessions_interleaved(agent_server):
    """Three Codex-shaped sessions (the recorded request, each with its own task), interleaved: A1 B1 C1 A2 B2 C2.
    Each second turn re-sends its session's whole prefix plus a tool call and its output; the server evaluates
    at most 5% of the first turn's prompt (usage.input_tokens_details.cached_tokens says what was reused)."""
    import copy
    import json

    import openai

    from tests.server.test_agent_protocol import CODEX

    client = openai.OpenAI(base_url=agent_server.url + "/v1", api_key="x", max_retries=0)
    sessions = {}
    for s in "ABC":
        body = copy.deepcopy(CODEX)
        body["input"][-1]["content"][0]["text"] = f"Session {s}: Create hello.txt containing hi."
        body["prompt_cache_key"] = f"session-{s}"
        sessions[s] = body

    def send(body):
        extra = {k: v for k, v in body.items() if k in ("client_metadata",)}
        args = {k: v for k, v in body.items() if k not in ("client_metadata", "stream")}
        return client.responses.create(**{**args, "model": AGENT_MODEL}, extra_body=extra)

    first = {s: send(b) for s, b in sessions.items()}
    for s, r in first.items():
        (call,) = [o for o in r.output if o.type == "function_call"]
        sessions[s]["input"] += [call.model_dump(exclude_none=True),
                                 {"type": "function_call_output", "call_id": call.call_id, "output": "done"}]
    second = {s: send(b) for s, b in sessions.items()}
    for s in "ABC":
        p1 = first[s].usage.input_tokens
        u2 = second[s].usage
        evaluated = u2.input_tokens - u2.input_tokens_details.cached_tokens
        assert u2.input_tokens > p1 > 2000
        assert evaluated <= 0.05 * p1, (s, p1, u2)
    assert json.dumps(second["C"].output[0].model_dump()).find(ANSWER) >= 0


def test_turn_two_after_a_server_restart_comes_from_the_prompt_cache(agent_server):
    """Turn 1 on one server, turn 2 on a new server over the same store: the prefix comes back from the prompt
    cache on disk (the whole turn-1 prompt is saved when its request ends)."""
    import copy
    import time

    import openai

    from localllm.engine import Engine
    from tests.server.conftest import start
    from tests.server.test_agent_protocol import CODEX
    from tests.support_agents import scripted_backend

    body = copy.deepcopy(CODEX)
    body["input"][-1]["content"][0]["text"] = "After a restart: Create hello.txt containing hi."
    args = {k: v for k, v in body.items() if k not in ("client_metadata", "stream")}

    def turn(srv, body_args):
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        return client.responses.create(**{**body_args, "model": AGENT_MODEL})

    def server():
        return start(Engine(store=agent_server.engine.store, keep_alive=300,
                            backend_class=scripted_backend(agent_server.script)), context_length=0)

    first = server()
    try:
        r1 = turn(first, args)
        time.sleep(1.0)  # the state file is written in the background after the answer
    finally:
        first.stop()
        first.engine.close()
    (call,) = [o for o in r1.output if o.type == "function_call"]
    args["input"] = [*args["input"], call.model_dump(exclude_none=True),
                     {"type": "function_call_output", "call_id": call.call_id, "output": "done"}]
    second = server()
    try:
        r2 = turn(second, args)
    finally:
        second.stop()
        second.engine.close()
    evaluated = r2.usage.input_tokens - r2.usage.input_tokens_details.cached_tokens
    assert r2.output[0].content[0].text == ANSWER
    assert evaluated <= 0.05 * r1.usage.input_tokens, (r1.usage, r2.usage)


def test_a_created_models_num_ctx_is_a_setting_the_context_does_not_grow_past(agent_server):
    """A model made with ``PARAMETER num_ctx 4096`` keeps that context: a longer prompt is the API's error."""
    import anthropic

    from localllm.modelfile import parse

    agent_server.engine.store.create("agent-llama:ctx4k", parse(f"FROM {AGENT_MODEL}\nPARAMETER num_ctx 4096"))
    client = anthropic.Anthropic(base_url=agent_server.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="agent-llama:ctx4k", max_tokens=16, system=WORD * 3000,
                               messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["message"].endswith("tokens > 4096 maximum")


def test_a_missing_node_is_a_failure_under_strict_mode_not_a_hardware_skip(monkeypatch):
    """node and npm are software (``.ci/run`` installs Debian's ``nodejs npm`` where missing): without them the agent
    tests skip with a reason that strict mode fails (only "hardware: ..." skips pass it), saying how to install them."""
    import shutil

    from tests.conftest import HARDWARE_SKIP

    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    with pytest.raises(pytest.skip.Exception) as e:
        agent_bin("codex")
    assert not str(e.value.msg).startswith(HARDWARE_SKIP) and "apt-get install nodejs npm" in str(e.value.msg)
    ci = (Path(__file__).parents[2] / ".ci" / "run").read_text()
    assert "apt-get install -y -q nodejs npm" in ci and ci.index("nodejs npm") < ci.index("python -m pytest")
