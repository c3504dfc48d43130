"""What the store records and reports: an installed model (:class:`InstalledModel`, its
:class:`Projector`), a pull's progress events (:class:`PullProgress`), and the helpers that read a manifest's
parts (the ``derived`` block of a created model, a projector's header)."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from backends import descriptor
from backends.descriptor import GGUF
from localllm import formats
from localllm.catalog import CatalogEntry
from localllm.errors import InvalidModelFileError
from localllm.formats import Weights
from localllm.modelfile import Modelfile

MANIFEST_SCHEMA = 2  # 2: other formats' weights in one ``weights`` block (1: ``mlx_path`` and ``mlx``)


@dataclass
class Projector:
    """A projector (``mmproj`` GGUF) that goes with a model: with a vision encoder the model takes images, with an
    audio encoder audio clips (Gemma 4's and Qwen2.5-Omni's do both). Stored as a blob like the weights (Ollama's
    ``projector`` layer); a local GGUF's is the file beside it, used in place."""

    path: Path
    digest: str  # "sha256:<hex>"
    size: int
    source: str = ""
    external: bool = False  # used in place (not a blob of the store)
    vision: bool = True  # its encoders, read from its header at install (a manifest without them: vision only,
    audio: bool = False  # as every projector was before audio)

    def as_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "digest": self.digest, "size": self.size, "source": self.source,
                "external": self.external, "vision": self.vision, "audio": self.audio}

    @property
    def kinds(self) -> list[str]:
        """``["vision"]``, ``["audio"]`` or both: the capabilities it gives its model."""
        return [k for k, on in (("vision", self.vision), ("audio", self.audio)) if on]


def projector_beside(path: Path) -> Path | None:
    """A projector next to a local GGUF (``mmproj*.gguf`` in the same directory), or None."""
    try:
        names = [p.name for p in path.parent.iterdir() if p.is_file() and p.name != path.name]
    except OSError:
        return None
    from localllm.download import pick_projector

    pick = pick_projector(names)
    return path.parent / pick if pick else None


@dataclass
class InstalledModel:
    name: str
    weights_digest: str  # "sha256:<hex>" of the GGUF blob: blobs, the prompt cache and MLX builds key on it
    path: Path  # the .gguf
    size: int
    modified: datetime
    info: dict[str, Any]  # GGUFInfo.as_dict(), cached at install
    source: str
    local: bool = False  # a .gguf file used in place
    catalog: CatalogEntry | None = None
    quant: str | None = None
    # its weights in formats other than the GGUF (``path``), by format name: {"mlx": Weights("mlx", dir, repo, rev)}
    weights: dict[str, Weights] = field(default_factory=dict)
    projector: Projector | None = None  # a vision projector: the model takes images
    # a model made with ``create`` (a Modelfile): what it adds over its weights; ``derived.from_`` is the base
    derived: Modelfile | None = None
    quantized_from: str | None = None  # the digest of the weights ``create --quantize`` made these from

    @property
    def base(self) -> str | None:
        """The installed model a derived one was made from (None: not derived, or made from a file or blob)."""
        return self.derived.from_ or None if self.derived is not None else None

    @property
    def model_digest(self) -> str:
        """What identifies the model to its users (``list``'s ID, ``/api/tags``' and ``/api/ps``' digest, ``show``):
        the weights' digest, or for a created model that adds anything, the sha256 of what it is (the weights, the
        projector and what it adds), as Ollama gives a created model its own manifest digest. A created model and
        its base thus differ, a ``cp`` copy shares its source's, and the same Modelfile over the same weights
        gives the same one again (names and times are not part of it)."""
        if self.derived is None or not any(v for v in self.derived.as_dict().values()):
            return self.weights_digest
        what = {"weights": self.weights_digest, "projector": self.projector.digest if self.projector else None,
                "adds": self.derived.as_dict()}
        return "sha256:" + hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()

    @property
    def short_id(self) -> str:
        return self.model_digest.removeprefix("sha256:")[:12]

    @property
    def formats(self) -> list[str]:
        """The weight formats installed for this model, by label in registration order: ``["GGUF"]``,
        ``["GGUF", "MLX"]``."""
        return [f.label for f in formats.registered() if self.weights_of(f.name) is not None]

    def weights_of(self, fmt: str) -> Weights | None:
        """Its weights in format ``fmt`` (a registered name: ``"gguf"`` is the model's file), or None."""
        return Weights(GGUF, self.path) if fmt == GGUF else self.weights.get(fmt)

    def weights_path(self, backend: str) -> Path | None:
        """The weights ``backend`` (a registered name) loads for this model: the GGUF, or the directory of its
        format (None while there is none)."""
        w = self.weights_of(descriptor.get(backend).weights)
        return w.path if w is not None else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "digest": self.weights_digest, "model_digest": self.model_digest, "path": str(self.path),
            "size": self.size,
            "modified": self.modified.isoformat(), "source": self.source, "local": self.local,
            "quant": self.quant, "catalog": self.catalog.name if self.catalog else None,
            "formats": self.formats, "weights": {k: w.as_record() for k, w in self.weights.items()}, "info": self.info,
            "projector": self.projector.as_dict() if self.projector else None,
            "derived": ({"base": self.base, **self.derived.as_dict()} if self.derived is not None else None),
        }


@dataclass
class PullProgress:
    """One progress event, shaped like Ollama's ``/api/pull`` stream."""

    status: str
    digest: str | None = None
    total: int = 0
    completed: int = 0


ProgressFn = Callable[[PullProgress], None]


class _Reporter:
    """Turns byte counts into throttled :class:`PullProgress` events."""

    def __init__(self, progress: ProgressFn | None):
        self.progress = progress
        self.status = ""
        self.digest: str | None = None
        self.total = 0
        self.completed = 0
        self._last = 0.0
        self.made: list[str] = []  # blobs this operation installed (``create`` frees them when it fails)

    def phase(self, status: str, digest: str | None = None, total: int = 0) -> None:
        self.status, self.digest, self.total, self.completed = status, digest, total, 0
        self._emit(force=True)

    def add(self, n: int) -> None:
        self.completed += n
        self._emit(force=self.completed >= self.total > 0)

    def update(self, completed: int, total: int) -> None:
        """Where a phase stands (a quantization: the output's bytes so far against its planned size)."""
        self.completed, self.total = completed, total
        self._emit(force=completed >= total > 0)

    def _emit(self, force: bool = False) -> None:
        if self.progress is None:
            return
        now = time.monotonic()
        if force or now - self._last >= 0.05:
            self._last = now
            self.progress(PullProgress(self.status, self.digest, self.total, self.completed))


def check_projector(path: Path, n_embd: int) -> tuple[bool, bool]:
    """(has a vision encoder, has an audio encoder) of a projector GGUF; refused (one sentence) when it is not a
    projector, or one made for another model width."""
    from backends.gguf_header import read_header

    try:
        fields = read_header(path, tensors=False).fields
    except Exception as e:  # noqa: BLE001 - any unreadable header is the same answer
        raise InvalidModelFileError(f"{path.name} is not a readable GGUF projector ({e}).") from None
    vision, audio = bool(fields.get("clip.has_vision_encoder")), bool(fields.get("clip.has_audio_encoder"))
    if fields.get("general.architecture") != "clip" or not (vision or audio):
        raise InvalidModelFileError(f"{path.name} is not a vision or audio projector (mmproj) GGUF.")
    for kind in ("vision", "audio"):
        width = fields.get(f"clip.{kind}.projection_dim")
        if n_embd and width and int(width) != n_embd:
            raise InvalidModelFileError(f"The projector {path.name} makes {width}-wide embeddings but the model's "
                                        f"are {n_embd} wide: it belongs to another model.")
    return vision, audio


def _derived_of(d: dict[str, Any] | None) -> Modelfile | None:
    """A manifest's ``derived`` block (what ``create`` added) as a :class:`Modelfile` whose FROM is the base."""
    if not d:
        return None
    return Modelfile(from_=str(d.get("base") or ""), parameters=dict(d.get("parameters") or {}),
                     system=d.get("system"), template=d.get("template"),
                     messages=[dict(m) for m in d.get("messages") or []], license=list(d.get("license") or []),
                     adapters=list(d.get("adapters") or []), draft=d.get("draft"))


def layer(base: Modelfile | None, mf: Modelfile) -> Modelfile:
    """``mf`` over what its base already adds (Ollama: a model made FROM a derived model keeps that model's
    system, template, parameters and messages unless the new Modelfile sets them; parameters merge by name).

    >>> old = Modelfile("a", {"temperature": 0.0, "stop": ["x"]}, system="s", messages=[{"role": "user"}])
    >>> new = layer(old, Modelfile("b", {"stop": ["y"]}))
    >>> new.parameters, new.system, len(new.messages)
    ({'temperature': 0.0, 'stop': ['y']}, 's', 1)
    """
    if base is None:
        return mf
    return Modelfile(from_=mf.from_, parameters={**base.parameters, **mf.parameters},
                     system=mf.system if mf.system is not None else base.system,
                     template=mf.template if mf.template is not None else base.template,
                     messages=list(mf.messages or base.messages), license=list(mf.license or base.license),
                     adapters=list(base.adapters) + list(mf.adapters), draft=mf.draft or base.draft)


def _now() -> datetime:
    return datetime.now(UTC)


def _key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:24]
