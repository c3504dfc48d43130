"""The project type-checks: ``mypy`` (configured in pyproject.toml: ``files = ["localllm", "backends"]``) reports
no error. Its cache lives in the test cache, so a run after the first checks only what changed (seconds)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_is_clean(test_cache):
    r = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(test_cache / "mypy")], cwd=ROOT,
                       capture_output=True, text=True, timeout=580)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert r.stdout.startswith("Success: no issues found"), r.stdout
