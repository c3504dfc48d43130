"""The MCP host against real servers: ``mcp-server-time`` from PyPI and the recorder of ``tests/mcp_server.py``
(the official SDK, over stdio and streamable HTTP). Faults: a command that does not exist, a server killed in
the middle of a call, a tool that sleeps past its timeout, a malformed schema, a huge result; and no server
process left once the host is closed."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from localllm.errors import LocalLLMError
from localllm.mcp.config import load_config, parse_config
from localllm.mcp.host import McpHost

SERVER = str(Path(__file__).with_name("mcp_server.py"))
TIME_SERVER = shutil.which("mcp-server-time") or str(Path(sys.executable).with_name("mcp-server-time"))


def recorder(record: Path | None = None, secret: str = "", *extra: str, timeout: float | None = None) -> dict:
    entry: dict = {"command": sys.executable, "args": [SERVER, *extra],
                   "env": {"MCP_RECORD": str(record or ""), "MCP_SECRET": secret}}
    if timeout is not None:
        entry["timeout"] = timeout
    return entry


def host_of(servers: dict, tmp_path: Path, **kw) -> McpHost:
    return McpHost(parse_config(json.dumps({"mcpServers": servers}), "mcp.json"), log_dir=tmp_path / "logs", **kw)


def server_pids(host: McpHost, names: list[str]) -> list[int]:
    pids = []
    for name in names:
        (tool,) = [t for t in host.tools([name]) if t.name == "pid"]
        pids.append(int(host.call(tool, {}).text))
    return pids


# ------------------------------------------------------------------------------------------ config


def test_config_bad_entries_are_one_sentence_each_and_the_rest_works(tmp_path):
    text = json.dumps({"mcpServers": {
        "ok": {"command": "x", "args": ["-v", 1]},
        "web": {"url": "http://127.0.0.1:9/mcp", "headers": {"Authorization": "Bearer t"}},
        "both": {"command": "x", "url": "http://a"},
        "neither": {"args": []},
        "badargs": {"command": "x", "args": "not a list"},
        "badurl": {"url": "ftp://x"},
        "badcwd": {"command": "x", "cwd": str(tmp_path / "missing")},
        "badtimeout": {"command": "x", "timeout": -1},
        "off": {"command": "x", "disabled": True},
    }})
    cfg = parse_config(text, "mcp.json")
    assert sorted(cfg.servers) == ["ok", "web"]
    assert cfg.servers["ok"].args == ("-v", "1") and cfg.servers["web"].headers == {"Authorization": "Bearer t"}
    assert set(cfg.problems) == {"both", "neither", "badargs", "badurl", "badcwd", "badtimeout"}
    for name, sentence in cfg.problems.items():
        assert sentence.startswith(f'MCP server "{name}" in mcp.json') and sentence.endswith(".")
        assert "\n" not in sentence
    with pytest.raises(LocalLLMError, match="not valid JSON"):
        parse_config("{nope", "mcp.json")
    with pytest.raises(LocalLLMError, match="mcpServers"):
        parse_config('{"mcpServers": []}', "mcp.json")
    path = tmp_path / "mcp.json"
    assert load_config(path).servers == {}  # no file: no servers
    path.write_text(text)
    assert sorted(load_config(path).servers) == ["ok", "web"]


# ------------------------------------------------------------------------------------------ real servers


def test_stdio_servers_start_in_the_background_and_calls_reach_them(tmp_path):
    record = tmp_path / "calls.jsonl"
    host = host_of({"rec": recorder(record, "s3cr3t"), "time": {"command": TIME_SERVER}}, tmp_path)
    try:
        t0 = time.perf_counter()
        host.start(["rec", "time"])
        assert time.perf_counter() - t0 < 0.5  # nothing waits for a server to start
        assert host.status("rec").state == "starting"
        host.wait(["rec", "time"], timeout=60)
        assert host.status("rec").line() == "rec: ready, 7 tools"
        assert {t.name for t in host.status("time").tools} == {"get_current_time", "convert_time"}
        tools = {t.public: t for t in host.tools(["rec", "time"])}
        result = host.call(tools["record"], {"text": "hello"})
        assert (result.text, result.is_error) == ("recorded: hello s3cr3t", False)
        assert [json.loads(line) for line in record.read_text().splitlines()] == [
            {"tool": "record", "arguments": {"text": "hello"}}]
        now = host.call(tools["get_current_time"], {"timezone": "UTC"})
        assert json.loads(now.text)["timezone"] == "UTC" and not now.is_error
        error = host.call(tools["boom"], {})
        assert error.is_error and "boom" in error.text
        big = host.call(tools["big"], {"n": 50_000})
        assert big.truncated and len(big.text) < 9000 and "cut: the tool returned 50000 characters" in big.text
        assert "recorder MCP server" in (tmp_path / "logs" / "mcp-rec.log").read_text()  # its stderr
        pids = server_pids(host, ["rec"])
    finally:
        host.close()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def test_a_tool_name_two_servers_share_is_namespaced(tmp_path):
    host = host_of({"a": recorder(secret="from-a"), "b": recorder(secret="from-b")}, tmp_path)
    try:
        host.start(["a", "b"])
        host.wait(["a", "b"], 60)
        names = {t.public for t in host.tools(["a", "b"])}
        assert {"a__record", "b__record"} <= names and "record" not in names
        assert {t.public for t in host.tools(["a"])} >= {"record"}  # alone, its own name
        tool = next(t for t in host.tools(["a", "b"]) if t.public == "b__record")
        assert host.call(tool, {"text": "hi"}).text == "recorded: hi from-b"
        assert "b__record" not in {t.public for t in host.tools(["a", "b"], disabled=["b/record"])}
    finally:
        host.close()


def test_faults_cost_one_line_and_the_host_goes_on(tmp_path):
    host = host_of({"rec": recorder(timeout=1.5), "other": recorder(secret="still here"),
                    "missing": {"command": "no-such-mcp-server-xyz"},
                    "bad": recorder(None, "", "--malformed"), "broken": {"args": ["no command"]}}, tmp_path)
    try:
        assert host.status("broken").line() == ('broken: failed: MCP server "broken" in mcp.json needs a "command" '
                                                '(stdio) or a "url" (streamable HTTP).')
        host.start(host.names)
        host.wait(host.names, 60)
        assert host.status("missing").line() == (
            'missing: failed: its command "no-such-mcp-server-xyz" was not found (is it installed and on PATH?)')
        bad = host.status("bad")
        assert bad.state == "failed" and 'the tool "record" with a malformed schema' in (bad.error or "")
        tools = {t.public: t for t in host.tools(["rec"])}
        t0 = time.perf_counter()
        slow = host.call(tools["nap"], {"seconds": 30})
        assert slow.is_error and "did not answer within 1.5 s" in slow.text and time.perf_counter() - t0 < 10
        assert host.call(tools["record"], {"text": "after the timeout"}).text == "recorded: after the timeout"
        died = host.call(tools["die"], {})
        assert died.is_error and "exited during the call" in died.text
        assert host.status("rec").state == "failed"
        again = host.call(tools["record"], {"text": "x"})
        assert again.is_error and "is not running" in again.text
        other = next(t for t in host.tools(["other"]) if t.name == "record")
        assert host.call(other, {"text": "ok"}).text == "recorded: ok still here"
        host.start(["rec", "missing"])  # a failed server stays failed...
        assert host.status("rec").state == "failed"
        host.start(["rec"], retry=True)  # ...until it is asked for again (the settings' checkbox)
        host.wait(["rec"], 60)
        assert host.status("rec").state == "ready"
        assert host.call(tools["record"], {"text": "back"}).text == "recorded: back"
    finally:
        host.close()


def test_a_server_that_never_answers_fails_after_the_start_timeout(tmp_path):
    host = host_of({"mute": {"command": sys.executable, "args": ["-c", "import time; time.sleep(60)"]}}, tmp_path,
                   start_timeout=0.5)
    try:
        host.start(["mute"])
        host.wait(["mute"], 30)
        status = host.status("mute")
        assert status.state == "failed" and "did not answer within 0.5 s" in (status.error or "")
    finally:
        host.close()
    assert not [p for p in psutil.Process().children(recursive=True) if "time.sleep(60)" in " ".join(p.cmdline())]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_streamable_http_server(tmp_path):
    record = tmp_path / "calls.jsonl"
    port = _free_port()
    proc = subprocess.Popen([sys.executable, SERVER, "--http", str(port)], env={
        **__import__("os").environ, "MCP_RECORD": str(record), "MCP_SECRET": "over-http"},
        stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        host = host_of({"web": {"url": f"http://127.0.0.1:{port}/mcp", "headers": {"X-Test": "1"}},
                        "nobody": {"url": f"http://127.0.0.1:{_free_port()}/mcp"}}, tmp_path)
        try:
            host.start(["web", "nobody"])
            host.wait(["web", "nobody"], 60)
            assert host.status("web").state == "ready", host.status("web").line()
            assert host.status("nobody").state == "failed"
            tool = next(t for t in host.tools(["web"]) if t.name == "record")
            assert host.call(tool, {"text": "via http"}).text == "recorded: via http over-http"
            assert json.loads(record.read_text())["arguments"] == {"text": "via http"}
        finally:
            host.close()
    finally:
        proc.terminate()
        proc.wait(10)
