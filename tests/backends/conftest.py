"""Backend fixtures: a factory keyed by backend name, and derived variants of the default model.

``backend_factory(name, **spec)`` loads the default model in that backend's format (``MODEL_FIXTURE``)
with ``LoadSpec(**spec)`` (n_ctx defaults to 2048) on its own decode loop (:class:`backends.core.loop.LoadedModel`)
and caches it for the session, so tests that use the same spec share one load. ``backend`` is parametrized
over ``BACKENDS``: adding a backend to the
behavioural tests is one line in each of the two tables below.

``derived_model(ftype)`` turns the default Q4_1 file into an F32 / F16 / Q8_0 variant with llama.cpp's
quantizer (same vocabulary: a real target/draft pair for speculative decoding), cached next to the test
home (``$LOCALLLM_TEST_CACHE/derived``) so only the first run pays for it (~1-3 s each).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.contract.specs import LoadSpec
from backends.core.loop import LoadedModel
from backends.registry import available, load

BACKENDS = ["llamacpp", "mlx"]  # the backends the behavioural tests run on
# fixture giving the default model in each backend's format
MODEL_FIXTURE = {"llamacpp": "default_model_path", "mlx": "default_mlx_dir"}

TEST_CACHE = Path(os.environ.get("LOCALLLM_TEST_CACHE", "~/.cache/localllm-tests")).expanduser()

# OMP_WAIT_POLICY=PASSIVE is set by the root conftest, for every test and subprocess.


def _available(name: str) -> tuple[bool, str]:
    return available(name)


@pytest.fixture(scope="session")
def _backend_cache() -> Iterator[dict[Any, LoadedModel]]:
    cache: dict[Any, LoadedModel] = {}
    yield cache
    for b in cache.values():
        b.close()


@pytest.fixture
def backend_factory(request: pytest.FixtureRequest,
                    _backend_cache: dict[Any, LoadedModel]) -> Callable[..., LoadedModel]:
    """``make(name, fresh=False, **spec) -> Backend`` for the default model in ``name``'s format.

    ``fresh=True`` loads a private instance that the test must close (or that is closed at teardown)."""
    own: list[LoadedModel] = []

    def make(name: str, *, fresh: bool = False, **spec: Any) -> LoadedModel:
        ok, why = _available(name)
        if not ok:
            pytest.skip(f"backend {name} unavailable: {why}")
        spec.setdefault("n_ctx", 2048)
        if "model_path" not in spec:
            spec["model_path"] = str(request.getfixturevalue(MODEL_FIXTURE[name]))
        key = (name, repr(sorted(spec.items())))
        if not fresh and key in _backend_cache:
            return _backend_cache[key]
        b = load(name, LoadSpec(**spec))
        if fresh:
            own.append(b)
        else:
            _backend_cache[key] = b
        return b

    yield make
    for b in own:
        b.close()


@pytest.fixture(scope="session")
def default_mlx_dir(installed_default_model) -> Path:
    """The default model as an MLX directory, converted offline from its GGUF once (kept in the test home)."""
    ok, why = _available("mlx")
    if not ok:
        pytest.skip(f"backend mlx unavailable: {why}")
    from localllm.mlxmodels import convert_installed
    from tests.support import in_test_home

    return in_test_home(lambda store: convert_installed(store.get(installed_default_model)))


@pytest.fixture(params=BACKENDS)
def backend_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def backend(backend_name: str, backend_factory: Callable[..., LoadedModel]) -> LoadedModel:
    """The default model on each backend in ``BACKENDS`` (shared, n_ctx=2048)."""
    return backend_factory(backend_name)


def _file_key(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
    return f"{path.stat().st_size}-{h.hexdigest()[:12]}"


def derive_gguf(src: Path, dst: Path, ftype: str) -> Path:
    """Requantize ``src`` into ``dst`` with llama.cpp's quantizer (``ftype``: f32 | f16 | q8_0 | q4_0). Atomic."""
    import llama_cpp

    from backends.llamacpp._log import install_log_router

    install_log_router()  # the quantizer logs every tensor; keep it in logging, not on stdout
    ftypes = {"f32": llama_cpp.LLAMA_FTYPE_ALL_F32, "f16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
              "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0}
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftypes[ftype]
    params.allow_requantize = True
    params.nthread = 2
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + f".part{os.getpid()}")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize({src} -> {ftype}) returned {rc}")
    os.replace(tmp, dst)
    return dst


@pytest.fixture(scope="session")
def derived_model(default_model_path: Path) -> Callable[[str], Path]:
    """``derived_model(ftype)``: the default model requantized to ``ftype`` (f32 | f16 | q8_0 | q4_0; "q4_1" is the
    default file itself), made on first use and cached across runs."""
    src = Path(default_model_path)
    key = _file_key(src)

    def get(ftype: str) -> Path:
        if ftype == "q4_1":
            return src
        dst = TEST_CACHE / "derived" / f"smollm2-135m-{key}-{ftype}.gguf"
        return dst if dst.is_file() else derive_gguf(src, dst, ftype)

    return get


def collect(events: Any) -> tuple[str, Any, list[Any]]:
    """(joined text, the Done event, all events) of one generation."""
    from backends.contract.events import Done, TextChunk

    evs = list(events)
    text = "".join(e.text for e in evs if isinstance(e, TextChunk))
    done = evs[-1]
    assert isinstance(done, Done), f"stream must end with Done, got {done!r}"
    assert sum(isinstance(e, Done) for e in evs) == 1
    return text, done, evs
