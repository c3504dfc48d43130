"""MLX weights of installed models, in one place: where they live, what MLX has for a model (installed
weights, a GGUF that converts, or why not) and making them from the GGUF the store holds.

One directory per GGUF, keyed by the GGUF's digest, under :func:`mlx_root` (``<models>/mlx``)::

    <models>/mlx/<sha256 hex of the GGUF>/   config.json, model.safetensors, tokenizer.json, ...

The same place takes an MLX directory downloaded for that model (e.g. an ``mlx-community`` repo the
catalog names): whatever sits there complete is used. :func:`mlx_dir_for` only looks (no side effects,
so the store can call it while listing); :func:`convert_installed` builds the directory offline
from the GGUF with :mod:`backends.mlx.convert` (Q4_0/Q4_1/Q8_0 stay quantized)::

    model = Store().get("smollm2:135m")
    mlx_dir_for(model) is None     # True: not converted yet
    convert_installed(model)       # PosixPath('/home/me/.local/share/localllm/models/mlx/b179c952...')

MLX converts on first use: while planning, the engine (and ``probe``) ask :func:`mlx_for_plan` what MLX has
for the model (:class:`MLXWeights`: installed weights, a GGUF that converts, or why not: for ``--backend
mlx`` one sentence saying why and what to do) and hand it to the pure planner; a plan with ``mlx_convert``
set makes the engine build the directory on the model's load thread before loading it, reporting
:class:`ConversionProgress` to the face that asked. Whether a GGUF converts is read from its header once
per file and kept under ``<cache>/mlx-convertible`` (this module owns that cache; the planner reads no file).
:class:`MLXFormat` is MLX as a registered weights format (:mod:`localllm.formats`): the store fetches the
catalog's ``mlx_repo`` through it (:mod:`localllm.mlxpull`), finds conversions by digest and sizes them for the plan.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from backends import descriptor
from backends.descriptor import MLX
from localllm.config import paths
from localllm.errors import LocalLLMError
from localllm.formats import Fetched, PlanWeights, Weights, WeightsFormat

if TYPE_CHECKING:
    from localllm.catalog import CatalogEntry
    from localllm.hardware import HardwareInfo

_lock = threading.Lock()


class ConversionError(LocalLLMError):
    """The GGUF cannot become an MLX model (architecture, vocabulary or tensor types MLX lacks)."""


@dataclass(frozen=True)
class ConversionProgress:
    """What a first-use conversion is doing, for the face that shows it (``Engine(on_convert=...)``).

    ``stage`` is ``"start"`` once, then ``"progress"`` with ``done``/``total`` bytes of GGUF tensor data
    converted, then ``"done"`` or ``"failed"`` (with ``error``) once; ``seconds`` since the start."""

    name: str
    stage: Literal["start", "progress", "done", "failed"]
    done: int = 0
    total: int = 0
    seconds: float = 0.0
    error: str | None = None


class GGUFModel(Protocol):
    """What conversion reads of an installed model (:class:`~localllm.store.InstalledModel` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def weights_digest(self) -> str | None: ...  # "sha256:<hex>"

    @property
    def path(self) -> str | os.PathLike[str]: ...  # the .gguf


class InstalledLike(GGUFModel, Protocol):
    """An installed model as the planner sees it: its GGUF and the weights in other formats the store found."""

    def weights_of(self, fmt: str) -> Weights | None: ...


MLXWeights = PlanWeights  # what MLX has for a model: installed weights, or a GGUF that converts (on first use)


def mlx_root(models: Path | None = None) -> Path:
    """The folder holding every MLX model directory (under ``models``, default the configured models dir)."""
    return (paths().models if models is None else models) / MLX


def mlx_dtype(device: str) -> str:
    """The float type a conversion for ``device`` uses: float16 on Metal (half the size), float32 on the
    CPU (mlx's CPU kernels are ~30× slower with float16 scales)."""
    return "float16" if device == "metal" else "float32"


def takes_mlx(backend: str) -> bool:
    """Whether ``backend`` (a name, or ``"auto"``) loads MLX weights."""
    return backend in descriptor.names() and descriptor.get(backend).weights == MLX


def _key(model: GGUFModel) -> str:
    digest = str(model.weights_digest or "")
    hexpart = digest.split(":", 1)[-1].lower()
    if not re.fullmatch(r"[0-9a-f]{16,128}", hexpart):
        raise ValueError(f"installed model {model.name!r} has no sha256 digest")
    return hexpart


def mlx_dir_path(model: GGUFModel) -> Path:
    """Where the MLX directory of ``model`` lives (whether or not it exists yet)."""
    return mlx_root() / _key(model)


def _complete(p: Path) -> bool:
    return (
        p.is_dir()
        and (p / "config.json").is_file()
        and any(p.glob("model*.safetensors"))
        and ((p / "tokenizer.json").is_file() or (p / "tokenizer.model").is_file())
    )


def mlx_dir_for(model: GGUFModel) -> Path | None:
    """The complete MLX directory for an installed model, or None. Looks only; never converts.

    >>> mlx_dir_for(type("M", (), {"weights_digest": "sha256:" + "0" * 64})()) is None
    True
    """
    try:
        p = mlx_dir_path(model)
    except ValueError:
        return None
    return p if _complete(p) else None


def convertible(model: GGUFModel) -> tuple[bool, str]:
    """(the GGUF can become an MLX model, the reason when not). Reads the header only."""
    from backends.contract.errors import BackendError
    from backends.mlx.convert import check_convertible

    try:
        check_convertible(model.path)
    except BackendError as e:
        return False, str(e)
    return True, ""


def cannot_convert_sentence(name: str, why: str) -> str:
    """The one sentence for ``--backend mlx`` on a model with no MLX weights whose GGUF cannot convert:
    why (the converter's own words: architecture, tensor type or tokenizer) and what to do."""
    why = why.strip().rstrip(".")
    if len(why) > 1 and why[0].isupper() and not why[1].isupper():
        why = why[0].lower() + why[1:]
    return (f"{name} has no MLX weights and its GGUF cannot be converted to MLX: {why}; "
            f"run it with --backend llamacpp, or install an MLX build of it.")


def mlx_weights(model: InstalledLike, hw: HardwareInfo | None = None, *, backend: str = "auto") -> MLXWeights:
    """What MLX can run for an installed model (a :class:`~localllm.store.InstalledModel`).

    Looks at the MLX directory the store found, else — where the answer matters (Apple Silicon with mlx,
    or a ``backend`` that loads MLX weights) — at whether the GGUF converts, from its header (cached per
    file, so planning stays fast). Never converts anything."""
    have = model.weights_of(MLX)
    if have is not None and have.path.is_dir():
        return MLXWeights(installed=True, weights_bytes=MLX_FORMAT.size(have.path) or None, source=have.source)
    statuses = [hw.backend(b.name) for b in descriptor.taking(MLX)] if hw is not None else []
    mlx_ok = any(s.available for s in statuses)
    if not takes_mlx(backend) and not (hw is not None and hw.apple_silicon and mlx_ok):
        return MLXWeights()
    device = "metal" if any(s.gpu_backend == "Metal" for s in statuses) else "cpu"
    return _convertible(Path(model.path), mlx_dtype(device))


def _convertible(path: Path, dtype: str) -> MLXWeights:
    """Whether the GGUF at ``path`` converts (and to how many bytes), from its header; kept per file, converter
    version and dtype under ``<cache>/mlx-convertible``."""
    try:
        st = path.stat()
        import backends.mlx.convert as mc

        version = mc.code_digest()[:12]
    except OSError as e:
        return MLXWeights(why_not=f"its GGUF cannot be read ({e.strerror or e})")
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{version}|{dtype}".encode()).hexdigest()
    cache = paths().cache / "mlx-convertible" / f"{key[:32]}.json"
    try:
        d = json.loads(cache.read_text())
        return MLXWeights(convertible=d["convertible"], why_not=d["why_not"], weights_bytes=d["bytes"],
                          source=d["source"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    from backends.contract.errors import BackendError

    try:
        info = mc.inspect_gguf(path, dtype=dtype)
        out = MLXWeights(convertible=True, weights_bytes=info.estimated_bytes,
                         source=", ".join(f"{t} {p}" for t, p in sorted(info.policy.items()) if p != "float"))
    except BackendError as e:
        out = MLXWeights(why_not=str(e).rstrip("."))
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"convertible": out.convertible, "why_not": out.why_not,
                                   "bytes": out.weights_bytes, "source": out.source}))
        os.replace(tmp, cache)
    except OSError:
        pass
    return out


def mlx_for_plan(model: InstalledLike, hw: HardwareInfo, backend: str) -> MLXWeights | None:
    """What the planner gets as ``mlx=`` for ``model`` on ``hw`` (:class:`MLXWeights`: installed weights, a
    GGUF that converts on first use, or why not), or None for a ``backend`` asked for that loads a GGUF.

    For a ``backend`` that loads MLX weights, on a machine where it runs, a model with no MLX weights whose GGUF
    cannot convert raises :class:`ConversionError` (:func:`cannot_convert_sentence`: why, and what to do).
    Reads the GGUF header at most (cached per file)."""
    if backend in descriptor.names() and not takes_mlx(backend):
        return None
    mw = mlx_weights(model, hw, backend=backend)
    if takes_mlx(backend) and not mw.usable and mw.why_not and hw.backend(backend).available:
        raise ConversionError(cannot_convert_sentence(model.name, mw.why_not))
    return mw


def convert_installed(model: GGUFModel, *, force: bool = False, dtype: str = "float32",
                      progress: Callable[[int, int], None] | None = None) -> Path:
    """Build (once) and return the MLX directory of an installed GGUF model.

    Needs ``mlx`` importable (``pip install 'localllm[mlx-cpu]'`` on Linux). Idempotent: an existing
    complete directory is returned unless ``force``. ``progress(done, total)`` gets the bytes of GGUF
    tensor data converted so far; an exception it raises stops the conversion (nothing is left behind).
    Raises :class:`ConversionError` with one sentence.
    """
    from filelock import FileLock

    from backends.contract.errors import BackendError

    try:
        target = mlx_dir_path(model)
    except ValueError as e:
        raise ConversionError(f"Cannot convert {model.name}: it has no sha256 digest.") from e
    locks = target.parent.parent / ".locks"  # beside the models, not among the MLX directories
    locks.mkdir(parents=True, exist_ok=True)
    # one conversion per model at a time, across threads and processes (`serve` and `run --backend mlx` at once):
    # the second waits and then finds the first's directory complete, instead of swapping it under a loader
    with _lock, FileLock(str(locks / f"mlx-{target.name}.lock")):
        if not force and _complete(target):
            return target
        try:
            import mlx.core  # noqa: F401
        except ImportError as e:
            raise ConversionError(
                "Converting to MLX needs mlx: pip install 'localllm[mlx]' (or 'localllm[mlx-cpu]' on Linux)."
            ) from e
        from backends.mlx.convert import convert_gguf

        src = Path(os.fspath(model.path))
        if not src.is_file():
            raise ConversionError(f"The GGUF of {model.name} is missing: {src}.")
        try:
            return convert_gguf(src, target, dtype=dtype, progress=progress)
        except BackendError as e:
            raise ConversionError(str(e)) from e


def apple_silicon() -> bool:
    """True on an Apple Silicon Mac, where MLX runs the models (a pull fetches MLX weights there)."""
    import platform
    import sys

    return sys.platform == "darwin" and platform.machine() == "arm64"


class MLXFormat:
    """MLX weights as a registered format (:mod:`localllm.formats`): a directory under ``<models>/mlx``, fetched
    from the catalog's ``mlx_repo`` (:mod:`localllm.mlxpull`) or converted from the GGUF (by its digest)."""

    name: str = MLX
    label: str = "MLX"
    converts_from: str | None = descriptor.GGUF

    def source(self, entry: CatalogEntry) -> tuple[str, str | None] | None:
        return entry.weights.get(MLX)

    def fetch_unasked(self) -> bool:
        return apple_silicon()

    def fetch(self, repo: str, revision: str | None, *, models: Path, staging: Path,
              on_start: Callable[[str, int], None], on_bytes: Callable[[int], None],
              cancel: threading.Event | None) -> Fetched:
        from localllm import mlxpull

        snap = mlxpull.fetch_mlx(repo, revision=revision, staging_root=staging,
                                 target_for=lambda sha: mlx_root(models) / f"hf-{repo.replace('/', '--')}-{sha[:12]}",
                                 on_start=on_start, on_bytes=on_bytes, cancel=cancel)
        return Fetched(snap.path, snap.revision, snap.size, snap.files)

    def find(self, models: Path, digest: str) -> Path | None:
        hexpart = digest.split(":", 1)[-1].lower()
        p = mlx_root(models) / hexpart
        return p if re.fullmatch(r"[0-9a-f]{16,128}", hexpart) and _complete(p) else None

    def size(self, path: Path) -> int:
        return sum(p.stat().st_size for p in path.glob("*.safetensors"))

    def for_plan(self, model: Any, hw: HardwareInfo, backend: str) -> MLXWeights:
        mw = mlx_for_plan(model, hw, backend)
        return mw if mw is not None else MLXWeights()

    def convert(self, model: Any, device: str, progress: Callable[[int, int], None] | None) -> Path:
        return convert_installed(model, dtype=mlx_dtype(device), progress=progress)


MLX_FORMAT: WeightsFormat = MLXFormat()
