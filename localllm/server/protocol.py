"""The engine as the server uses it: :class:`ServerEngine`, the one interface :func:`~localllm.server.app.create_app`,
the translators and ``/metrics`` are typed against (:class:`localllm.engine.Engine` is the one in use; a test may
hand in another), the store behind it, and :func:`run_sync` for the blocking calls.

It is not :class:`localllm.api.Runner`: the faces' runner answers with ``api.Loaded`` summaries, while the server
reads what a loaded model is doing now (its decode loop's slots, its load time) for ``/api/ps`` and ``/metrics``.

Blocking work runs on bounded thread pools of its own kind (:data:`POOLS`), never on the event loop's one small
default pool: so slow loads, long reranks or many uploads wait for their own kind and ``/api/tags`` still answers."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from fastapi import Request

if TYPE_CHECKING:
    from localllm.api import Event, GenerateRequest, Pooled, Stats
    from localllm.loader import LoadOptions
    from localllm.residency import Resident
    from localllm.store import InstalledModel, Store

T = TypeVar("T")


class ServerEngine(Protocol):
    """Loaded models (load on demand, keep-alive, a bounded queue) and the store of installed ones."""

    @property
    def store(self) -> Store: ...

    @property
    def observers(self) -> list[Callable[[str, Stats], None]]:
        """Called with (model, stats) as each generation ends (``/metrics``' histograms)."""
        ...

    @property
    def pending(self) -> int:
        """Requests waiting for a load or a slot."""
        ...

    def agenerate(self, name: str, request: GenerateRequest, options: LoadOptions | None = None, *,
                  cancel: threading.Event | None = None, keep_alive: float | None = None,
                  installed: InstalledModel | None = None) -> AsyncGenerator[Event, None]:
        """``installed``: ``name`` as the server read it from the store (a load does not read it again)."""
        ...

    def load(self, name: str, options: LoadOptions | None = None, *,
             keep_alive: float | None = None) -> Resident: ...

    def unload(self, name: str) -> bool: ...

    def embed(self, name: str, texts: list[str], options: LoadOptions | None = None, *,
              keep_alive: float | None = None) -> list[list[float]]: ...

    def embed_many(self, name: str, texts: list[str], options: LoadOptions | None = None, *,
                   keep_alive: float | None = None, truncate: bool = True,
                   cancel: threading.Event | None = None) -> Pooled: ...

    def rerank(self, name: str, query: str, documents: list[str], options: LoadOptions | None = None, *,
               keep_alive: float | None = None, truncate: bool = True,
               cancel: threading.Event | None = None) -> Pooled: ...

    def tokenize(self, name: str, text: str, images: list[bytes] | None = None) -> list[int]: ...

    def ps(self) -> list[Resident]: ...

    def is_loaded(self, name: str) -> bool: ...

    def cancel_all(self) -> None: ...

    def close(self, timeout: float | None = None) -> None: ...


def engine_of(http: Request) -> ServerEngine:
    """The app's engine."""
    return http.app.state.engine  # type: ignore[no-any-return]


Pool = Literal["store", "upload", "load", "work"]
# threads per kind of blocking work: store reads and writes (list, get, copy, rm: short), blob upload writes (a
# chunk at a time: the body itself is read on the loop), loads and unloads (which may wait for memory or for a
# model's requests to end), and model work (embeddings, rerank, tokenize, image fetches)
POOLS: dict[str, int] = {"store": 4, "upload": 4, "load": 8, "work": 8}
_executors: dict[str, ThreadPoolExecutor] = {}
_executors_lock = threading.Lock()


def executor(pool: Pool) -> ThreadPoolExecutor:
    """The process's pool for ``pool`` (made on first use)."""
    with _executors_lock:
        ex = _executors.get(pool)
        if ex is None:
            ex = _executors[pool] = ThreadPoolExecutor(POOLS[pool], thread_name_prefix=f"localllm-{pool}")
        return ex


async def run_sync(fn: Callable[..., T], *args: Any, pool: Pool = "store", **kwargs: Any) -> T:
    """Run blocking work off the event loop, on the bounded pool of its kind."""
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(executor(pool), call)


async def run_cancellable(http: Request, fn: Callable[..., T], *args: Any, pool: Pool = "work",
                          **kwargs: Any) -> T:
    """:func:`run_sync` of work that takes ``cancel=`` (a :class:`threading.Event`: embeddings, reranks), set when
    the client disconnects before the answer, so the work stops between two of its jobs instead of running on for
    nobody."""
    cancel = threading.Event()
    task = asyncio.ensure_future(run_sync(fn, *args, cancel=cancel, pool=pool, **kwargs))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await http.is_disconnected():
                cancel.set()
                return await task  # ends at its next check with RequestCancelled (nobody reads the answer)
    except asyncio.CancelledError:
        cancel.set()
        raise
