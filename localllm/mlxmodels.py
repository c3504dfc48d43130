"""Where MLX builds of installed models live, and making one from the GGUF the store holds.

One directory per GGUF, keyed by the GGUF's digest, under ``paths().models / "mlx"``::

    <models>/mlx/<sha256 hex of the GGUF>/   config.json, model.safetensors, tokenizer.json, ...

The same place takes an MLX directory downloaded for that model (e.g. an ``mlx-community`` repo the
catalog names): whatever sits there complete is used. :func:`mlx_dir_for` only looks (no side effects,
so the store can call it while listing); :func:`convert_installed` builds the directory offline
from the GGUF with :mod:`backends.mlx_convert` (Q4_0/Q4_1/Q8_0 stay quantized)::

    >>> model = Store().get("smollm2:135m")          # doctest: +SKIP
    >>> mlx_dir_for(model) is None                    # doctest: +SKIP
    True
    >>> convert_installed(model)                      # doctest: +SKIP
    PosixPath('/home/me/.local/share/localllm/models/mlx/b179c952...')

MLX converts on first use: while planning, the engine (and ``probe``) ask :func:`mlx_for_plan` what MLX has
for the model (installed weights, a GGUF that converts, or why not: for ``--backend mlx`` one sentence
saying why and what to do); a plan with ``mlx_convert`` set makes the engine build the directory on the
model's load thread before loading it, reporting :class:`ConversionProgress` to the face that asked.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from localllm.config import paths
from localllm.errors import LocalLLMError

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
    def digest(self) -> str | None: ...  # "sha256:<hex>"

    @property
    def path(self) -> str | os.PathLike[str]: ...  # the .gguf


class InstalledLike(GGUFModel, Protocol):
    """An installed model as the planner sees it: its GGUF and the MLX weights the store found."""

    @property
    def mlx_path(self) -> Path | None: ...

    @property
    def mlx_source(self) -> str | None: ...


if TYPE_CHECKING:
    from localllm.hardware import HardwareInfo
    from localllm.planner import MLXWeights


def mlx_root() -> Path:
    """The folder holding every MLX model directory."""
    return paths().models / "mlx"


def _key(model: GGUFModel) -> str:
    digest = str(model.digest or "")
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

    >>> mlx_dir_for(type("M", (), {"digest": "sha256:" + "0" * 64})())   # doctest: +SKIP
    """
    try:
        p = mlx_dir_path(model)
    except ValueError:
        return None
    return p if _complete(p) else None


def convertible(model: GGUFModel) -> tuple[bool, str]:
    """(the GGUF can become an MLX model, the reason when not). Reads the header only."""
    from backends.base import BackendError
    from backends.mlx_convert import check_convertible

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


def mlx_for_plan(model: InstalledLike, hw: HardwareInfo, backend: str) -> MLXWeights | None:
    """What the planner gets as ``mlx=`` for ``model`` on ``hw`` (:class:`~localllm.planner.MLXWeights`:
    installed weights, a GGUF that converts on first use, or why not), or None for ``backend="llamacpp"``.

    For ``backend="mlx"`` on a machine where MLX runs, a model with no MLX weights whose GGUF cannot
    convert raises :class:`ConversionError` (:func:`cannot_convert_sentence`: why, and what to do). Reads
    the GGUF header at most (cached per file by the planner)."""
    if backend == "llamacpp":
        return None
    from localllm.planner import mlx_weights

    mw = mlx_weights(model, hw, backend=backend)
    if backend == "mlx" and not mw.usable and mw.why_not and hw.backend("mlx").available:
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
    from backends.base import BackendError

    with _lock:
        try:
            target = mlx_dir_path(model)
        except ValueError as e:
            raise ConversionError(f"Cannot convert {model.name}: it has no sha256 digest.") from e
        if not force and _complete(target):
            return target
        try:
            import mlx.core  # noqa: F401
        except ImportError as e:
            raise ConversionError(
                "Converting to MLX needs mlx: pip install 'localllm[mlx]' (or 'localllm[mlx-cpu]' on Linux)."
            ) from e
        from backends.mlx_convert import convert_gguf

        src = Path(os.fspath(model.path))
        if not src.is_file():
            raise ConversionError(f"The GGUF of {model.name} is missing: {src}.")
        try:
            return convert_gguf(src, target, dtype=dtype, progress=progress)
        except BackendError as e:
            raise ConversionError(str(e)) from e
