"""The loader on its own (no engine): prepare → spec → a decode loop that answers; the draft and context choices a
user makes reach the spec; a context below the floor is refused before anything loads."""

from __future__ import annotations

import pytest

from localllm.errors import LocalLLMError, ModelNotFoundError
from localllm.loader import Loader, LoadOptions
from localllm.planner.estimation import MIN_CTX

MODEL = "smollm2:135m"


@pytest.fixture
def loader(default_model):
    from localllm.store import Store

    return Loader(Store(), backend="llamacpp")


def test_num_thread_is_capped_to_the_cores_this_process_may_use(loader):
    cores = loader.hardware.logical_cores
    prepared = loader.prepare(MODEL, LoadOptions(num_thread=1024))
    assert prepared.options.num_thread == cores
    assert any(r.startswith(f"threads {cores}: 1024 were asked for") for r in prepared.plan.reasons)


def test_the_loader_loads_a_model_that_answers_without_an_engine(loader):
    options = LoadOptions(num_ctx=1024, num_thread=1, embedding=True)
    prepared = loader.prepare(MODEL, options)
    prepared.check_fits()
    model, plan = prepared.model, prepared.plan
    assert prepared.estimate == plan.memory.total > 0 and prepared.options.num_thread == 1
    loaded, load_ns = loader.load(prepared, None)
    try:
        assert load_ns > 0
        assert loaded.spec.model_path == str(model.path)
        assert (loaded.spec.n_ctx, loaded.spec.slots, loaded.spec.n_threads) == (1024, plan.slots, 1)
        assert loaded.info.n_ctx == 1024
        assert loaded.tokenize("Hello") and len(loaded.embed(["Hello"])[0]) > 0
    finally:
        loaded.close()


def test_draft_choices_reach_the_spec(loader):
    model, plan = loader.plan(MODEL)
    assert loader.spec(model, LoadOptions(draft="none"), plan).draft is None
    ngram = loader.spec(model, LoadOptions(draft="ngram", num_draft=6), plan).draft
    assert ngram is not None and (ngram.kind, ngram.num_draft) == ("ngram", 6)
    named = loader.spec(model, LoadOptions(draft=MODEL, num_draft=3), plan).draft  # itself as its own draft
    assert named is not None and (named.kind, named.path, named.num_draft) == ("model", str(model.path), 3)
    with pytest.raises(ModelNotFoundError):
        loader.spec(model, LoadOptions(draft="no-such-draft:1b"), plan)


def test_a_context_below_the_floor_is_refused_before_loading(loader):
    with pytest.raises(LocalLLMError, match=f"num_ctx must be at least {MIN_CTX} tokens, got 16"):
        loader.plan(MODEL, LoadOptions(num_ctx=16))
    assert loader.plan(MODEL, LoadOptions(num_ctx=MIN_CTX))[1].n_ctx == MIN_CTX
