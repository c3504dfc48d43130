"""The CLI as a user first meets it, in real subprocesses (``python -m localllm``): every command's ``--help``
exits 0 with nothing on stderr and its usage line, and bare ``localllm`` prints the help when it is not on
a terminal (a pipe, a script) and opens the terminal app when stdin and stdout both are one."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time

import pytest

from localllm.cli import COMMANDS

# the usage line of each command: its arguments as a user types them
USAGE = {
    "pull": "Usage: localllm pull [OPTIONS] NAME",
    "run": "Usage: localllm run [OPTIONS] MODEL [PROMPT]...",
    "chat": "Usage: localllm chat [OPTIONS] [MODEL]",
    "list": "Usage: localllm list [OPTIONS]",
    "ps": "Usage: localllm ps [OPTIONS]",
    "show": "Usage: localllm show [OPTIONS] NAME",
    "rm": "Usage: localllm rm [OPTIONS] NAMES...",
    "cp": "Usage: localllm cp [OPTIONS] SRC DST",
    "verify": "Usage: localllm verify [OPTIONS] [NAMES]...",
    "create": "Usage: localllm create [OPTIONS] NAME",
    "quantize": "Usage: localllm quantize [OPTIONS] SRC TYPE [DST]",
    "stop": "Usage: localllm stop [OPTIONS] MODEL",
    "serve": "Usage: localllm serve [OPTIONS]",
    "probe": "Usage: localllm probe [OPTIONS]",
    "convert": "Usage: localllm convert [OPTIONS] MODEL",
    "bench": "Usage: localllm bench [OPTIONS] MODEL",
    "worker": "Usage: localllm worker [OPTIONS]",
    "transcribe": "Usage: localllm transcribe [OPTIONS] MODEL FILE",
    "launch": "Usage: localllm launch [OPTIONS] {claude|codex|opencode} [AGENT_ARGS]...",
    "rerank": "Usage: localllm rerank [OPTIONS] MODEL QUERY [DOCUMENTS]...",
}
TOP_USAGE = "Usage: localllm [OPTIONS] [COMMAND] [ARGS]..."
TIMEOUT = 120  # a cold start on a loaded 2-core machine takes a few seconds; this is not a speed test


def _start(*args: str, stdin: int = subprocess.DEVNULL) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "localllm", *args], stdin=stdin, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(p: subprocess.Popen[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr); a process still running after TIMEOUT is killed and fails the test."""
    try:
        stdout, stderr = p.communicate(timeout=TIMEOUT)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, stdout, stderr


@pytest.fixture(scope="module")
def helps() -> dict[str, tuple[int, str, str]]:
    """``localllm --help`` and ``localllm CMD --help`` for every command, started together (a second or two of
    wall time instead of one per command): name ('' for the top level) -> (exit status, stdout, stderr)."""
    procs = {name: _start(*([name] if name else []), "--help") for name in ["", *COMMANDS]}
    try:
        return {name: _finish(p) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def test_every_command_has_a_usage_line_here():
    assert set(USAGE) == set(COMMANDS)


@pytest.mark.parametrize("name", list(USAGE))
def test_command_help(helps, name):
    code, stdout, stderr = helps[name]
    assert (code, stderr) == (0, ""), stderr
    lines = stdout.splitlines()
    assert lines[0] == USAGE[name]
    assert "--help" in stdout and len(lines) > 3  # the options are listed


def test_top_level_help_lists_every_command(helps):
    code, stdout, stderr = helps[""]
    assert (code, stderr) == (0, ""), stderr
    assert stdout.splitlines()[0] == TOP_USAGE
    commands = stdout[stdout.index("Commands:"):]
    for name, (_, one_line) in COMMANDS.items():
        assert f"  {name}" in commands and one_line in commands


def test_bare_localllm_on_a_pipe_prints_the_help(helps):
    """Not on a terminal (a script, ``localllm | less``, ``localllm < file``): the help, exit 0."""
    import pty

    for terminal_in in (False, True):  # stdin a terminal but stdout a pipe: still the help
        master, slave = pty.openpty() if terminal_in else (None, None)
        p = _start(stdin=subprocess.DEVNULL if slave is None else slave)
        try:
            code, stdout, stderr = _finish(p)
        finally:
            for fd in (master, slave):
                if fd is not None:
                    os.close(fd)
        assert (code, stderr) == (0, ""), stderr
        assert stdout == helps[""][1]


def test_bare_localllm_on_a_terminal_opens_the_app(home):
    """Stdin and stdout a terminal: the terminal app (as ``localllm chat``), which Ctrl+Q closes with exit 0."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    p = subprocess.Popen([sys.executable, "-m", "localllm"], stdin=slave, stdout=slave, stderr=slave,
                         env=dict(os.environ, TERM="xterm-256color"), close_fds=True, start_new_session=True)
    os.close(slave)
    screen = bytearray()

    def pump(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if select.select([master], [], [], 0.05)[0]:
                try:
                    screen.extend(os.read(master, 65536))
                except OSError:  # the app closed the terminal
                    return

    try:
        deadline = time.monotonic() + TIMEOUT
        while b"Message (Enter sends" not in screen:  # the chat prompt is on screen: the app is running
            assert p.poll() is None and time.monotonic() < deadline, screen.decode(errors="replace")[-2000:]
            pump(0.2)
        os.write(master, b"\x11")  # Ctrl+Q
        deadline = time.monotonic() + TIMEOUT
        while p.poll() is None and time.monotonic() < deadline:
            pump(0.2)
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
        os.close(master)
    out = screen.decode(errors="replace")
    assert p.returncode == 0, out[-3000:]
    assert "Usage: localllm" not in out
