"""The engine's residency decisions use the planner's numbers (``Plan.memory.total``), not a guess."""

from __future__ import annotations

import pytest

from localllm.engine import Engine, LoadOptions

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
    p_small = probe_engine.plan_for(small, small_opts)[1]
    p_big = probe_engine.plan_for(big, big_opts)[1]
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
