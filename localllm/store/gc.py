"""Removing a name and collecting what it alone used: its blobs, its weights in other formats (MLX) and its saved prompt
prefixes (under the store lock, so a pull or a create in flight keeps what it needs)."""

from __future__ import annotations

import json
from pathlib import Path

from backends.descriptor import GGUF
from localllm import formats
from localllm.errors import LocalLLMError
from localllm.names import parse_name
from localllm.store.manifests import StoreBase, weights_in
from localllm.store.records import InstalledModel


class Collecting(StoreBase):
    """``rm`` and the garbage collection behind it."""

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
                if self._gc_blob(m.weights_digest):
                    self._gc_prompt_cache(m.weights_digest)
                for a in m.derived.adapters if m.derived is not None else []:
                    self._gc_blob(a.split()[0])
                if m.projector is not None and not m.projector.external:
                    self._gc_blob(m.projector.digest)
                self._gc_formats(m)
        finally:
            lock.release()
        return m.name

    def _gc_prompt_cache(self, digest: str) -> None:
        """Delete the saved prompt prefixes of a model whose file went (``<data>/prompt-cache/<digest>``)."""
        import shutil

        d = self.paths.prompt_cache / digest.removeprefix("sha256:")
        if d.is_dir() and d.resolve().parent == self.paths.prompt_cache.resolve():
            shutil.rmtree(d, ignore_errors=True)

    def _gc_formats(self, m: InstalledModel) -> None:
        """Delete the directories of other formats' weights of a removed model that no other manifest uses (call
        under the store lock): the ones it recorded (fetched) and the ones converted from its GGUF (each format's
        under ``<models>/<format>/``, a conversion's named by the GGUF's digest)."""
        import shutil

        used_paths: set[str] = set()
        used_digests: set[str] = set()
        for p in self._manifest_files():
            try:
                data = json.loads(p.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            used_digests.add(str(data.get("digest")))
            used_paths.update(str(w.path.resolve()) for w in weights_in(data).values())
        hexdigest = m.weights_digest.removeprefix("sha256:").lower()
        for fmt in formats.registered():
            if fmt.name == GGUF:
                continue
            root = (self.paths.models / fmt.name).resolve()
            doomed: list[Path] = []
            if fmt.name in m.weights:
                doomed.append(m.weights[fmt.name].path)
            if m.weights_digest not in used_digests:
                doomed.append(root / hexdigest)
            for d in doomed:
                d = d.resolve()
                if d.parent == root and d.is_dir() and str(d) not in used_paths and not (
                        d.name == hexdigest and m.weights_digest in used_digests):
                    shutil.rmtree(d, ignore_errors=True)
