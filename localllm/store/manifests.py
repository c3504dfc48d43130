"""The store's layout, its locks and its manifests: reading, writing and finding installed names, local
``.gguf`` files used in place, and the blobs (installed with a rename, freed when no manifest uses them)."""

from __future__ import annotations

import difflib
import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from backends.descriptor import GGUF, MLX
from localllm import formats
from localllm.catalog import Catalog
from localllm.config import Paths
from localllm.config import paths as default_paths
from localllm.errors import InvalidModelFileError, LocalLLMError, ModelNotFoundError
from localllm.formats import Weights
from localllm.names import ModelRef, parse_name
from localllm.store.records import (
    MANIFEST_SCHEMA,
    InstalledModel,
    Projector,
    _derived_of,
    _key,
    _now,
    check_projector,
    projector_beside,
)


def weights_in(data: dict[str, Any]) -> dict[str, Weights]:
    """A manifest's weights in formats other than the GGUF: its ``weights`` block, or what a schema-1 manifest
    kept as ``mlx_path`` (a converted or fetched MLX directory) and ``mlx`` (where it was fetched from)."""
    out = {str(k): Weights.of_record(str(k), d) for k, d in (data.get("weights") or {}).items() if d and d.get("path")}
    if MLX not in out and data.get("mlx_path"):
        out[MLX] = Weights.of_record(MLX, {**(data.get(MLX) or {}), "path": data["mlx_path"]})
    return out


def write_weights(data: dict[str, Any], weights: dict[str, Weights]) -> None:
    """Put ``weights`` in manifest ``data`` as its ``weights`` block (a schema-1 manifest is rewritten as schema 2)."""
    data.pop("mlx_path", None)
    data.pop(MLX, None)
    data["weights"] = {k: w.as_record() for k, w in weights.items()}
    data["schema"] = MANIFEST_SCHEMA


class StoreBase:
    """Layout, locks, manifests and lookups: what every store operation stands on."""

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
                weights_digest=data["digest"],
                path=file,
                size=int(data["size"]),
                modified=datetime.fromisoformat(data["modified"]),
                info=data.get("info") or {},
                source=data.get("source", ""),
                local=False,
                catalog=entry,
                quant=data.get("quant"),
                weights=weights_in(data),
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
        from localllm.download import fsync_dir

        path = self._manifest_path(ref)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "w", encoding="utf-8") as fh:  # on the disk before the rename: a crash leaves old or new
            fh.write(json.dumps(data, indent=1, sort_keys=True))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
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
            return self._with_formats(self._local(ref.path))
        found = self._find(ref)
        if found is None:
            raise self._not_installed(ref)
        m = found[1]
        if not self._intact(m):
            raise ModelNotFoundError(
                f"{m.name}'s file is missing or incomplete; run `localllm pull {m.name}` to fetch it again."
            )
        return self._with_formats(m)

    def _with_formats(self, m: InstalledModel) -> InstalledModel:
        """Drop the recorded weights of other formats that are gone, and fill in what each registered format finds
        under the models dir for this GGUF (an MLX conversion lives by the GGUF's digest)."""
        for fmt in formats.registered():
            w = m.weights.get(fmt.name)
            if fmt.name == GGUF or (w is not None and w.path.exists()):
                continue
            found = fmt.find(self.paths.models, m.weights_digest)
            if found is None:
                m.weights.pop(fmt.name, None)
            else:
                m.weights[fmt.name] = Weights(fmt.name, found)
        return m

    def list(self) -> list[InstalledModel]:
        """Installed models whose file is present, newest first."""
        models = [m for p in self._manifest_files() if (m := self._read_manifest(p)) is not None]
        models = [self._with_formats(m) for m in models if self._intact(m)]
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
            weights_digest=digest,
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

    def _install_blob(self, tmp: Path, hexdigest: str) -> Path:
        """Move a verified file into ``blobs/`` atomically (a rename; copy + rename across devices)."""
        from localllm import download as dl

        target = self.blob_path(hexdigest)
        with self._store_lock():
            dl.move_into_place(tmp, target)  # a blob already there is the same content: it is kept
        return target

    def _digest_ok(self, path: Path, digest: str, on_bytes: Any = None) -> bool:
        """Whether ``path`` hashes to ``digest`` (``sha256:<hex>`` or ``<hex>``); False when it cannot be read."""
        from localllm.download import sha256_file

        try:
            return sha256_file(path, on_bytes) == digest.removeprefix("sha256:").lower()
        except OSError:
            return False

    def _check_blob(self, path: Path, digest: str, what: str, fix: str) -> None:
        """Raise :class:`InvalidModelFileError` (one sentence: ``what`` is corrupt, ``fix``) unless ``path`` hashes to
        ``digest``: a file renamed into place whole may still have been damaged since (a crash before its bytes
        reached the disk, a bad sector, an edit in place)."""
        if not self._digest_ok(path, digest):
            digest = "sha256:" + digest.removeprefix("sha256:")
            raise InvalidModelFileError(f"{what} is corrupt: its bytes no longer hash to {digest[:19]}...; {fix}.")

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

    def copy(self, src: str, dst: str, *, replace: bool = True) -> InstalledModel:
        """Install ``dst`` as another name for ``src``'s file (no bytes copied). An existing ``dst`` is replaced (as
        Ollama's ``/api/copy`` does) unless ``replace`` is False: then it is refused in one sentence (the CLI's
        default; ``localllm cp --force`` replaces)."""
        sref = parse_name(src, allow_path=False)
        dref = parse_name(dst, allow_path=False)
        m = self.get(sref.name)
        data = json.loads(self._manifest_path(self._find(sref)[0]).read_text(encoding="utf-8"))  # type: ignore[index]
        now = _now().isoformat()
        data.update(name=dref.name, created=now, modified=now, source=f"copy of {m.name}")
        with self._store_lock():
            if not replace and (there := self._find(dref)) is not None:
                raise LocalLLMError(f"{there[1].name} exists already; remove it first, or copy with --force to "
                                    "replace it.")
            old = self._read_manifest(self._manifest_path(dref))
            self._write_manifest(dref, data)
            if old is not None:  # what the replaced name alone used is freed
                for digest in [old.weights_digest, *(a.split()[0] for a in (old.derived.adapters if old.derived
                                                                             else [])),
                               *([old.projector.digest] if old.projector and not old.projector.external else [])]:
                    self._gc_blob(digest)
        out = self._read_manifest(self._manifest_path(dref))
        assert out is not None
        return out

    def set_weights(self, name: str, fmt: str, weights: Weights | None) -> InstalledModel:
        """Record (or clear, with None) the weights in format ``fmt`` that go with installed ``name`` (a conversion's
        directory, a fetched snapshot)."""
        ref = parse_name(name, allow_path=False)
        found = self._find(ref)
        if found is None:
            raise self._not_installed(ref)
        path = self._manifest_path(found[0])
        with self._store_lock():
            data = json.loads(path.read_text(encoding="utf-8"))
            have = weights_in(data)
            if weights is None:
                have.pop(fmt, None)
            else:
                have[fmt] = weights
            write_weights(data, have)
            self._write_manifest(found[0], data)
        out = self._read_manifest(path)
        assert out is not None
        return out
