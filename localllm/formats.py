"""Weights formats as registered kinds: each format a model's weights come in, described once.

A format says what it is called (``name``, what a backend descriptor's ``weights`` names; ``label``, what ``list``
and ``show`` print), what it is made from offline (``converts_from``), where the catalog says to fetch it and how
(``source``, ``fetch``), where its files live (``find``) and how big they are for the plan (``size``). The store
keeps an installed model's weights per format (``InstalledModel.weights``: format name -> :class:`Weights`; a
manifest's ``weights`` block), a pull fetches the formats a catalog entry names, and the loader hands the planner
what the chosen backend's format has for a model (:func:`for_plan`)::

    >>> [f.name for f in registered()], get("mlx").label, get("mlx").converts_from
    (['gguf', 'mlx'], 'MLX', 'gguf')

GGUF and MLX are registered here (MLX's implementation lives with its files, in :mod:`localllm.mlxmodels`). A
backend with weights of its own is one package and one line::

    register_format(ToyFormat(), TOY_BACKEND)      # the format, and the backend descriptor that loads it

(``tests/toyformat/`` is such a package: pulled, listed and planned by the tests.)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from backends import descriptor
from backends.descriptor import GGUF, MLX

if TYPE_CHECKING:
    import threading

    from backends.descriptor import Backend
    from localllm.catalog import CatalogEntry
    from localllm.hardware import HardwareInfo


@dataclass(frozen=True)
class Weights:
    """One installed copy of a model's weights in one format: a file (GGUF) or a directory (MLX)."""

    format: str  # a registered format's name
    path: Path
    repo: str | None = None  # where they were fetched from (None: converted here, or the model's own file)
    revision: str | None = None  # the commit of ``repo`` that was fetched
    record: dict[str, Any] | None = None  # what the manifest keeps beyond these (size, files, fetched)

    @property
    def source(self) -> str:
        """Where they came from: ``"mlx-community/X@1a2b3c4d5e6f"``, ``"converted from the GGUF"``."""
        if self.repo:
            return f"{self.repo}@{(self.revision or '?')[:12]}"
        made_from = get(self.format).converts_from if self.format in _REGISTRY else None
        return f"converted from the {get(made_from).label}" if made_from in _REGISTRY else "installed"

    def as_record(self) -> dict[str, Any]:
        """The manifest's entry (``weights.<format>``)."""
        return {**(self.record or {}), "path": str(self.path), "repo": self.repo, "revision": self.revision}

    @staticmethod
    def of_record(fmt: str, d: dict[str, Any]) -> Weights:
        rest = {k: v for k, v in d.items() if k not in ("path", "repo", "revision")}
        return Weights(fmt, Path(d["path"]), d.get("repo") or None, d.get("revision") or None, rest or None)


@dataclass(frozen=True)
class PlanWeights:
    """What a format has for a model, as the planner takes it (``plan(weights={format: ...})``; ``MLXWeights`` is
    its MLX name):
    installed weights, or a source that converts on first use, or why not."""

    installed: bool = False  # complete weights exist (fetched or converted)
    convertible: bool = False  # the weights it converts from do (checked from their header)
    why_not: str = ""  # why they do not convert (one sentence), when not installed
    weights_bytes: int | None = None  # their size: the installed files', or the conversion's estimate
    source: str = ""  # "mlx-community/X@1a2b3c", "converted from the GGUF", "Q4_K → 4-bit, ..." (the plan)

    @property
    def usable(self) -> bool:
        return self.installed or self.convertible


@dataclass(frozen=True)
class Fetched:
    """What a format's ``fetch`` installed: the directory and the manifest's record of it."""

    path: Path
    revision: str
    size: int
    files: int


class WeightsFormat(Protocol):
    """One weights format. ``fetch`` and ``convert`` raise :class:`~localllm.errors.LocalLLMError` subclasses with
    one sentence (:class:`~localllm.errors.SourceUnavailable` when the source cannot be reached)."""

    name: str  # what ``Backend.weights`` says ("gguf", "mlx")
    label: str  # what a person reads ("GGUF", "MLX")
    converts_from: str | None  # the format it is built from offline, once (MLX: the GGUF); None: fetched only

    def source(self, entry: CatalogEntry) -> tuple[str, str | None] | None:
        """(repo, revision or None) the catalog entry names for these weights, or None."""
        ...

    def fetch_unasked(self) -> bool:
        """Whether a pull fetches them without being asked (MLX: on Apple Silicon, where MLX runs them)."""
        ...

    def fetch(self, repo: str, revision: str | None, *, models: Path, staging: Path,
              on_start: Callable[[str, int], None], on_bytes: Callable[[int], None],
              cancel: threading.Event | None) -> Fetched:
        """Download ``repo@revision`` into its directory under ``models`` (whole, or not at all)."""
        ...

    def find(self, models: Path, digest: str) -> Path | None:
        """Complete weights of this format made for the GGUF ``digest`` (a conversion's directory), or None."""
        ...

    def size(self, path: Path) -> int:
        """The bytes of installed weights at ``path``, as the plan counts them."""
        ...

    def for_plan(self, model: Any, hw: HardwareInfo, backend: str) -> PlanWeights:
        """What this format has for ``model`` (installed weights, a source that converts, or why not) for the
        planner's ``weights=`` (a backend asked for, or ``"auto"``)."""
        ...

    def convert(self, model: Any, device: str, progress: Callable[[int, int], None] | None) -> Path:
        """Build these weights from the model's ``converts_from`` weights, once; returns their path."""
        ...


class GGUFFormat:
    """The GGUF: one file, the blob the store pulls for every model (so it is never fetched or found here)."""

    name: str = GGUF
    label: str = "GGUF"
    converts_from: str | None = None

    def source(self, entry: CatalogEntry) -> tuple[str, str | None] | None:
        return (entry.gguf_repo, None) if entry.gguf_repo else None

    def fetch_unasked(self) -> bool:
        return True

    def fetch(self, repo: str, revision: str | None, *, models: Path, staging: Path,
              on_start: Callable[[str, int], None], on_bytes: Callable[[int], None],
              cancel: threading.Event | None) -> Fetched:
        raise NotImplementedError("the store pulls a model's GGUF itself")

    def find(self, models: Path, digest: str) -> Path | None:
        return None

    def size(self, path: Path) -> int:
        return path.stat().st_size

    def for_plan(self, model: Any, hw: HardwareInfo, backend: str) -> PlanWeights:
        return PlanWeights(installed=True, weights_bytes=self.size(Path(model.path)))

    def convert(self, model: Any, device: str, progress: Callable[[int, int], None] | None) -> Path:
        return Path(model.path)


_REGISTRY: dict[str, WeightsFormat] = {}
_BUILT_IN = {MLX: "localllm.mlxmodels:MLX_FORMAT"}  # imported on first use: importing this module stays light


def register_format(fmt: WeightsFormat, *backends: Backend) -> WeightsFormat:
    """Add (or replace) a weights format, and the backend descriptors that load it (:func:`backends.descriptor.
    register`): the store then pulls, lists and removes it, and the planner counts its size."""
    _REGISTRY[fmt.name] = fmt
    for b in backends:
        descriptor.register(b)
    return fmt


def unregister_format(name: str) -> None:
    _REGISTRY.pop(name, None)


def _load_built_in() -> None:
    for name, where in _BUILT_IN.items():
        if name not in _REGISTRY:
            module, attr = where.split(":")
            _REGISTRY[name] = getattr(importlib.import_module(module), attr)


def registered() -> list[WeightsFormat]:
    """Every registered format, GGUF first."""
    _load_built_in()
    return list(_REGISTRY.values())


def get(name: str) -> WeightsFormat:
    """The format ``name``; ``ValueError`` naming the choices for an unknown one."""
    _load_built_in()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown weights format {name!r} (choose {' or '.join(sorted(_REGISTRY))})") from None


def of_backend(backend: str) -> WeightsFormat:
    """The format ``backend`` (a registered backend's name) loads."""
    return get(descriptor.get(backend).weights)


def for_plan(model: Any, hw: HardwareInfo, backend: str) -> dict[str, PlanWeights]:
    """What the planner gets as ``weights=`` for ``model``, by format name: for a backend asked for that loads a
    format other than the GGUF, that format's answer (installed, converts, or why not); for ``"auto"``, the answer of
    each such format the planner's order has a backend for; nothing for a backend that loads the GGUF. The planner
    judges each backend by its own format's answer."""
    if backend in descriptor.names():
        fmt = of_backend(backend)
        return {} if fmt.name == GGUF else {fmt.name: fmt.for_plan(model, hw, backend)}
    out: dict[str, PlanWeights] = {}
    for b in descriptor.ranked(hw.apple_silicon):
        if b.weights != GGUF and b.weights not in out:
            out[b.weights] = get(b.weights).for_plan(model, hw, backend)
    return out


register_format(GGUFFormat())
