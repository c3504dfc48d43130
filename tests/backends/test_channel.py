"""The channel between a model's decode loop and its consumers (threads or asyncio)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from backends.core.channel import Channel


def _produce(ch: Channel[int], n: int, pause: float = 0.0, delay: float = 0.0) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        for i in range(n):
            ch.put(i)
            if pause:
                time.sleep(pause)
        ch.close()

    t = threading.Thread(target=run)
    t.start()
    return t


def test_async_consumer_gets_every_item_in_order_across_threads() -> None:
    ch: Channel[int] = Channel()

    async def consume() -> list[int]:
        t = _produce(ch, 2000, pause=0.0)
        out = [x async for x in ch]
        t.join()
        return out

    assert asyncio.run(consume()) == list(range(2000))


def test_a_busy_async_consumer_is_not_woken_once_per_item() -> None:
    """Items put while the consumer is still busy reach it without a wake-up each (a cross-thread call into
    the event loop per token was the server's cost per streamed token)."""
    ch: Channel[int] = Channel()
    calls = 0

    async def consume() -> list[int]:
        nonlocal calls
        loop = asyncio.get_running_loop()
        orig = loop.call_soon_threadsafe

        def counting(*a, **k):  # type: ignore[no-untyped-def]
            nonlocal calls
            calls += 1
            return orig(*a, **k)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        out: list[int] = []
        it = ch.__aiter__()
        t = _produce(ch, 500, delay=0.05)  # starts once the consumer is parked on the empty queue
        async for x in it:
            out.append(x)
            if x == 0:  # busy (not awaiting) while the producer puts the other 499: no machine load changes that
                t.join()
        return out

    assert asyncio.run(consume()) == list(range(500))
    # one wake-up for the first item (the consumer was parked) and at most one more for the rest: a wake-up
    # per item put while the consumer was busy would count 500
    assert 1 <= calls <= 2, calls


def test_sync_consumer_and_error_after_items() -> None:
    ch: Channel[int] = Channel()
    ch.put(1)
    ch.fail(RuntimeError("boom"))
    it = iter(ch)
    assert next(it) == 1
    with pytest.raises(RuntimeError, match="boom"):
        next(it)


def test_a_consumer_that_leaves_early_cancels_the_producer() -> None:
    ch: Channel[int] = Channel()

    async def consume() -> None:
        t = _produce(ch, 3, pause=0.01)
        async for _ in ch:
            break
        t.join()

    asyncio.run(consume())
    assert ch.cancel.is_set()
    sync: Channel[int] = Channel()
    sync.put(1)
    for _ in sync:
        break
    assert sync.cancel.is_set()


def test_a_failed_stream_does_not_cancel_its_request_for_either_consumer() -> None:
    """The producer's error ended the stream: the request is not cancelled (the engine retries an overflowing
    prompt with the same cancel event after loading a larger context)."""
    for consume in ("sync", "async"):
        ch: Channel[int] = Channel()
        ch.put(1)
        ch.fail(ValueError("the prompt does not fit"))
        with pytest.raises(ValueError):
            if consume == "sync":
                list(ch)
            else:
                async def drain(c: Channel[int]) -> list[int]:
                    return [x async for x in c]

                asyncio.run(drain(ch))
        assert not ch.cancel.is_set(), consume


def test_settle_waits_until_a_sync_consumer_has_handled_every_item() -> None:
    """The decode loop asks, before its next step, whether the consumer is done with the last step's tokens: not
    while it still handles one, yes once it waits for the next (and at once when it has left)."""
    ch: Channel[int] = Channel()
    handled: list[float] = []

    def consume() -> None:
        for _ in ch:
            time.sleep(0.05)  # the work a token costs its consumer
            handled.append(time.monotonic())

    t = threading.Thread(target=consume)
    t.start()
    assert ch.settle(1.0)  # waiting for its first item
    ch.put(1)
    assert not ch.settle(0.01)  # still handling it
    assert ch.settle(1.0) and len(handled) == 1
    ch.put(2)
    ch.put(3)
    assert ch.settle(1.0) and len(handled) == 3  # both, not only the one it was handling
    ch.close()
    t.join()


def test_settle_waits_until_an_async_consumer_is_parked_again() -> None:
    ch: Channel[int] = Channel()
    got: list[int] = []
    started = threading.Event()

    async def consume() -> None:
        started.set()
        async for x in ch:
            await asyncio.sleep(0.05)
            got.append(x)

    t = threading.Thread(target=lambda: asyncio.run(consume()))
    t.start()
    started.wait(5)
    assert ch.settle(2.0)
    ch.put(7)
    assert not ch.settle(0.01)
    assert ch.settle(2.0) and got == [7]
    ch.close()
    t.join()


def test_settle_does_not_wait_for_a_consumer_that_left() -> None:
    ch: Channel[int] = Channel()
    ch.put(1)
    assert not ch.settle(0.01)  # nobody has read it yet
    ch.cancel.set()
    t0 = time.monotonic()
    assert ch.settle(5.0) and time.monotonic() - t0 < 1.0
