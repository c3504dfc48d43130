"""The tool loop in the ``>>>`` REPL: the decision to call comes from a scripted token source (the fake, under
the real decode loop and stream, whose tool-call text the stream parses), everything after it is real: the
MCP server process, the confirmation read from the terminal, the arguments arriving at the server, the result
in the model's next rendered prompt (the fake answers with the tool result it finds there). Then the faults,
and the real default model making a forced call to ``mcp-server-time`` through ``localllm run`` in a pty."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import psutil
import pytest

from tests.test_mcp_host import TIME_SERVER, recorder

TOOL_MODEL = "smollm2-tools:135m"


@pytest.fixture(scope="module")
def tool_store(default_model_path, tmp_path_factory):
    """A private store holding the default model with Qwen2.5's (tool-capable) chat template as TOOL_MODEL."""
    from tests.server.derived import install_derived, tool_model

    gguf, wheel = tool_model(default_model_path)
    return install_derived(gguf, TOOL_MODEL, tmp_path_factory.mktemp("mcp-home"), **wheel)


def run_repl(store, calls: list[dict], servers: dict, lines: list[str], tmp_path: Path, *,
             model: str = TOOL_MODEL, engine=None, answer_tool_results: bool = True):
    """The REPL over a fake that calls ``calls`` until it sees a tool result, with these MCP servers."""
    from localllm.cli.answer import build_settings
    from localllm.cli.interactive import Repl
    from localllm.engine import Engine
    from localllm.mcp.config import parse_config
    from localllm.mcp.host import McpHost
    from localllm.mcp.loop import ToolChat
    from localllm.session import open_session
    from tests.fakes import FakeSource

    class Calling(FakeSource):
        def __init__(self, spec):
            super().__init__(spec, tool_calls=calls, answer_tool_results=answer_tool_results)

    host = McpHost(parse_config(json.dumps({"mcpServers": servers}), "mcp.json"), log_dir=tmp_path / "logs")
    prompts: list[str] = []
    feed = iter(lines)

    def read(prompt: str) -> str:
        prompts.append(prompt)
        return next(feed)

    out, err = io.StringIO(), io.StringIO()
    engine = engine or Engine(store=store, keep_alive=300, backend_class=lambda name: Calling)
    try:
        repl = Repl(open_session(engine=engine), model, build_settings(num_predict=200), out=out, err=err,
                    read=read, tools=ToolChat(host, list(servers)))
        repl.run()
    finally:
        host.close()
        engine.close()
    return out.getvalue(), err.getvalue(), repl, prompts


def test_a_call_is_confirmed_reaches_the_server_and_its_result_the_model(tool_store, tmp_path):
    record = tmp_path / "calls.jsonl"
    out, err, repl, prompts = run_repl(
        tool_store, [{"name": "record", "arguments": {"text": "hello"}}], {"rec": recorder(record, "48613")},
        ["Record hello please", "a", "And again", "/tools", "/bye"], tmp_path)
    assert "MCP rec: ready, 7 tools" in err  # stderr: stdout is the conversation
    assert '⚙ record (rec) {"text": "hello"}' in out
    asks = [p for p in prompts if p.startswith("Allow record?")]
    assert len(asks) == 1  # "always": the second turn's call is not asked again
    assert "→ recorded: hello 48613" in out
    # the result came back as a tool message and was in the next rendered prompt: the fake answers with it
    assert out.count("The tool said: recorded: hello 48613") == 2
    assert [json.loads(x)["arguments"] for x in record.read_text().splitlines()] == [{"text": "hello"}] * 2
    roles = [m["role"] for m in repl.messages]
    assert roles == ["user", "assistant", "tool", "assistant"] * 2
    assert repl.messages[1]["tool_calls"][0]["function"] == {"name": "record", "arguments": {"text": "hello"}}
    listed = out.split("/tools")[-1] if "/tools" in out else out
    assert "record" in listed and "(allowed)" in listed and "get" not in err


def test_a_denied_call_never_reaches_the_server_and_the_model_hears_why(tool_store, tmp_path):
    record = tmp_path / "calls.jsonl"
    out, _, repl, prompts = run_repl(tool_store, [{"name": "record", "arguments": {"text": "secret"}}],
                                     {"rec": recorder(record)}, ["Record it", "d", "/bye"], tmp_path)
    assert "✗ denied" in out and "The tool said: The user did not allow this tool call." in out
    assert not record.exists()
    assert len([p for p in prompts if p.startswith("Allow")]) == 1


@pytest.mark.parametrize("call, expected", [
    ({"name": "nap", "arguments": {"seconds": 60}}, 'The tool "nap" did not answer within 0.5 s'),
    ({"name": "die", "arguments": {}}, 'The MCP server "rec" exited during the call.'),
    ({"name": "boom", "arguments": {}}, 'The tool "boom" failed'),
    ({"name": "no_such_tool", "arguments": {}}, 'There is no tool "no_such_tool"'),
])
def test_faults_go_back_as_the_result_and_the_repl_still_answers(tool_store, tmp_path, call, expected):
    t0 = time.perf_counter()
    ok = [] if call["name"] == "no_such_tool" else ["o"]  # an unknown tool is not asked about: it cannot run
    timeout = 0.5 if call["name"] == "nap" else 2  # the nap's limit; the others answer at once, even on a busy machine
    out, err, repl, _ = run_repl(tool_store, [call], {"rec": recorder(timeout=timeout)},
                                 ["Do it", *ok, "Do it again", *ok, "/bye"], tmp_path)
    assert f"The tool said: {expected}" in out or (call["name"] == "boom" and "The tool said: Error executing" in out)
    assert time.perf_counter() - t0 < 60
    # the next message is answered too; after `die` the server is failed, so its tools are gone and the model
    # answers without them (the fake echoes the question)
    if call["name"] == "die":
        assert out.count("The tool said:") == 1 and "\nDo it again\n" in out
        assert repl.tools is not None and repl.tools.host.status("rec").state == "failed"
    else:
        assert out.count("The tool said:") == 2


def test_a_server_that_does_not_start_is_one_line_and_the_chat_goes_on(tool_store, tmp_path):
    out, err, repl, _ = run_repl(tool_store, [{"name": "record", "arguments": {"text": "x"}}],
                                 {"missing": {"command": "no-such-mcp-server-xyz"}}, ["Hello there", "/bye"],
                                 tmp_path)
    assert err.count("\n") == 1 and 'MCP missing: failed: its command "no-such-mcp-server-xyz" was not found' in err
    assert "Hello there" in out  # no tools ready: the fake echoes the question


def test_a_model_whose_template_has_no_tools_is_told_in_one_line(default_model, tmp_path):
    from localllm.engine import Engine

    out, err, repl, _ = run_repl(None, [], {"rec": recorder()}, ["/tools", "/bye"], tmp_path,
                                 model=default_model.name, engine=Engine(keep_alive=300))
    assert f"The chat template of {default_model.name} does not support tools" in err
    assert err.count("does not support tools") == 1


# ------------------------------------------------------------------------------------------ real model, pty


def test_the_real_model_makes_a_forced_call_to_the_time_server_through_run(tool_store, tmp_path):
    """``localllm run --mcp time --tool-choice required`` in a real pty: the default model (with a tool-capable
    template), a grammar-forced call, ``mcp-server-time`` over stdio, the confirmation typed on the terminal."""
    from .test_run import PtyProcess

    home = tmp_path / "home"
    (home / "config").mkdir(parents=True)
    (home / "config" / "mcp.json").write_text(json.dumps({"mcpServers": {
        "time": {"command": TIME_SERVER, "args": ["--local-timezone", "UTC"]}}}))
    env = {"LOCALLLM_HOME": str(home), "LOCALLLM_MODELS": str(tool_store.paths.models)}
    p = PtyProcess([TOOL_MODEL, "--mcp", "time", "--tool-choice", "required", "--temperature", "0",
                    "--num-predict", "60"], env=env)
    try:
        p.expect("MCP time: ready, 2 tools", timeout=120)
        p.expect(">>> ")
        p.send("What time is it in UTC?\n")
        shown = p.expect("Allow ", timeout=120)
        assert "⚙ " in shown and ("get_current_time" in shown or "convert_time" in shown)
        p.send("o\n")
        after = p.expect(">>> ", timeout=120)
        # the grammar-forced call ran on the server, and its answer (the current time there) is shown
        assert '⚙ get_current_time (time) {"timezone": "UTC"}' in shown
        assert "→ {" in after and '"datetime": "' + time.strftime("%Y-%m-%d", time.gmtime()) in after
        p.send("/tools\n")
        assert "time: ready, 2 tools" in p.expect(">>> ")
        # this REPL's own time server (other tests, or another worker, may run one at the same time)
        servers = [c.pid for c in psutil.Process(p.proc.pid).children(recursive=True)
                   if any("mcp-server-time" in a for a in c.cmdline())]
        assert servers
        p.send("/bye\n")
        assert p.close() == 0
    finally:
        if p.proc.poll() is None:
            p.proc.kill()
    assert all(_gone(pid) for pid in servers), f"MCP servers {servers} outlived the REPL"


def _rec_home(tmp_path: Path, tool_store) -> tuple[dict, Path]:
    """A LOCALLLM_HOME whose mcp.json has the recorder with its ``wait`` tool alone (a forced call must pick it)."""
    home = tmp_path / "home"
    (home / "config").mkdir(parents=True)
    (home / "config" / "mcp.json").write_text(json.dumps({"mcpServers": {"rec": recorder(None, "", "--only", "wait")}}))
    return {"LOCALLLM_HOME": str(home), "LOCALLLM_MODELS": str(tool_store.paths.models)}, home


def _server_pid(home: Path) -> int:
    import re

    log = (home / "data" / "logs" / "mcp-rec.log").read_text()
    return int(re.findall(r"recorder MCP server (\d+) starting", log)[-1])


def _gone(pid: int, timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.1)
    return False


def test_ctrl_c_stops_a_running_tool_and_the_server_goes_with_the_repl(tool_store, tmp_path):
    from .test_run import PtyProcess

    env, home = _rec_home(tmp_path, tool_store)
    p = PtyProcess([TOOL_MODEL, "--mcp", "rec", "--tool-choice", "required", "--temperature", "0",
                    "--num-predict", "30"], env=env)
    try:
        p.expect("MCP rec: ready, 1 tool", timeout=120)
        p.expect(">>> ")
        pid = _server_pid(home)
        p.send("Wait for me\n")
        assert "⚙ wait (rec) {}" in p.expect("Allow wait?", timeout=120)
        p.send("o\n")
        time.sleep(1.0)  # the call is running on the server (it sleeps a minute)
        t0 = time.monotonic()
        p.send("\x03")
        p.expect("Stopped.", timeout=20)
        assert time.monotonic() - t0 < 20
        p.expect(">>> ")
        p.send("/bye\n")
        assert p.close() == 0
    finally:
        if p.proc.poll() is None:
            p.proc.kill()
    assert _gone(pid), f"MCP server {pid} outlived the REPL"


def test_a_killed_repl_leaves_no_server_behind(tool_store, tmp_path):
    """SIGKILL (a crash): nothing of ours runs any more, but the stdio server sees its stdin close and exits."""
    from .test_run import PtyProcess

    env, home = _rec_home(tmp_path, tool_store)
    p = PtyProcess([TOOL_MODEL, "--mcp", "rec"], env=env)
    try:
        p.expect("MCP rec: ready, 1 tool", timeout=120)
        pid = _server_pid(home)
        assert psutil.pid_exists(pid)
        p.proc.kill()
        p.proc.wait(10)
    finally:
        if p.proc.poll() is None:
            p.proc.kill()
        os.close(p.fd)
    assert _gone(pid), f"MCP server {pid} outlived the killed REPL"


def test_bad_mcp_flags_and_config_are_one_sentence(tmp_path):
    import subprocess
    import sys

    home = tmp_path / "home"
    (home / "config").mkdir(parents=True)
    env = {**os.environ, "LOCALLLM_HOME": str(home)}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "localllm", "run", "some-model", *args], env=env,
                              capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)

    r = run("--mcp", "nope", "Hi")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith('Error: There is no MCP server "nope" in ') and "mcp.json" in r.stderr
    r = run("--tool-choice", "required", "Hi")
    assert r.returncode == 2 and "--tool-choice required needs an MCP server (--mcp NAME)." in r.stderr
    (home / "config" / "mcp.json").write_text("{not json")
    r = run("--mcp", "x", "Hi")
    assert r.returncode == 1 and r.stderr.startswith("Error: The MCP config ") and "is not valid JSON" in r.stderr
    assert r.stderr.count("\n") == 1


def test_one_shot_with_mcp_and_no_terminal_to_ask_denies_the_call(tool_store, tmp_path):
    """A prompt on the command line answers once through the loop; with no terminal to ask on, a call is denied
    (and the model hears so) rather than run unasked."""
    import subprocess
    import sys

    home = tmp_path / "home"
    (home / "config").mkdir(parents=True)
    (home / "config" / "mcp.json").write_text(json.dumps({"mcpServers": {"time": {"command": TIME_SERVER}}}))
    env = {**os.environ, "LOCALLLM_HOME": str(home), "LOCALLLM_MODELS": str(tool_store.paths.models)}
    r = subprocess.run([sys.executable, "-m", "localllm", "run", TOOL_MODEL, "--mcp", "time", "--tool-choice",
                        "required", "--temperature", "0", "--num-predict", "40", "What time is it in UTC?"],
                       env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    assert "MCP time: ready, 2 tools" in r.stderr and "⚙ get_current_time (time)" in r.stdout
    assert "✗ denied" in r.stdout and "Traceback" not in r.stderr


def test_the_rounds_of_one_question_are_bounded(tool_store, tmp_path):
    """A model that calls a tool whatever it hears: MAX_ROUNDS calls, then a generation without tools answers."""
    from localllm.mcp.loop import MAX_ROUNDS

    record = tmp_path / "calls.jsonl"
    calls = [{"name": "record", "arguments": {"text": "again"}}]
    out, _, repl, prompts = run_repl(tool_store, calls, {"rec": recorder(record)}, ["Loop forever", "a", "/bye"],
                                     tmp_path, answer_tool_results=False)
    assert out.count('⚙ record (rec) {"text": "again"}') == MAX_ROUNDS == len(record.read_text().splitlines())
    assert len([p for p in prompts if p.startswith("Allow")]) == 1
    assert out.rstrip().endswith("Loop forever")  # the last generation had no tools: the fake echoes the question
