"""Creating a model from a Modelfile: a derived model over an installed, pulled, imported or uploaded GGUF,
with its own quantization (llama.cpp's quantizer) and LoRA adapters checked against its weights; blob uploads."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from localllm.errors import InvalidModelFileError, LocalLLMError, ModelNotFoundError
from localllm.formats import Weights
from localllm.modelfile import Modelfile, check_parameters, check_template
from localllm.names import parse_name
from localllm.store.manifests import weights_in, write_weights
from localllm.store.pull import Pulling
from localllm.store.records import MANIFEST_SCHEMA, InstalledModel, ProgressFn, _now, _Reporter, layer


class Creating(Pulling):
    """``create`` (``/api/create``) and ``/api/blobs`` uploads."""

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
        projector = self._projector_file(mf.projector) if mf.projector else None
        try:
            data, derived = self._create_parts(mf, src, params, template, rep, progress, cancel, quantize, requantize)
            if projector is not None:  # refused before anything is registered
                from localllm.store.records import check_projector

                rep.phase(f"checking projector {projector.name}")
                check_projector(projector, int((data.get("info") or {}).get("n_embd") or 0))
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
            if old is not None and old.weights_digest != data["digest"]:
                self._gc_blob(old.weights_digest)
            for a in old.derived.adapters if old is not None and old.derived is not None else []:
                self._gc_blob(a.split()[0])
        out = self._read_manifest(self._manifest_path(dref))
        assert out is not None
        if projector is not None:
            rep.phase(f"adding projector {projector.name}")
            out = self.set_projector(dref.name, projector)
        elif parse_name(src, allow_path=True).kind == "path" and out.projector is None:
            from localllm.store.records import projector_beside

            proj = projector_beside(Path(src).expanduser())  # as `run ./model.gguf` takes it
            if proj is not None:
                rep.phase(f"adding projector {proj.name}")
                try:
                    out = self.set_projector(dref.name, proj)
                except InvalidModelFileError as e:  # the model is fine: made without it, and said why
                    rep.phase(f"projector not added: {e}")
        rep.phase("success")
        return self._with_formats(out)

    def _projector_file(self, spec: str) -> Path:
        """A ``PROJECTOR``'s file: an uploaded blob ``sha256:<hex>`` or a path; one sentence when it is not there."""
        import re

        m = re.fullmatch(r"sha256[:-]([0-9a-fA-F]{64})", spec.strip())
        path = self.blob_path(m.group(1).lower()) if m else Path(spec).expanduser()
        if not path.is_file():
            raise LocalLLMError(f"The projector {spec} is not a file" + (" (upload it to /api/blobs first)." if m
                                                                          else "."))
        return path

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
            rep.phase("verifying sha256 digest")
            self._check_blob(self.blob_path(hexdigest), hexdigest, f"The blob sha256:{hexdigest[:12]}",
                             "upload it again")
            rep.phase("parsing GGUF")
            data = self._blob_data(hexdigest, f"blob sha256:{hexdigest[:12]}")
        elif parse_name(src, allow_path=True).kind == "path":
            data = self._import_gguf(Path(src).expanduser(), rep, cancel)
        else:
            base = self.ensure(src, progress=progress, cancel=cancel)
            rep.phase("verifying sha256 digest")
            self._check_blob(base.path, base.weights_digest, f"{base.name}'s file {base.path}",
                             f"pull or create {base.name} again")
            found = self._find(parse_name(base.name, allow_path=False))
            assert found is not None
            data = json.loads(self._manifest_path(found[0]).read_text(encoding="utf-8"))
            # its other formats' builds go with the same weights; where they were fetched from stays the base's record
            write_weights(data, {k: Weights(k, w.path) for k, w in weights_in(data).items()})
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
        if m:
            self._check_blob(path, hexdigest, f"The adapter {label}", "upload it again")
        if not m and not self.blob_path(hexdigest).is_file():
            self._copy_into_blobs(path, hexdigest, rep)
        return f"sha256:{hexdigest} {scale:g}"

    def _quantize(self, data: dict[str, Any], type_name: str, requantize: bool, rep: _Reporter,
                  what: str) -> dict[str, Any]:
        """The manifest fields of ``data``'s weights quantized to ``type_name`` (a new blob)."""
        from backends.contract.errors import BackendError
        from backends.llamacpp.quantize import canonical_type, planned_size, quantize
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

    def write_blob(self, digest: str, chunks: Iterator[bytes], *, limit: int | None = None,
                   size: int | None = None) -> bool:
        """Store an upload (``POST /api/blobs/:digest``) under its digest: written beside the blobs, its sha256
        checked, then renamed into ``blobs/`` (so a cut upload or a wrong one leaves nothing). The digest is
        the caller's checked ``sha256:<64 hex>``: the file name is made from it, never from the client's text.
        True when it was written, False when the blob was there already; a mismatch raises
        :class:`LocalLLMError` with Ollama's words. ``limit`` and ``size``: as :meth:`begin_upload`."""
        upload = self.begin_upload(digest, size=size, limit=limit)
        try:
            for chunk in chunks:
                upload.write(chunk)
            return upload.finish()
        finally:
            upload.close()

    def begin_upload(self, digest: str, *, size: int | None = None, limit: int | None = None) -> BlobUpload:
        """An upload of the blob ``digest`` in progress (see :class:`BlobUpload`): ``size`` is the length the
        client announced (checked against ``limit`` and the free disk space first), ``limit`` the most bytes it
        may have (:class:`UploadTooLarge` beyond). Partial uploads a dead process left behind are removed."""
        hexdigest = digest.removeprefix("sha256:").lower()
        if len(hexdigest) != 64 or any(c not in "0123456789abcdef" for c in hexdigest):
            raise LocalLLMError(f"invalid digest {digest[:80]!r}")
        if limit is not None and size is not None and size > limit:
            raise UploadTooLarge(upload_too_large(limit))
        self.paths.downloads.mkdir(parents=True, exist_ok=True)
        remove_dead_partials(self.paths.downloads, "upload-")
        if size:
            check_upload_space(self.paths.downloads, self.paths.blobs, size)
        return BlobUpload(self, hexdigest, limit)

    def _blob_data(self, hexdigest: str, source: str) -> dict[str, Any]:
        """A new manifest's fields for the GGUF blob ``hexdigest`` (validated: a file that is not a usable GGUF
        is refused in one sentence, before anything is registered)."""
        from localllm.ggufinfo import check_gguf_file, read_gguf

        file = self.blob_path(hexdigest)
        check_gguf_file(file)
        info = read_gguf(file, digest="sha256:" + hexdigest)
        return {"schema": MANIFEST_SCHEMA, "digest": "sha256:" + hexdigest, "size": file.stat().st_size,
                "external": False, "path": str(file), "source": source, "quant": info.file_type, "catalog": None,
                "info": info.as_dict(), "weights": {}}

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


UPLOAD_RESERVE = 256 << 20  # an upload never takes the last 256 MiB of a disk


class UploadTooLarge(LocalLLMError):
    """An upload over the store's limit (``LOCALLLM_MAX_UPLOAD``); what it wrote was removed."""


def upload_too_large(limit: int) -> str:
    from localllm.download import fmt_bytes

    return (f"the upload is larger than this server takes ({fmt_bytes(limit)}, LOCALLLM_MAX_UPLOAD); nothing was "
            f"kept")


def _disk_full(free: int) -> str:
    from localllm.download import fmt_bytes

    return f"not enough disk space for the upload ({fmt_bytes(free)} free); nothing was kept"


def check_upload_space(downloads: Path, blobs: Path, size: int) -> None:
    """Raise :class:`~localllm.download.DiskFull` unless ``size`` bytes fit beside the downloads (and in the
    blobs, where they are another file system) with :data:`UPLOAD_RESERVE` to spare."""
    from localllm.download import DiskFull

    dirs = [downloads]
    blobs.mkdir(parents=True, exist_ok=True)
    if blobs.stat().st_dev != downloads.stat().st_dev:
        dirs.append(blobs)
    for d in dirs:
        free = shutil.disk_usage(d).free
        if size + UPLOAD_RESERVE > free:
            raise DiskFull(_disk_full(free))


def remove_dead_partials(directory: Path, prefix: str) -> None:
    """Remove ``<prefix>*.<pid>.*.partial`` files whose process is gone (a killed server's uploads)."""
    for old in directory.glob(f"{prefix}*.partial"):
        parts = old.name.split(".")
        try:
            pid = int(parts[1])
            if pid == os.getpid():
                continue
            os.kill(pid, 0)
        except (ValueError, IndexError, ProcessLookupError):
            old.unlink(missing_ok=True)
        except PermissionError:
            pass


class BlobUpload:
    """One upload to ``/api/blobs``: :meth:`write` each chunk as it arrives (blocking: off the event loop), then
    :meth:`finish` (sha256 checked, renamed into ``blobs/``); :meth:`close` always, which removes what an upload
    that did not finish (cut, stalled, too large, wrong digest) wrote. The partial file's name carries the pid,
    so a killed server's partials are removed by the next upload."""

    _ids = iter(range(1, 1 << 62))

    def __init__(self, store: Creating, hexdigest: str, limit: int | None):
        self.store = store
        self.hexdigest = hexdigest
        self.limit = limit
        self.size = 0
        self.done = False
        self._hash = hashlib.sha256()
        self.tmp = store.paths.downloads / f"upload-{hexdigest}.{os.getpid()}.{next(self._ids)}.partial"
        self._fh: Any = open(self.tmp, "wb")  # noqa: SIM115 - closed by close()

    def write(self, chunk: bytes) -> None:
        """Hash and write ``chunk``: :class:`UploadTooLarge` past the limit, DiskFull when the disk fills."""
        from localllm.download import DiskFull

        self.size += len(chunk)
        if self.limit is not None and self.size > self.limit:
            raise UploadTooLarge(upload_too_large(self.limit))
        self._hash.update(chunk)
        free = shutil.disk_usage(self.tmp.parent).free
        if free < len(chunk) + UPLOAD_RESERVE:
            raise DiskFull(_disk_full(free))
        try:
            self._fh.write(chunk)
        except OSError as e:  # a full disk: nothing is kept
            raise DiskFull(f"could not store the upload: {e.strerror or e}; nothing was kept") from None

    def finish(self) -> bool:
        """The upload is whole: True when it was stored, False when the blob was there already; a body whose
        sha256 is another digest raises :class:`LocalLLMError` in Ollama's words."""
        self._fh.close()
        got = self._hash.hexdigest()
        if got != self.hexdigest:
            raise LocalLLMError(f"digest mismatch, expected \"sha256:{self.hexdigest}\", got \"sha256:{got}\"")
        self.done = True
        if self.store.blob_path(self.hexdigest).is_file():
            return False
        self.store._install_blob(self.tmp, self.hexdigest)
        return True

    def close(self) -> None:
        """Close the file and remove the partial (nothing once :meth:`finish` installed it)."""
        try:
            self._fh.close()
        finally:
            self.tmp.unlink(missing_ok=True)
