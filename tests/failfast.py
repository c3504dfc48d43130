"""A run that loses a worker ends at once (pytest-xdist; hooks imported by ``tests/conftest.py``).

A test that aborts its process (a native crash: ``GGML_ASSERT`` in llama.cpp) kills its xdist worker. xdist then
replaces the worker, or with ``--max-worker-restart 0`` (the project's addopts) shuts the others down *after the
queue they hold*: with ``--dist loadfile`` the rest of a file each, minutes. Here the controller, told of the crash
(``pytest_handlecrashitem``), leaves a mark every worker checks after each test; a worker that sees it stops
(``session.shouldstop``), so the run ends within a test's time, its summary naming the test that was running when
the worker died (``worker 'gw1' crashed while running 'tests/x.py::test_y'``) and the reason it stopped.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

VAR = "PYTEST_LOCALLLM_CRASHED"  # not LOCALLLM_*: tests/conftest.py clears those; the workers inherit it

if "PYTEST_XDIST_WORKER" not in os.environ or VAR not in os.environ:  # the controller, a run without xdist, or
    # a test that imports tests.conftest again with the environment cleared: one mark per run
    os.environ[VAR] = str(Path(tempfile.mkdtemp(prefix="pytest-crashed-")) / "crashed")
MARK = Path(os.environ[VAR])


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched: object) -> None:
    """The controller: a worker died running ``crashitem``; every worker stops after its current test."""
    try:
        MARK.write_text(crashitem, encoding="utf-8")
    except OSError:
        pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    yield
    if MARK.exists():
        item.session.shouldstop = f"a worker died while running {MARK.read_text(encoding='utf-8')}"


def pytest_unconfigure(config: pytest.Config) -> None:
    if "PYTEST_XDIST_WORKER" not in os.environ:
        shutil.rmtree(MARK.parent, ignore_errors=True)
