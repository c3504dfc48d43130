"""The one bridge from a producing thread (a model's decode loop) to its consumer, sync or asyncio.

The producer calls :meth:`Channel.put` for each item, then :meth:`Channel.close` (or :meth:`Channel.fail`
with an exception, which the consumer re-raises). The consumer iterates with ``for`` or ``async for``;
when it stops early (``break``, ``gen.close()``, a cancelled task — an HTTP client that went away), the
channel's :attr:`cancel` event is set, which the producer checks once per step.

    >>> ch = Channel()
    >>> for x in (1, 2):
    ...     ch.put(x)
    >>> ch.close()
    >>> list(ch)
    [1, 2]
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Channel(Generic[T]):
    """A thread-safe, unbounded, single-consumer queue with end-of-stream, errors and cancellation."""

    def __init__(self, cancel: threading.Event | None = None):
        self.cancel = cancel if cancel is not None else threading.Event()
        self._items: deque[T] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None
        self._wakers: dict[Callable[[], None], bool] = {}  # an async consumer's wake-up -> parked (waiting for it)
        self._waiting = False  # the consumer has handled every item taken and waits for the next

    # ---------------------------------------------------------------- producer side

    def put(self, item: T) -> None:
        with self._cv:
            self._items.append(item)
            self._cv.notify_all()
            wakers = self._armed()
        for w in wakers:
            w()

    def _armed(self) -> list[Callable[[], None]]:
        """The async consumers parked on an empty queue, disarmed: each is woken once, not once per item (a
        wake-up is a cross-thread call into the event loop; a consumer that is still busy with earlier items
        finds the new ones without it). Call under the lock."""
        armed = [w for w, parked in self._wakers.items() if parked]
        for w in armed:
            self._wakers[w] = False
        return armed

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error`` (raised in the consumer after the items already put)."""
        with self._cv:
            if self._closed:
                return
            self._error = error
        self.close()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            wakers = list(self._wakers)
        for w in wakers:
            w()

    def settle(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds until the consumer has handled every item put so far and waits for the
        next one (True; also when the stream ended or the consumer left); False: it is still busy, or has not
        started reading."""
        with self._cv:
            return self._cv.wait_for(
                lambda: (self._waiting and not self._items) or self._closed or self.cancel.is_set(), timeout)

    @property
    def closed(self) -> bool:
        return self._closed

    # ---------------------------------------------------------------- consumer side

    def _take(self) -> tuple[bool, T | None]:
        """(True, item) | (False, None) at the end; raises the producer's error. Call under the lock."""
        if self._items:
            self._waiting = False
            return True, self._items.popleft()
        if self._closed:
            if self._error is not None:
                err, self._error = self._error, None
                raise err
            return False, None
        raise LookupError  # nothing yet

    def get(self, timeout: float | None = None) -> tuple[bool, T | None]:
        """Wait for the next item: (True, item), or (False, None) at the end of the stream."""
        with self._cv:
            while True:
                try:
                    return self._take()
                except LookupError:
                    self._waiting = True
                    self._cv.notify_all()
                    if not self._cv.wait(timeout):
                        raise TimeoutError from None

    def __iter__(self) -> Iterator[T]:
        finished = False  # the producer ended the stream (closed it or failed it)
        try:
            while True:
                try:
                    ok, item = self.get()
                except BaseException:
                    finished = self._closed
                    raise
                if not ok:
                    finished = True
                    return
                yield item  # type: ignore[misc]
        finally:
            if not finished:  # the consumer left early (break + close, an exception, a KeyboardInterrupt)
                self.cancel.set()

    async def __aiter__(self) -> AsyncIterator[T]:
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(ready.set)
            except RuntimeError:  # the event loop is gone: nobody is listening any more
                self.cancel.set()

        with self._cv:
            self._wakers[wake] = False
        finished = False
        try:
            while True:
                with self._cv:
                    try:
                        ok, item = self._take()
                    except LookupError:
                        ready.clear()
                        self._wakers[wake] = True  # parked: the next put or close wakes it
                        self._waiting = True
                        self._cv.notify_all()  # (a producer in settle())
                        ok, item = None, None  # type: ignore[assignment]
                    except BaseException:  # the producer's error: it ended the stream, nothing to cancel
                        finished = self._closed
                        raise
                if ok is None:
                    await ready.wait()
                    continue
                if not ok:
                    finished = True
                    return
                yield item  # type: ignore[misc]
        finally:
            with self._cv:
                self._wakers.pop(wake, None)
            if not finished:
                self.cancel.set()
