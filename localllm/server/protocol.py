"""The engine as the server uses it: :func:`engine_of` a request's app, the in-process
:class:`localllm.engine.Engine` itself (no interface of its own to keep in step with it), and :func:`run_sync` for
the blocking calls.

The other faces (CLI, TUI) see the engine through :class:`localllm.api.Runner` (in-process or remote, answering with
``api.Loaded`` summaries); the server is the engine's own face: it reads what a loaded model is doing now (its decode
loop's slots, its load time) for ``/api/ps`` and ``/metrics``.

Blocking work runs on bounded thread pools of its own kind (:data:`POOLS`), never on the event loop's one small
default pool: so slow loads, long reranks or many uploads wait for their own kind and ``/api/tags`` still answers."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from fastapi import Request

if TYPE_CHECKING:
    from localllm.engine import Engine

T = TypeVar("T")


def engine_of(http: Request) -> Engine:
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
