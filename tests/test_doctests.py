"""The docstrings' examples run: every ``>>>`` example in ``localllm/`` and ``backends/`` is a doctest of this
suite, none is skipped (an example that needs a model, a network or a GPU is a plain ``::`` block instead,
which doctest does not run), and prose that only looks like an example (a ``>>>`` prompt shown in a
docstring) is not left for doctest to misparse."""

from __future__ import annotations

import doctest
import importlib
import io
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _modules_with_examples() -> list[str]:
    """Modules of both packages whose source has a ``>>>`` (read as text: nothing is imported to collect)."""
    out = []
    for package in ("localllm", "backends"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if ">>>" in path.read_text(encoding="utf-8") and path.name != "__main__.py":
                out.append(".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"))
    return out


MODULES = _modules_with_examples()


def _doctests(name: str) -> list[doctest.DocTest]:
    module = importlib.import_module(name)
    own = Path(str(module.__file__)).resolve()
    tests = doctest.DocTestFinder().find(module, name)  # raises ValueError on misparsed prose
    return [t for t in tests if t.examples and t.filename and Path(t.filename).resolve() == own]


@pytest.mark.parametrize("name", MODULES)
def test_module_examples_run(name: str):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    out = io.StringIO()
    tests = _doctests(name)
    for t in tests:
        skipped = [ex.source.strip() for ex in t.examples if ex.options.get(doctest.SKIP)]
        assert not skipped, f"{t.name}: skipped examples (make them a plain '::' block): {skipped}"
        runner.run(t, out=out.write)
    assert runner.failures == 0, out.getvalue()


def test_the_examples_are_many():
    """The collection above finds the examples (a change to how modules are found cannot empty it unseen)."""
    names = {"localllm.tui.answer", "backends.core.thinking", "localllm.names", "localllm.mlxmodels"}
    assert names <= set(MODULES)
    lines = sum(ex.source.count("\n") for name in names for t in _doctests(name) for ex in t.examples)
    assert lines >= 30, lines
