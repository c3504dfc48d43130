"""Thinking in `localllm run` and its REPL, on a real GGUF: the default model with Qwen3's chat template and a
grammar that makes it write ``<think>…</think>`` before its answer (``tests/fixtures_thinking.py``): the
reasoning printed before the answer between Ollama's ``Thinking...`` / ``...done thinking.`` lines (grey on a
terminal only), ``--hidethinking``, ``/set think`` / ``/set nothink``, the thinking tokens in ``--verbose``,
and the flags' errors in one sentence."""

from __future__ import annotations

import io
import re

import pytest
from click.testing import CliRunner

from localllm.cli import cli
from localllm.cli.answer import GREY, RESET, THINKING_CLOSE, THINKING_OPEN, build_settings
from tests.fixtures_thinking import THINK_GBNF, write_thinking_model

ASK = "What is two plus two?"


@pytest.fixture(scope="module")
def thinker(default_model_path):
    """(the thinking GGUF's path as a model name, a session whose engine applies the thinking grammar)."""
    from localllm.engine import Engine
    from localllm.session import open_session
    from tests.server.derived import grammar_backend

    session = open_session(engine=Engine(keep_alive=300, backend_class=grammar_backend(THINK_GBNF)))
    yield str(write_thinking_model(default_model_path)), session
    session.close()


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def one_shot(thinker, out: io.StringIO, **flags) -> tuple[int, str, str]:
    from localllm.cli.run import one_shot as run_once

    name, session = thinker
    err = io.StringIO()
    code = run_once(session.runner, name, ASK, build_settings(temperature=0, seed=1, **flags), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_reasoning_is_printed_before_the_answer(thinker):
    code, out, err = one_shot(thinker, io.StringIO(), verbose=True)
    assert code == 0
    assert out.startswith(THINKING_OPEN) and THINKING_CLOSE in out and "\x1b" not in out  # plain: not a terminal
    thought, answer = out[len(THINKING_OPEN):].split(THINKING_CLOSE)
    assert thought.strip() and answer.strip().endswith(".")
    assert "think>" not in out  # the tags are the template's business, never printed
    n = int(re.search(r"^thinking tokens:\s+(\d+) token\(s\)$", err, re.M).group(1))
    total = int(re.search(r"^eval count:\s+(\d+) token\(s\)$", err, re.M).group(1))
    assert 0 < n < total
    lines = [ln.split(":")[0] for ln in err.splitlines()]
    assert lines.index("thinking tokens") == lines.index("eval count") + 1


def test_on_a_terminal_the_reasoning_is_grey(thinker):
    _, out, _ = one_shot(thinker, Tty())
    assert out.startswith(GREY) and f"{RESET}{GREY}" in out  # bold "Thinking..." then grey text
    head, answer = out.split(THINKING_CLOSE)
    assert answer.startswith(RESET) and GREY not in answer


def test_hidethinking_prints_the_answer_only(thinker):
    _, shown, _ = one_shot(thinker, io.StringIO())
    _, hidden, _ = one_shot(thinker, io.StringIO(), hide_thinking=True)
    assert "Thinking" not in hidden and hidden.strip()
    assert shown.endswith(hidden)  # the same answer (greedy), without its reasoning


def test_repl_set_think_and_nothink(thinker, default_model):
    from localllm.cli.interactive import Repl

    name, session = thinker
    lines = iter(["/set think", ASK, "/set nothink", "/set think high", "/set think maybe", "/show parameters",
                  "/load " + default_model.name, "/set think", "/bye"])
    out, err = io.StringIO(), io.StringIO()
    repl = Repl(session, name, build_settings(temperature=0, seed=1, num_predict=60), out=out, err=err,
                read=lambda prompt: next(lines))
    repl.run()
    o, e = out.getvalue(), err.getvalue()
    assert "Set 'think' mode." in o and "Set 'nothink' mode." in o and "Set 'think' mode to 'high'." in o
    assert 'Invalid think value: "maybe"' in o
    assert re.search(r"^think\s+high$", o, re.M)  # /show parameters
    assert o.count(THINKING_OPEN) == 1 and THINKING_CLOSE in o and "think>" not in o
    answered = o.split(THINKING_CLOSE)[1].split("Set 'nothink' mode.")[0]
    assert answered.strip().endswith(".")  # the answer after the reasoning
    # only the model that cannot think gets Ollama's warning
    assert e.count("does not support thinking") == 1 and default_model.name in e


def test_think_flags_errors_are_one_sentence(default_model):
    runner = CliRunner()
    r = runner.invoke(cli, ["run", default_model.name, "--think", "Hi"])  # --think takes no value from "Hi"
    assert r.exit_code == 1, r.output
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("Error: ") and "does not support thinking" in line
    r = runner.invoke(cli, ["run", default_model.name, "--think=maybe", "Hi"])
    assert r.exit_code == 1 and 'Invalid think value: "maybe"' in r.stderr
    r = runner.invoke(cli, ["run", default_model.name, "--think=false", "--num-predict", "4", "--temperature", "0",
                            "Hi"])
    assert r.exit_code == 0 and r.stdout.strip() and "Thinking" not in r.stdout  # false is fine for any model
