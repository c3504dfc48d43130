"""The suite fails fast: a pytest-xdist worker killed by a native abort ends the run within seconds, with the test it
was running named, under the project's own pytest settings (pyproject's addopts: two workers, ``--dist loadfile``,
``--max-worker-restart 0``) and hooks (:mod:`tests.failfast`). A tiny throwaway suite in a temp directory: one test
aborts its process (as ``GGML_ASSERT`` does), another file holds a minute of work that must not all run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DIES = """
import os
import time


def test_before():
    time.sleep(1)


def test_aborts():
    os.abort()  # what a GGML_ASSERT does to the process


def test_after():
    pass
"""

SLOW = """
import time

import pytest


@pytest.mark.parametrize("i", range(120))
def test_slow(i):
    time.sleep(0.5)
"""


def test_a_worker_that_dies_ends_the_run_in_seconds_naming_its_test(tmp_path):
    (tmp_path / "conftest.py").write_text("from tests.failfast import *  # noqa: F403\n")
    (tmp_path / "test_dies.py").write_text(DIES)
    (tmp_path / "test_slow.py").write_text(SLOW)  # 60 s of tests on the other worker
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": ""}
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_LOCALLLM_CRASHED", None)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir",
                        str(tmp_path), "-p", "no:randomly", "-p", "no:cacheprovider", "-q", str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    took = time.monotonic() - t0
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "worker 'gw" in out and "crashed while running 'test_dies.py::test_aborts'" in out, out[-3000:]
    assert "a worker died while running test_dies.py::test_aborts" in out, out[-3000:]
    assert took < 45, f"the run went on for {took:.0f} s after a worker died"
    passed = sum(line.count(".") for line in r.stdout.splitlines() if set(line.split("[")[0].strip()) <= {".", "F"})
    assert passed < 60, out[-3000:]  # most of the slow file never ran
