"""Every CLI process exits cleanly, and ``--backend mlx`` converts on first use (issue 9).

The commands run as real subprocesses (``python -m localllm ...``), as a user or a script runs them, on
both backends: exit status 0 and nothing on stderr but our own lines. A process that ran MLX on a thread
used to print its answer and then abort at exit (status 134, ``terminate called without an active
exception`` and a native backtrace from Python's finalizer); in-process tests cannot see that, so these
do not run the CLI in-process.

Each test works in a private LOCALLLM_HOME holding the default model (manifest copied, blob hard-linked),
so what it converts or records never reaches the shared test home. MLX generations are a few tokens
(MLX on CPU is ~7 tok/s).
"""

from __future__ import annotations

import io
import json
import os
import re
import select
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support import DEFAULT_MODEL, SMOL_SHA, TEST_HOME, install_copy

BACKENDS = ["llamacpp", pytest.param("mlx", marks=pytest.mark.mlx)]
# what a crash at exit leaves on stderr (the abort, a traceback, ggml's gdb backtrace, a fatal error)
CRASH = re.compile(r"terminate called|Traceback|Fatal Python error|Segmentation fault|Aborted|core dumped"
                   r"|^#\d+ |\[New LWP|\[Inferior", re.M)
CONVERTING = f"converting {DEFAULT_MODEL} to MLX (once, offline)…"
# uvicorn's own shutdown lines; "background tasks" shows when a finished stream's task is still unwinding as the
# last connection closes (timing), which is a clean stop too; its ERROR "Cancel N running task(s)" is not allowed
SERVE_LINES = (r"localllm serving the Ollama API on http://127\.0\.0\.1:\d+ and the OpenAI API on .*/v1",
               r"Web UI: http://127\.0\.0\.1:\d+/ui/",
               r"INFO: +(Started server process|Waiting for (application|connections|background tasks)|Shutting down"
               r"|Finished server process)\b.*")


# ------------------------------------------------------------------------------------------ helpers


def _mlx_or_skip(backend: str) -> None:
    if backend == "mlx":
        pytest.importorskip("mlx.core")
        pytest.importorskip("mlx_lm")


def _fresh_home(root: Path) -> Path:
    """A LOCALLLM_HOME holding the default model and no MLX build of it."""
    models = root / "data" / "models"
    install_copy(models, TEST_HOME / "data" / "models")
    manifest = models / "manifests" / "library" / "smollm2" / "135m.json"
    data = json.loads(manifest.read_text(encoding="utf-8"))
    data["mlx_path"], data["weights"] = None, {}  # the shared home may have built one: this home starts without
    manifest.write_text(json.dumps(data), encoding="utf-8")
    return root


def _mlx_dir(home: Path) -> Path:
    return home / "data" / "models" / "mlx" / SMOL_SHA


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, LOCALLLM_HOME=str(home), PYTHONUNBUFFERED="1")
    env.pop("LOCALLLM_BACKEND", None)
    env.update(extra)
    return env


def localllm(home: Path, *args: str, input: str | None = None, timeout: float = 300,
             **env: str) -> subprocess.CompletedProcess[str]:
    stdin = None if input is not None else subprocess.DEVNULL
    return subprocess.run([sys.executable, "-m", "localllm", *args], input=input, stdin=stdin, capture_output=True,
                          text=True, timeout=timeout, env=_env(home, **env))


def assert_clean(r: Any, *allowed: str, stderr: str | None = None) -> None:
    """Exit status 0, no crash on stderr, and every stderr line one of ``allowed`` (regexes)."""
    err = r.stderr if stderr is None else stderr
    assert not CRASH.search(err), f"exit {r.returncode}, stderr:\n{err[-3000:]}"
    assert r.returncode == 0, f"exit {r.returncode}, stderr:\n{err[-3000:]}"
    for line in err.splitlines():
        if line.strip():
            assert any(re.fullmatch(p, line.strip()) for p in allowed), f"unexpected stderr line {line!r} in:\n{err}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------ homes


@pytest.fixture(scope="module")
def cli_home(tmp_path_factory, installed_default_model) -> Path:
    """A private home with the default model; an MLX build is made in it by ``converted``."""
    return _fresh_home(tmp_path_factory.mktemp("cli-exit"))


@pytest.fixture(scope="module")
def converted(cli_home) -> subprocess.CompletedProcess[str]:
    """``localllm convert smollm2:135m`` run once in ``cli_home`` (its result is checked by test_convert)."""
    pytest.importorskip("mlx.core")
    return localllm(cli_home, "convert", DEFAULT_MODEL, timeout=600)


@pytest.fixture
def home_for(request, cli_home):
    """``home_for(backend)``: ``cli_home``, with its MLX build made first for ``mlx``."""

    def get(backend: str) -> Path:
        _mlx_or_skip(backend)
        if backend == "mlx":
            assert request.getfixturevalue("converted").returncode == 0
        return cli_home

    return get


# ------------------------------------------------------------------------------------------ run, bench, convert


@pytest.mark.parametrize("backend", BACKENDS)
def test_run_one_shot_exits_cleanly(backend, home_for):
    r = localllm(home_for(backend), "run", DEFAULT_MODEL, "Say hello.", "--backend", backend,
                 "--num-predict", "4", "--temperature", "0")
    assert_clean(r)
    assert r.stdout.strip()


@pytest.mark.parametrize("backend", BACKENDS)
def test_run_piped_stdin_exits_cleanly(backend, home_for):
    r = localllm(home_for(backend), "run", DEFAULT_MODEL, "--backend", backend, "--num-predict", "4",
                 "--temperature", "0", input="Say hello.\n")
    assert_clean(r)
    assert r.stdout.strip()


@pytest.mark.parametrize("backend", BACKENDS)
def test_bench_exits_cleanly(backend, home_for):
    r = localllm(home_for(backend), "bench", DEFAULT_MODEL, "--backend", backend, "--pp", "16", "--tg", "4",
                 "-r", "1", "--num-ctx", "512", "--json")
    assert_clean(r)
    report = json.loads(r.stdout)
    assert report["backend"] == backend and "error" not in report["results"][0]


@pytest.mark.mlx
def test_convert_exits_cleanly(converted, cli_home):
    assert_clean(converted, re.escape(CONVERTING))
    assert converted.stderr.strip() == CONVERTING  # one line, no bar (stderr is not a terminal)
    assert Path(converted.stdout.strip().splitlines()[-1]) == _mlx_dir(cli_home)
    again = localllm(cli_home, "convert", DEFAULT_MODEL)  # already built: nothing to say, same directory
    assert_clean(again)
    assert again.stdout.strip() == converted.stdout.strip()


# ------------------------------------------------------------------------------------------ --backend mlx converts


@pytest.mark.mlx
def test_backend_mlx_converts_on_first_use(tmp_path, installed_default_model):
    pytest.importorskip("mlx_lm")
    home = _fresh_home(tmp_path)
    assert not _mlx_dir(home).exists()
    first = localllm(home, "run", DEFAULT_MODEL, "Say hello.", "--backend", "mlx", "--num-predict", "4",
                     "--temperature", "0", timeout=600)
    assert_clean(first, re.escape(CONVERTING))
    assert first.stderr.strip() == CONVERTING and first.stdout.strip()
    assert (_mlx_dir(home) / "config.json").is_file()
    manifest = json.loads((home / "data/models/manifests/library/smollm2/135m.json").read_text())
    assert manifest["weights"]["mlx"]["path"] == str(_mlx_dir(home))  # recorded in the store
    second = localllm(home, "run", DEFAULT_MODEL, "Say hello.", "--backend", "mlx", "--num-predict", "4",
                      "--temperature", "0")
    assert_clean(second)  # once: no conversion the second time
    assert second.stdout.strip() == first.stdout.strip()  # greedy: the same answer from the same weights


def _tiny_gguf(path: Path, arch: str) -> Path:
    """A small valid GGUF of ``arch`` (enough for the store and the planner; never loaded)."""
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(512)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "c", "d"])
    w.add_tensor("token_embd.weight", np.zeros((4, 64), dtype=np.float32))
    w.add_tensor("blk.0.attn_qkv.weight", np.zeros((192, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.mlx
def test_backend_mlx_on_a_gguf_that_cannot_convert_is_one_sentence(tmp_path):
    """An architecture the converter does not handle: one sentence naming it and what to do, exit 1."""
    pytest.importorskip("mlx.core")
    model = _tiny_gguf(tmp_path / "tiny-bloom.gguf", "bloom")
    r = localllm(tmp_path / "home", "run", str(model), "Hi", "--backend", "mlx")
    assert r.returncode == 1 and not CRASH.search(r.stderr), r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"Error: {model} has no MLX weights and its GGUF cannot be converted to MLX: ")
    assert "'bloom' architecture" in lines[0] and lines[0].endswith("run it with --backend llamacpp, "
                                                                     "or install an MLX build of it.")
    assert not (tmp_path / "home" / "data" / "models" / "mlx").exists() or not any(
        (tmp_path / "home" / "data" / "models" / "mlx").iterdir())  # nothing half-written


def test_conversion_display_shows_a_bar_only_after_a_second_on_a_terminal():
    from localllm.cli.display import ConversionDisplay
    from localllm.mlxmodels import ConversionProgress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for stream, bar in ((Terminal(), True), (io.StringIO(), False)):
        show = ConversionDisplay(stream)
        show(ConversionProgress("m:1b", "start"))
        assert stream.getvalue() == "converting m:1b to MLX (once, offline)…\n"
        show(ConversionProgress("m:1b", "progress", 10, 100, seconds=0.5))
        assert show._progress is None  # under a second: the line is enough
        show(ConversionProgress("m:1b", "progress", 50, 100, seconds=1.5))
        assert (show._progress is not None) is bar
        show(ConversionProgress("m:1b", "done", seconds=2.0))
        assert show._progress is None


# ------------------------------------------------------------------------------------------ serve


def _serve(home: Path, backend: str, sig: signal.Signals) -> tuple[subprocess.Popen[str], str, str]:
    """Start ``localllm serve --backend``, answer one request, stop it with ``sig``: (process, stderr, answer)."""
    import httpx

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    p = subprocess.Popen([sys.executable, "-m", "localllm", "serve", "--host", f"127.0.0.1:{port}",
                          "--backend", backend], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=_env(home))
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(url + "/api/version", timeout=2)
                break
            except httpx.HTTPError:
                assert p.poll() is None, p.communicate()[1]
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.1)
        r = httpx.post(url + "/api/generate", timeout=600, json={  # raw: no 30-token template to prefill on MLX
            "model": DEFAULT_MODEL, "prompt": "Hello, my name is", "raw": True, "stream": False,
            "options": {"num_predict": 4, "temperature": 0}})
        assert r.status_code == 200, r.text
        answer = r.json()["response"]
        assert [m["name"] for m in httpx.get(url + "/api/ps", timeout=10).json()["models"]] == [DEFAULT_MODEL]
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    return p, err, answer


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_serve_stops_cleanly_on_a_signal(backend, sig, tmp_path, installed_default_model):
    """After one request, Ctrl+C or SIGTERM: the requests finish, the engine closes, exit 0. On MLX the home
    starts without MLX weights, so the server converts on first use (its line in the log shows MLX ran)."""
    _mlx_or_skip(backend)
    home = _fresh_home(tmp_path)
    p, err, answer = _serve(home, backend, sig)
    allowed = SERVE_LINES + ((re.escape(CONVERTING),) if backend == "mlx" else ())
    assert_clean(p, *allowed, stderr=err)
    assert answer.strip()
    assert (CONVERTING in err) is (backend == "mlx")
    assert _mlx_dir(home).is_dir() is (backend == "mlx")


@pytest.mark.parametrize("backend", BACKENDS)
def test_serve_stops_cleanly_in_the_middle_of_a_stream(backend, home_for):
    """SIGTERM while an answer streams: the generation is stopped before uvicorn's graceful timeout, so
    the stream ends with its final ``done`` line (no task cancelled mid-response, no traceback), exit 0."""
    import httpx

    home = home_for(backend)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    p = subprocess.Popen([sys.executable, "-m", "localllm", "serve", "--host", f"127.0.0.1:{port}",
                          "--backend", backend], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=_env(home))
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(url + "/api/version", timeout=2)
                break
            except httpx.HTTPError:
                assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1]
                time.sleep(0.1)
        with httpx.stream("POST", url + "/api/generate", timeout=120, json={
                "model": DEFAULT_MODEL, "prompt": "Write a long story.", "options": {"num_predict": 4000}}) as r:
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 3:
                    p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert_clean(p, *SERVE_LINES, stderr=err)
    last = json.loads(lines[-1])
    assert last["done"] is True and last["eval_count"] < 4000  # ended early, and properly


# ------------------------------------------------------------------------------------------ chat (the TUI)


def _chat_answers(db: Path) -> int:
    if not db.is_file():
        return 0
    try:
        with sqlite3.connect(db, timeout=1) as c:
            return c.execute("SELECT count(*) FROM message WHERE role = 'assistant' AND content != ''").fetchone()[0]
    except sqlite3.Error:
        return 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_chat_quits_cleanly_after_an_answer(backend, tmp_path, installed_default_model):
    """The terminal app in a pseudo-terminal: send a message, wait for the answer to be saved, Ctrl+Q. On
    MLX (LOCALLLM_BACKEND=mlx) the home starts without MLX weights: the app converts them on first use."""
    import fcntl
    import pty
    import struct
    import termios

    _mlx_or_skip(backend)
    home = _fresh_home(tmp_path)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    p = subprocess.Popen([sys.executable, "-m", "localllm", "chat", DEFAULT_MODEL], stdin=slave, stdout=slave,
                         stderr=slave, env=_env(home, TERM="xterm-256color", LOCALLLM_BACKEND=backend),
                         close_fds=True, start_new_session=True)
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

    db = home / "data" / "chats.sqlite3"
    try:
        deadline = time.monotonic() + 60
        while b"Message (Enter sends" not in screen:  # the prompt is on screen: the app is ready
            assert p.poll() is None and time.monotonic() < deadline, screen.decode(errors="replace")[-2000:]
            pump(0.2)
        os.write(master, b"Say hello.\r")
        deadline = time.monotonic() + 600
        while _chat_answers(db) == 0:
            assert p.poll() is None and time.monotonic() < deadline, screen.decode(errors="replace")[-2000:]
            pump(0.2)
        os.write(master, b"\x11")  # Ctrl+Q
        deadline = time.monotonic() + 60
        while p.poll() is None and time.monotonic() < deadline:
            pump(0.2)
        pump(0.2)
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
        os.close(master)
    out = screen.decode(errors="replace")
    assert not CRASH.search(out), out[-3000:]
    assert p.returncode == 0, out[-3000:]
    assert _mlx_dir(home).is_dir() is (backend == "mlx")


# ------------------------------------------------------------------------------------------ the engine side


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_close_joins_every_thread_it_started(backend, home_for, monkeypatch):
    """In-process: after ``close()`` no model thread and no keep-alive thread is left, the engine loads
    nothing more, and a second close is harmless."""
    from localllm.api import GenerateRequest, Sampling
    from localllm.engine import Engine
    from localllm.errors import LocalLLMError
    from localllm.loader import LoadOptions

    monkeypatch.setenv("LOCALLLM_HOME", str(home_for(backend)))
    before = set(threading.enumerate())
    engine = Engine()
    req = GenerateRequest(prompt="Hello", sampling=Sampling(temperature=0, max_tokens=2))
    events = list(engine.generate(DEFAULT_MODEL, req, LoadOptions(backend=backend, num_ctx=512)))
    assert events[-1].finish_reason in ("stop", "length")
    assert engine.ps()[0].backend == backend
    mine = [t for t in threading.enumerate() if t not in before]
    assert {t.name for t in mine} >= {"localllm-keepalive", f"localllm-model-{DEFAULT_MODEL}"}
    engine.close()
    assert not [t for t in mine if t.is_alive()]
    assert engine.ps() == []
    with pytest.raises(LocalLLMError, match="shutting down"):
        list(engine.generate(DEFAULT_MODEL, req, LoadOptions(backend=backend, num_ctx=512)))
    engine.close()


def test_engine_backend_setting_applies_where_a_request_says_auto(monkeypatch, cli_home):
    pytest.importorskip("mlx.core")
    from localllm.engine import Engine
    from localllm.errors import LocalLLMError
    from localllm.loader import LoadOptions

    monkeypatch.setenv("LOCALLLM_HOME", str(cli_home))
    monkeypatch.setenv("LOCALLLM_BACKEND", "mlx")
    with Engine() as engine:
        assert engine.prepare(DEFAULT_MODEL).plan.backend == "mlx"
        assert engine.prepare(DEFAULT_MODEL, LoadOptions(backend="llamacpp")).plan.backend == "llamacpp"
    with Engine(backend="llamacpp") as engine:
        assert engine.prepare(DEFAULT_MODEL).plan.backend == "llamacpp"
    monkeypatch.setenv("LOCALLLM_BACKEND", "cuda")
    with pytest.raises(LocalLLMError, match="LOCALLLM_BACKEND must be auto, llamacpp or mlx"):
        Engine()


def test_engine_close_does_not_wait_for_a_consumer_that_never_resumes(home_for, monkeypatch):
    """A generation whose consumer never resumes: ``close(timeout=)`` cancels it and closes the model on its
    thread (the exit hook must not hang the process) instead of waiting for the consumer."""
    from localllm.api import GenerateRequest, Sampling
    from localllm.engine import Engine
    from localllm.loader import LoadOptions

    monkeypatch.setenv("LOCALLLM_HOME", str(home_for("llamacpp")))
    engine = Engine()
    gen = engine.generate(DEFAULT_MODEL, GenerateRequest(prompt="Count to ten:", sampling=Sampling(max_tokens=64)),
                          LoadOptions(backend="llamacpp", num_ctx=512))
    next(gen)  # the slot is held until the generator is resumed or closed
    running = engine.ps()[0]
    t0 = time.monotonic()
    engine.close(timeout=0.5)
    assert time.monotonic() - t0 < 5  # the request was cancelled, the model closed on its thread
    assert engine.ps() == [] and running.model.closed
    gen.close()
