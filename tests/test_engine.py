"""The engine's residency: decisions use the planner's numbers (``Plan.memory.total``), not a guess; no load
waits behind another model's stream; generation and embeddings share one loaded model."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from localllm.api import Done, GenerateRequest, Sampling
from localllm.engine import Engine
from localllm.loader import LoadOptions

MODEL = "smollm2:135m"


@pytest.fixture
def two_models(default_model):
    """The default model under two extra names (shared file), removed afterwards."""
    from localllm.store import Store

    store = Store()
    names = ["smollm2-plan:small", "smollm2-plan:big"]
    for n in names:
        store.copy(MODEL, n)
    yield store, names
    for n in names:
        store.remove(n)


def test_eviction_follows_the_plans_memory_totals(two_models):
    store, (small, big) = two_models
    small_opts, big_opts = LoadOptions(num_ctx=512), LoadOptions(num_ctx=8192)
    probe_engine = Engine(store, keep_alive=300)
    p_small = probe_engine.prepare(small, small_opts).plan
    p_big = probe_engine.prepare(big, big_opts).plan
    probe_engine.close()
    assert p_big.memory.total > p_small.memory.total  # a larger context costs KV cache

    # Room for both only if the engine counts the plans' totals: the fallback guess (file + KV + 64 MiB)
    # would be larger than the plan's total for neither or both, so this budget pins the figure used.
    engine = Engine(store, keep_alive=300, memory_budget=p_small.memory.total + p_big.memory.total)
    try:
        engine.load(small, small_opts)
        engine.load(big, big_opts)
        loaded = {m.name: m for m in engine.ps()}
        assert set(loaded) == {small, big}
        assert loaded[small].estimate == p_small.memory.total
        assert loaded[big].estimate == p_big.memory.total
    finally:
        engine.close()

    # One byte less than both: loading the second evicts the first (the idle one used least recently).
    engine = Engine(store, keep_alive=300, memory_budget=p_small.memory.total + p_big.memory.total - 1)
    try:
        engine.load(small, small_opts)
        engine.load(big, big_opts)
        assert [m.name for m in engine.ps()] == [big]
        engine.load(small, small_opts)  # and back: the big one goes
        assert [m.name for m in engine.ps()] == [small]
    finally:
        engine.close()


def _wait_until(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_load_does_not_wait_for_another_models_stream(two_models):
    """Model A streams a long answer while a request for A with another context unloads it (the old A closes
    when its stream ends): loading model B meanwhile takes a load's time, not the rest of A's stream."""
    store, (a, b) = two_models
    with Engine(store, keep_alive=300) as engine:
        req = GenerateRequest(prompt="Count to a thousand:", sampling=Sampling(temperature=0, max_tokens=200))
        stream = engine.generate(a, req, LoadOptions(num_ctx=512))
        try:
            next(stream)  # A streams: its request holds the model until the generator ends
            (old_a,) = engine.ps()
            reload = threading.Thread(target=engine.load, args=(a, LoadOptions(num_ctx=1024)), daemon=True)
            reload.start()
            _wait_until(lambda: all(m is not old_a for m in engine.ps()))  # A is being unloaded
            load_b = threading.Thread(target=engine.load, args=(b, LoadOptions(num_ctx=512)), daemon=True)
            load_b.start()
            load_b.join(30)
            assert not load_b.is_alive(), "loading B waited for A's stream to end"
            assert engine.is_loaded(b)
            assert not old_a.model.closed  # A's stream is still going
        finally:
            stream.close()
        reload.join(30)
        assert not reload.is_alive()
        _wait_until(lambda: old_a.model.closed)  # its last request gone, the old A closed
        assert {m.name: m.info.n_ctx for m in engine.ps()} == {a: 1024, b: 512}


def test_an_embed_between_chats_loads_the_model_once(default_model):
    """generate, embed, generate on one engine: one load serves all three (no reload for the embeddings nor
    back), and the vectors are those of a model loaded for embeddings alone."""
    texts = ["The sky is blue.", "Paris is the capital of France."]
    req = GenerateRequest(prompt="Hello", sampling=Sampling(temperature=0, max_tokens=4))
    with Engine(keep_alive=300) as engine:
        first = list(engine.generate(MODEL, req))
        (loaded,) = engine.ps()
        vectors = engine.embed(MODEL, texts)
        again = list(engine.generate(MODEL, req))
        assert [m is loaded for m in engine.ps()] == [True]
        assert first[-1].stats.load_duration > 0 and again[-1].stats.load_duration == 0
    with Engine(keep_alive=300) as engine:
        alone = engine.embed(MODEL, texts)  # loaded for embeddings: it serves a chat too, without a reload
        (loaded,) = engine.ps()
        assert loaded.options.embedding
        list(engine.generate(MODEL, req))
        assert [m is loaded for m in engine.ps()] == [True]
    assert len(vectors) == len(alone) == 2
    for v, w in zip(vectors, alone, strict=True):
        assert v == pytest.approx(w, abs=1e-5)


def test_a_load_waiting_for_a_busy_models_memory_does_not_hold_up_one_that_fits(two_models):
    """Model A streams; X needs A's memory, so its load waits for A's stream to end (A is busy, it cannot be
    evicted); meanwhile B, which fits beside A, loads at once instead of queueing behind X."""
    store, (a, x) = two_models
    small, big = LoadOptions(num_ctx=512), LoadOptions(num_ctx=8192)
    with Engine(store, keep_alive=300) as probe_engine:
        p_small, p_big = probe_engine.prepare(a, small).plan, probe_engine.prepare(x, big).plan
    assert p_big.memory.total > p_small.memory.total
    with Engine(store, keep_alive=300, memory_budget=2 * p_small.memory.total) as engine:  # A + B, not A + X
        req = GenerateRequest(prompt="Count to a thousand:", sampling=Sampling(temperature=0, max_tokens=200))
        stream = engine.generate(a, req, small)
        try:
            next(stream)  # A streams
            load_x = threading.Thread(target=engine.load, args=(x, big), daemon=True)
            load_x.start()
            time.sleep(1.0)  # X is waiting for A's memory
            assert load_x.is_alive() and not engine.is_loaded(x)
            load_b = threading.Thread(target=engine.load, args=(MODEL, small), daemon=True)
            load_b.start()
            load_b.join(30)
            assert not load_b.is_alive(), "loading B waited behind X, which waits for A's stream"
            assert {m.name for m in engine.ps()} == {a, MODEL}
        finally:
            stream.close()
        load_x.join(30)
        assert not load_x.is_alive()
        assert [m.name for m in engine.ps()] == [x]  # A and B (idle) made room for X


# ------------------------------------------------------------------------------------------ the two faces of generate


def _stream(engine: Engine, face: str, request: GenerateRequest, **kw) -> list:
    """Every event of ``engine.generate`` (``face="sync"``) or ``engine.agenerate`` (``"async"``) for ``request``."""
    if face == "sync":
        return list(engine.generate(MODEL, request, **kw))

    async def read() -> list:
        return [event async for event in engine.agenerate(MODEL, request, **kw)]

    return asyncio.run(read())


@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_cancel_already_set_ends_either_face_at_once_with_nothing_loaded(default_model, face):
    """``generate`` ended a request whose cancel was already set with ``Done(cancelled)`` before loading anything;
    ``agenerate`` loaded the model first. Both are one course now."""
    cancel = threading.Event()
    cancel.set()
    with Engine(keep_alive=300) as engine:
        request = GenerateRequest(messages=[{"role": "user", "content": "Hi"}], sampling=Sampling(seed=1))
        events = _stream(engine, face, request, cancel=cancel)
        assert [(type(e), e.finish_reason) for e in events] == [(Done, "cancelled")]
        assert engine.ps() == []


def test_a_prompt_longer_than_the_context_grows_it_through_either_face(default_model):
    """A chat longer than the default context (4,096 tokens) reloads the model with a larger one and is answered
    whole, through the sync and the async face alike."""
    with Engine(keep_alive=300) as engine:
        request = GenerateRequest(messages=[{"role": "user", "content": "hello " * 4200}],
                                  sampling=Sampling(seed=1, temperature=0, max_tokens=2))
        for face in ("sync", "async"):
            events = _stream(engine, face, request)
            done = events[-1]
            assert isinstance(done, Done) and done.finish_reason in ("stop", "length"), (face, done)
            assert done.stats.prompt_eval_count > 4096 and done.stats.dropped_messages == 0, face
            (loaded,) = engine.ps()
            assert loaded.info.n_ctx > 4096, face
            engine.unload(MODEL)  # the next face starts from the default context again
