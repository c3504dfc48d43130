"""Fetch a catalog model's MLX weights (``mlx_repo``) from the Hugging Face Hub, verified (store-private).

The store calls :func:`fetch_mlx` after the GGUF of a model is installed, on Apple Silicon or when asked::

    snap = fetch_mlx("mlx-community/SmolLM2-135M-Instruct", revision=None, staging=..., target=...)
    snap.revision, snap.path, snap.size       # the commit fetched, the MLX directory, its bytes

1. one request for the repo's file list with sizes and hashes (``model_info(files_metadata=True)``, within
   ``LOCALLLM_HF_TIMEOUT`` seconds: an unreachable Hub fails fast with one sentence);
2. the safetensors, config and tokenizer files only (:data:`ALLOW_PATTERNS`) at that commit, fetched from
   the Hub's ``resolve`` URLs into a staging folder under the downloads dir with the store's own fetch
   (HTTP Range resume, sha256 while downloading, ``HF_TOKEN``), so a killed pull continues where it
   stopped. (huggingface_hub 2.x's ``snapshot_download`` writes each file to a process-unique temporary
   name that is deleted on failure, so it cannot resume a file; it is used for the Hugging Face cache.);
3. every file is checked against the Hub's hashes (sha256 of LFS files, the git blob sha1 of the others);
4. the staging folder becomes the MLX directory with one rename: nothing half-fetched is ever a model.

A snapshot already complete in the Hugging Face cache is hard-linked (copied across file systems), not
downloaded again. Errors are :class:`~localllm.errors.PullError` subclasses with one sentence.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from localllm import download as dl
from localllm.errors import SourceUnavailable

ALLOW_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
                  "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                  "added_tokens.json", "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt"]


@dataclass(frozen=True)
class HubFile:
    path: str
    size: int
    sha256: str | None  # LFS files: the content's sha256
    blob_id: str | None  # others: the git blob sha1


@dataclass(frozen=True)
class MLXSnapshot:
    repo: str
    revision: str  # the commit sha
    path: Path
    size: int
    files: int


def wanted(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return "/" not in path and any(fnmatch.fnmatch(name, p) for p in ALLOW_PATTERNS)


def git_blob_sha1(path: Path) -> str:
    """The git object id of a file (how the Hub names a non-LFS file's content)."""
    h = hashlib.sha1(usedforsecurity=False)
    h.update(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def hub_listing(repo: str, revision: str | None) -> tuple[str, list[HubFile]]:
    """(commit sha, the MLX files with their sizes and hashes) of ``repo`` at ``revision``."""
    info = dl.hf_model_info(repo, revision, offline_what=f"the MLX weights of {repo}")
    files = [HubFile(s.rfilename, int((s.lfs.size if s.lfs else None) or s.size or 0),
                     s.lfs.sha256 if s.lfs else None, s.blob_id)
             for s in (info.siblings or []) if wanted(s.rfilename)]
    names = {f.path for f in files}
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        raise SourceUnavailable(f"Hugging Face repo {repo} holds no MLX weights (config.json and *.safetensors).")
    if not info.sha:
        raise SourceUnavailable(f"Hugging Face did not say which commit of {repo} it serves.")
    return info.sha, files


def _cached_snapshot(repo: str, revision: str | None) -> Path | None:
    """A complete snapshot of ``repo`` in the Hugging Face cache, without asking the Hub."""
    from huggingface_hub import snapshot_download

    try:
        p = Path(snapshot_download(repo, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                   cache_dir=dl.hf_cache_dir(), local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached (or a broken cache entry): download instead
        return None
    from backends.mlx.convert import is_mlx_dir

    return p if is_mlx_dir(p) else None


def _link_tree(src: Path, dst: Path) -> None:
    """Hard-link the files of ``src`` (a Hugging Face snapshot of symlinks to blobs) into ``dst``."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if not f.is_file():
            continue
        real = Path(os.path.realpath(f))
        target = dst / f.name
        target.unlink(missing_ok=True)
        try:
            os.link(real, target)
        except OSError:
            shutil.copyfile(real, target)


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            try:
                total += os.stat(os.path.join(dirpath, n)).st_size
            except OSError:
                pass
    return total


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def verify(staging: Path, files: list[HubFile], repo: str) -> None:
    """Every file against the Hub's size and hash; a bad one is removed (the next pull fetches it again)."""
    from localllm.download import CorruptDownload

    for f in files:
        p = staging / f.path
        if not p.is_file():
            raise SourceUnavailable(f"{repo}/{f.path} did not arrive; run the pull again to resume.")
        ok = p.stat().st_size == f.size
        if ok and f.sha256:
            ok = dl.sha256_file(p) == f.sha256.lower()
        elif ok and f.blob_id:
            ok = git_blob_sha1(p) == f.blob_id.lower()
        if not ok:
            p.unlink(missing_ok=True)
            raise CorruptDownload(f"{repo}/{f.path} does not match the Hub's hash; it was removed, run the pull "
                                  f"again.")


def fetch_mlx(repo: str, *, revision: str | None, staging_root: Path, target_for: Callable[[str], Path],
              on_start: Callable[[str, int], None] | None = None, on_bytes: Callable[[int], None] | None = None,
              cancel: threading.Event | None = None) -> MLXSnapshot:
    """Fetch ``repo``'s MLX files at ``revision`` (None: the default branch) into ``target_for(sha)``.

    ``on_start(sha, total_bytes)`` once the listing is known; ``on_bytes(n)`` as bytes arrive (the bytes
    already fetched by an interrupted pull first). Raises ``SourceUnavailable`` (Hub unreachable, repo
    without MLX weights, download broke off: the staging folder stays for a resume), ``CorruptDownload``
    (a file fails its hash: removed), ``DiskFull`` or ``PullCancelled`` (the partial stays).
    """
    from backends.mlx.convert import is_mlx_dir

    try:
        sha, files = hub_listing(repo, revision)
    except SourceUnavailable:
        cached = _cached_snapshot(repo, revision)
        if cached is None:
            raise
        target = target_for(cached.name)
        if not is_mlx_dir(target):
            staging = staging_root / f"mlx-{hashlib.sha256((repo + cached.name).encode()).hexdigest()[:24]}"
            shutil.rmtree(staging, ignore_errors=True)
            _link_tree(cached, staging)
            dl.move_into_place(staging, target)
        return MLXSnapshot(repo, cached.name, target, _tree_bytes(target), sum(1 for _ in target.iterdir()))

    target = target_for(sha)
    total = sum(f.size for f in files)
    if on_start:
        on_start(sha, total)
    if is_mlx_dir(target):  # another name installed this snapshot already
        if on_bytes:
            on_bytes(total)
        return MLXSnapshot(repo, sha, target, _tree_bytes(target), len(files))
    staging = staging_root / f"mlx-{hashlib.sha256((repo + sha).encode()).hexdigest()[:24]}"
    cached = _cached_snapshot(repo, sha)
    if cached is not None:
        shutil.rmtree(staging, ignore_errors=True)
        _link_tree(cached, staging)
    staging.mkdir(parents=True, exist_ok=True)
    have = sum(min(_size(staging / f.path) or _size(staging / f"{f.path}.partial"), f.size) for f in files)
    dl.check_free_space(staging_root, max(total - have, 0), repo)
    token = dl.hf_token()
    headers = {"Authorization": f"Bearer {token}"} if token else None
    from urllib.parse import quote

    with dl.http_client() as client:
        for f in sorted(files, key=lambda f: f.size):  # the small files first: a missing one fails fast
            dest = staging / f.path
            if dest.is_file() and dest.stat().st_size == f.size:
                if on_bytes:
                    on_bytes(f.size)
                continue
            partial = staging / f"{f.path}.partial"
            url = f"{dl.hf_endpoint()}/{repo}/resolve/{sha}/{quote(f.path)}"
            dl.fetch(client, url, partial, size=f.size, sha256=f.sha256, on_bytes=on_bytes or (lambda n: None),
                     what=f"{repo}/{f.path}", cancel=cancel, headers=headers)
            os.replace(partial, dest)
    dl._check_cancel(cancel, repo)
    verify(staging, files, repo)
    dl.move_into_place(staging, target)
    return MLXSnapshot(repo, sha, target, total, len(files))
