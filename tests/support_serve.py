"""``localllm serve`` in a process of its own, for tests whose input might crash the server.

A server in a thread of the test process (``tests.server.conftest.start``) shares the process with pytest: an abort
inside llama.cpp (``GGML_ASSERT``) kills the pytest worker with it, and the run loses the name of the input that did
it. :class:`ServeProcess` runs the real command instead, over a private home holding the default model (manifest
copied, blob hard-linked), and :meth:`ServeProcess.call` turns a server that died or dropped the connection into a
failed assertion naming the request and quoting the end of the server's log.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.support import TEST_HOME, install_copy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """``python -m localllm serve`` on a free port of 127.0.0.1, ``LOCALLLM_HOME`` a private ``home`` holding the
    default model; ``env`` adds variables. Use as a context manager, or :meth:`start` / :meth:`stop`."""

    def __init__(self, home: Path, *, env: dict[str, str] | None = None, keep_alive: str = "10m"):
        self.home = home
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = home / "serve.log"
        models = home / "data" / "models"
        if not (models / "manifests").is_dir():
            install_copy(models, TEST_HOME / "data" / "models")
        self.env = {**os.environ, "LOCALLLM_HOME": str(home), **(env or {})}
        for k in ("LOCALLLM_HOST", "LOCALLLM_MODELS"):
            self.env.pop(k, None)
        self.keep_alive = keep_alive
        self.proc: subprocess.Popen[bytes] | None = None
        self.http = httpx.Client(base_url=self.url, timeout=180)

    def start(self, timeout: float = 90) -> ServeProcess:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "localllm", "serve", "--host", f"127.0.0.1:{self.port}", "--keep-alive",
                 self.keep_alive], env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            assert self.alive(), f"localllm serve exited at start: {self.last_words()}"
            try:
                if self.http.get("/", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"localllm serve did not answer within {timeout:.0f} s"
            time.sleep(0.1)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def last_words(self, lines: int = 12) -> str:
        """The exit status and the end of the server's log: what a failed assertion shows."""
        code = self.proc.poll() if self.proc is not None else None
        try:
            log = self.log.read_text(errors="replace").splitlines()
        except OSError:
            log = []
        # an abort's cause comes before the backtrace glibc and gdb print after it
        cause = [x for x in log if "GGML_ASSERT" in x or "Fatal Python error" in x or "Traceback" in x][:3]
        return f"exit status {code}; " + (f"it said: {' | '.join(cause)}; " if cause else "") + \
            "its log ends:\n" + "\n".join(log[-lines:])

    def call(self, method: str, path: str, body: Any = None, *, what: str = "", **kw: Any) -> httpx.Response:
        """One request; a server that died on it (or dropped the connection) fails the test, naming the request."""
        label = what or f"{method} {path} {body!r:.300}"
        try:
            r = self.http.request(method, path, json=body, **kw)
        except httpx.TransportError as e:
            time.sleep(0.5)  # a dying process: let it finish dying, so the log says how
            raise AssertionError(f"{label}: no answer ({type(e).__name__}); the server "
                                 f"{'is still running' if self.alive() else 'died'}: {self.last_words()}") from None
        assert self.alive(), f"{label}: the server died after answering {r.status_code}: {self.last_words()}"
        return r

    def stop(self) -> None:
        self.http.close()
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def one_sentence(r: httpx.Response) -> str:
    """The error message of a 4xx answer in either API's shape (Ollama's ``{"error": str}``, OpenAI's
    ``{"error": {"message": str}}``), asserted to be one sentence."""
    body = r.json()
    err = body.get("error") if isinstance(body, dict) else None
    msg = err.get("message") if isinstance(err, dict) else err
    if not isinstance(msg, str) and isinstance(body, dict) and isinstance(body.get("detail"), str):
        msg = body["detail"]
    assert isinstance(msg, str) and msg, f"{r.status_code} without an error message: {r.text[:300]}"
    assert "\n" not in msg and "Traceback" not in msg and len(msg) < 400, msg
    return msg
