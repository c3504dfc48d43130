"""A prompt cache on disk: the KV state of long prompt prefixes, kept across processes and restarts.

One directory per model (the caller names it, e.g. by the model's digest). An entry is one file: a
JSON header line (format version, the key, the token ids, the sha256 of the state) and then the state
bytes a token source saved for a sequence holding exactly those tokens. Its name is the sha256 of the
key and the tokens, so a lookup for a prompt is a handful of hashes of its prefixes (one per length
that has an entry).

* **Keyed** by everything the state depends on: the caller's model key (digest, backend) plus the
  source's :meth:`~backends.contract.source.SequenceStates.state_key` (library build, KV type, flash attention...)
  and the exact tokens. Anything else is a miss.
* **Safe**: written to a temporary file and renamed into place (two processes writing the same entry
  both leave a whole file); a truncated, corrupt or mismatched file is detected on read, ignored with one
  log line and removed; a full or read-only disk skips the save. Writes run on a background thread.
* **Bounded**: entries beyond ``max_bytes`` go least recently used first (a hit touches the file).

    >>> import tempfile
    >>> c = PromptCache(tempfile.mkdtemp(), key="model-a kv=f16", max_bytes=1 << 20, min_tokens=2)
    >>> c.save_now([1, 2, 3], b"state")
    True
    >>> c.lookup([1, 2, 3, 4])
    (3, b'state')
    >>> c.lookup([9, 9])
    (0, None)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("backends.core.prompt_cache")

FORMAT = 1
SUFFIX = ".kv"
PIECE = 4 << 20  # bytes hashed or written between two looks at whether the model decodes
BACKLOG = 1 << 30  # bytes waiting to be written beyond which the writer stops yielding to the model


@dataclass(frozen=True)
class PromptCacheSpec:
    """Where and how a loaded model keeps its prompt cache (the loop adds the source's ``state_key``)."""

    root: str  # the model's directory of entries
    model_key: str  # what names the weights (digest) and the backend
    max_bytes: int = 2 << 30
    min_tokens: int = 512
    budget_root: str | None = None  # the tree ``max_bytes`` bounds (all models' entries); None = ``root``
    idle_s: float = 2.0  # the model idle this long, the loop copies the prefixes it owes out of the pool


@dataclass
class CacheStats:
    entries: int = 0
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    saves: int = 0
    save_errors: int = 0
    restored_tokens: int = 0


class PromptCache:
    """Entries under ``root`` for one model (``key`` says which model and how it is loaded)."""

    def __init__(self, root: str | os.PathLike[str], *, key: str, max_bytes: int, min_tokens: int = 512,
                 budget_root: str | os.PathLike[str] | None = None):
        self.root = Path(root)
        self.budget_root = Path(budget_root) if budget_root is not None else self.root
        self.key = key
        self.max_bytes = max_bytes
        self.min_tokens = max(1, min_tokens)
        self.stats = CacheStats()
        self._lock = threading.Lock()
        self._lengths: dict[int, int] = {}  # token count -> entries with that count (for lookups)
        self._jobs: queue.SimpleQueue[tuple[list[int], bytes] | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._pending: dict[str, tuple[list[int], bytes]] = {}  # queued for the writer: name -> (tokens, state)
        self._pending_bytes = 0
        self._quiet = threading.Event()  # set while the model is not decoding: the writer works only then
        self._quiet.set()
        self._hurry = False  # flush() and close(): write without yielding
        self.before_flush: Callable[[], None] | None = None  # the loop's: copy out what it still owes
        self._scan()

    # ------------------------------------------------------------------ names

    def _name(self, tokens: list[int]) -> str:
        h = hashlib.sha256(self.key.encode())
        h.update(b"\0")
        h.update(len(tokens).to_bytes(4, "little"))
        h.update(b"".join(t.to_bytes(4, "little", signed=True) for t in tokens))
        return h.hexdigest()[:40]

    def _path(self, tokens: list[int]) -> Path:
        return self.root / f"{len(tokens):07d}-{self._name(tokens)}{SUFFIX}"

    def _scan(self) -> None:
        """Count the entries on disk (those of every key: the directory's size bound is shared)."""
        lengths: dict[int, int] = {}
        n = size = 0
        try:
            for p in self.root.glob(f"*{SUFFIX}"):
                try:
                    length = int(p.name.split("-", 1)[0])
                    size += p.stat().st_size
                except (ValueError, OSError):
                    continue
                lengths[length] = lengths.get(length, 0) + 1
                n += 1
        except OSError:
            pass
        with self._lock:
            self._lengths = lengths
            self.stats.entries, self.stats.bytes = n, size

    # ------------------------------------------------------------------ read

    def wants(self, n_tokens: int) -> bool:
        return self.max_bytes > 0 and n_tokens >= self.min_tokens

    def has(self, tokens: list[int]) -> bool:
        return self._name(tokens) in self._pending or self._path(tokens).is_file()

    def lookup(self, prompt: list[int], *, max_len: int | None = None, min_len: int = 0) -> tuple[int, bytes | None]:
        """(tokens, state) of the longest entry whose tokens start ``prompt`` (at most ``max_len``, at least
        ``min_len``: what the caller already holds is not read and checked again), or (0, None). A bad entry is
        removed and the next shorter one tried."""
        if self.max_bytes <= 0:
            return 0, None
        limit = len(prompt) if max_len is None else min(max_len, len(prompt))
        low = max(self.min_tokens, min_len)
        with self._lock:
            lengths = sorted((n for n in self._lengths if low <= n <= limit), reverse=True)
            queued = max(((t, d) for t, d in self._pending.values() if low <= len(t) <= limit and prompt[:len(t)] == t),
                         key=lambda e: len(e[0]), default=None)  # not written yet (an evicted sequence's, just now)
        for n in lengths:
            if queued is not None and n <= len(queued[0]):
                break
            path = self._path(prompt[:n])
            if not path.is_file():
                continue
            data = self._read(path, prompt[:n])
            if data is not None:
                self.stats.hits += 1
                try:
                    os.utime(path)  # least recently used goes first
                except OSError:
                    pass
                return n, data
        if queued is not None:
            self.stats.hits += 1
            return len(queued[0]), queued[1]
        self.stats.misses += 1
        return 0, None

    def _read(self, path: Path, tokens: list[int]) -> bytes | None:
        try:
            with open(path, "rb") as f:
                head = json.loads(f.readline())
                data = f.read()
        except (OSError, ValueError) as e:
            self.discard(path, f"unreadable ({e.__class__.__name__})")
            return None
        if not isinstance(head, dict) or head.get("format") != FORMAT:
            self.discard(path, "unknown format")
        elif head.get("key") != self.key or head.get("tokens") != tokens:
            self.discard(path, "made for another model, build or KV type")
        elif head.get("size") != len(data) or head.get("sha256") != hashlib.sha256(data).hexdigest():
            self.discard(path, "truncated or corrupt")
        else:
            return data
        return None

    def remove(self, tokens: list[int], why: str) -> None:
        """Remove the entry of ``tokens`` (one its reader refused), with one log line."""
        self.discard(self._path(tokens), why)

    def discard(self, path: Path, why: str) -> None:
        """Remove a bad entry, with one log line."""
        log.warning("prompt cache: removed %s (%s)", path.name, why)
        try:
            size = path.stat().st_size
            path.unlink()
        except OSError:
            return
        with self._lock:
            self.stats.entries -= 1
            self.stats.bytes -= size

    # ------------------------------------------------------------------ write

    def save(self, tokens: list[int], state: bytes) -> None:
        """Write an entry on the background thread (never blocks the caller). The thread hashes and writes in
        pieces and waits between them while the model decodes (:meth:`decoding`), unless more than
        ``BACKLOG`` bytes wait."""
        if self.max_bytes <= 0 or len(state) > self.max_bytes:
            return
        name = self._name(tokens)
        with self._lock:
            if name in self._pending:
                return
            self._pending[name] = (list(tokens), state)
            self._pending_bytes += len(state)
            if self._writer is None or not self._writer.is_alive():
                self._writer = threading.Thread(target=self._write_loop, name="localllm-prompt-cache", daemon=True)
                self._writer.start()
        self._jobs.put((list(tokens), state))

    def decoding(self, busy: bool) -> None:
        """The model's loop says whether it is running requests now: the writer yields to them."""
        if busy:
            self._quiet.clear()
        else:
            self._quiet.set()

    def _yield(self) -> None:
        """Between two pieces of a background write: wait while the model decodes (not when flushing, and not
        with a backlog of more than ``BACKLOG`` bytes: memory is bounded)."""
        while not self._hurry and self._pending_bytes <= BACKLOG and not self._quiet.wait(0.25):
            pass

    def _write_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            tokens, state = job
            try:
                self.save_now(tokens, state, polite=True)
            finally:
                with self._lock:
                    self._pending.pop(self._name(tokens), None)
                    self._pending_bytes -= len(state)

    def save_now(self, tokens: list[int], state: bytes, *, polite: bool = False) -> bool:
        """Write an entry now (atomically); False when the disk would not take it. ``polite``: hash and write in
        pieces of ``PIECE`` bytes, yielding to the model's decoding between them."""
        path = self._path(tokens)
        view = memoryview(state).cast("B")
        h = hashlib.sha256()
        for i in range(0, len(view), PIECE):
            if polite:
                self._yield()
            h.update(view[i:i + PIECE])
        head = json.dumps({"format": FORMAT, "key": self.key, "tokens": tokens, "size": len(view),
                           "sha256": h.hexdigest(), "created": time.time()})
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._make_room(len(view) + len(head) + 1)
            with open(tmp, "wb") as f:
                f.write(head.encode() + b"\n")
                for i in range(0, len(view), PIECE):
                    if polite:
                        self._yield()
                    f.write(view[i:i + PIECE])
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            self.stats.save_errors += 1
            log.warning("prompt cache: not saved (%s)", e.strerror or e)
            try:
                tmp.unlink()
            except OSError:
                pass
            return False
        self.stats.saves += 1
        self._scan()
        return True

    def _make_room(self, need: int) -> None:
        """Delete the least recently used entries (of every model under ``budget_root``) until ``need``
        more bytes fit ``max_bytes``."""
        entries = []
        for p in self.budget_root.rglob(f"*{SUFFIX}"):
            try:
                st = p.stat()
            except OSError:
                continue
            entries.append((st.st_mtime, st.st_size, p))
        total = sum(e[1] for e in entries)
        for _, size, p in sorted(entries):
            if total + need <= self.max_bytes:
                break
            try:
                p.unlink()
                total -= size
            except OSError:
                pass

    def flush(self, timeout: float = 30.0) -> None:
        """Have the loop save what it owes (:attr:`before_flush`) and wait for every write (tests, shutdown)."""
        if self.before_flush is not None:
            self.before_flush()
        self._hurry = True
        try:
            t0 = time.monotonic()
            while self._pending and time.monotonic() - t0 < timeout:
                time.sleep(0.01)
        finally:
            self._hurry = False

    def clear(self) -> int:
        """Delete every entry in the directory; returns how many."""
        n = 0
        for p in self.root.glob(f"*{SUFFIX}"):
            try:
                p.unlink()
                n += 1
            except OSError:
                pass
        self._scan()
        return n

    def close(self) -> None:
        self.flush()
        self._jobs.put(None)
