"""No MCP server outlives ``localllm chat``: the app in a real pty, quit with Ctrl+Q and killed with SIGKILL."""

from __future__ import annotations

import json

import psutil

from tests.test_mcp_host import recorder


def test_no_server_outlives_the_app_quit_or_killed(tmp_path):
    """``localllm chat`` in a real pty: the chat it reopens uses the recorder, which starts in the background;
    Ctrl+Q ends it with the app, and so does a SIGKILL of the app (the server's stdin closes)."""
    import fcntl
    import os
    import re
    import subprocess
    import sys
    import termios
    import time

    from localllm.chats import ChatStore

    def server_pid(home) -> int | None:
        log = home / "data" / "logs" / "mcp-rec.log"
        found = re.findall(r"recorder MCP server (\d+) starting", log.read_text()) if log.exists() else []
        return int(found[-1]) if found else None

    def gone(pid: int) -> bool:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
            time.sleep(0.1)
        return False

    for how in ("quit", "kill"):
        home = tmp_path / how
        (home / "config").mkdir(parents=True)
        (home / "config" / "mcp.json").write_text(json.dumps({"mcpServers": {"rec": recorder()}}))
        with ChatStore(home / "data" / "chats.sqlite3") as store:
            store.create(title="Tools", model="smollm2:135m", params={"mcp": ["rec"]})
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, b"\x18\x00\x50\x00\x00\x00\x00\x00")  # 24x80

        def ctty() -> None:
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        proc = subprocess.Popen([sys.executable, "-m", "localllm", "chat", "smollm2:135m"], stdin=slave, stdout=slave,
                                stderr=slave, env={**os.environ, "LOCALLLM_HOME": str(home), "TERM": "xterm-256color"},
                                preexec_fn=ctty, close_fds=True)
        os.close(slave)
        try:
            deadline = time.monotonic() + 60
            while (pid := server_pid(home)) is None and time.monotonic() < deadline:
                try:  # keep the pty drained so the app never blocks on its output
                    os.read(master, 65536) if __import__("select").select([master], [], [], 0.1)[0] else None
                except OSError:
                    break
            assert pid is not None and psutil.pid_exists(pid), f"the recorder did not start ({how})"
            if how == "quit":
                os.write(master, b"\x11")  # Ctrl+Q
            else:
                proc.kill()
            deadline = time.monotonic() + 30
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    os.read(master, 65536) if __import__("select").select([master], [], [], 0.1)[0] else None
                except OSError:
                    pass
            assert proc.poll() is not None, "the app did not exit"
            assert gone(pid), f"MCP server {pid} outlived the app ({how})"
        finally:
            if proc.poll() is None:
                proc.kill()
            os.close(master)
