"""The engine as the server uses it: :class:`ServerEngine`, the one interface :func:`~localllm.server.app.create_app`,
the translators and ``/metrics`` are typed against (:class:`localllm.engine.Engine` is the one in use; a test may
hand in another), the store behind it, and :func:`run_sync` for the blocking calls.

It is not :class:`localllm.api.Runner`: the faces' runner answers with ``api.Loaded`` summaries, while the server
reads what a loaded model is doing now (its decode loop's slots, its load time) for ``/api/ps`` and ``/metrics``."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from fastapi import Request

if TYPE_CHECKING:
    from localllm.engine import Event, GenerateRequest, LoadOptions, Pooled, Resident, Stats
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


async def run_sync(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run blocking work (store, loads) off the event loop."""
    return await asyncio.to_thread(fn, *args, **kwargs)


async def run_cancellable(http: Request, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """:func:`run_sync` of work that takes ``cancel=`` (a :class:`threading.Event`: embeddings, reranks), set when
    the client disconnects before the answer, so the work stops between two of its jobs instead of running on for
    nobody."""
    cancel = threading.Event()
    task = asyncio.ensure_future(asyncio.to_thread(fn, *args, cancel=cancel, **kwargs))
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
