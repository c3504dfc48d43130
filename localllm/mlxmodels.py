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
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Any

from localllm.config import paths
from localllm.errors import LocalLLMError

_lock = threading.Lock()


class ConversionError(LocalLLMError):
    """The GGUF cannot become an MLX model (architecture, vocabulary or tensor types MLX lacks)."""


def mlx_root() -> Path:
    """The folder holding every MLX model directory."""
    return paths().models / "mlx"


def _key(model: Any) -> str:
    digest = str(getattr(model, "digest", "") or "")
    hexpart = digest.split(":", 1)[-1].lower()
    if not re.fullmatch(r"[0-9a-f]{16,128}", hexpart):
        raise ValueError(f"installed model {getattr(model, 'name', model)!r} has no sha256 digest")
    return hexpart


def mlx_dir_path(model: Any) -> Path:
    """Where the MLX directory of ``model`` lives (whether or not it exists yet)."""
    return mlx_root() / _key(model)


def _complete(p: Path) -> bool:
    return (
        p.is_dir()
        and (p / "config.json").is_file()
        and any(p.glob("model*.safetensors"))
        and ((p / "tokenizer.json").is_file() or (p / "tokenizer.model").is_file())
    )


def mlx_dir_for(model: Any) -> Path | None:
    """The complete MLX directory for an installed model, or None. Looks only; never converts.

    >>> mlx_dir_for(type("M", (), {"digest": "sha256:" + "0" * 64})())   # doctest: +SKIP
    """
    try:
        p = mlx_dir_path(model)
    except ValueError:
        return None
    return p if _complete(p) else None


def convertible(model: Any) -> tuple[bool, str]:
    """(the GGUF can become an MLX model, the reason when not). Reads the header only."""
    from backends.base import BackendError
    from backends.mlx_convert import check_convertible

    try:
        check_convertible(model.path)
    except BackendError as e:
        return False, str(e)
    return True, ""


def convert_installed(model: Any, *, force: bool = False, dtype: str = "float32") -> Path:
    """Build (once) and return the MLX directory of an installed GGUF model.

    Needs ``mlx`` importable (``pip install 'localllm[mlx-cpu]'`` on Linux). Idempotent: an existing
    complete directory is returned unless ``force``. Raises :class:`ConversionError` with one sentence.
    """
    from backends.base import BackendError

    with _lock:
        try:
            target = mlx_dir_path(model)
        except ValueError as e:
            raise ConversionError(f"Cannot convert {getattr(model, 'name', model)}: it has no sha256 digest.") from e
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
            raise ConversionError(f"The GGUF of {getattr(model, 'name', src.name)} is missing: {src}.")
        try:
            return convert_gguf(src, target, dtype=dtype)
        except BackendError as e:
            raise ConversionError(str(e)) from e
