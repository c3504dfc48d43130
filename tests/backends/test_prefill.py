"""Long prompt chunks evaluated with flash attention on beside a context that decodes with it off
(:mod:`backends.llamacpp._prefill`), on the real default model: the cells that move are exactly the ones evaluated,
the prompt's logits are the flash-attention context's, every way the pool touches a sequence finds its cells, and a
state it cannot re-lay turns the context off instead of losing a prompt."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from backends.contract.errors import BackendError
from backends.contract.source import Feed
from backends.contract.specs import LoadSpec
from backends.llamacpp import _prefill
from backends.llamacpp._prefill import PREFILL_MIN, StateLayoutError, relayout
from backends.llamacpp.source import LlamaCppSource

SLOTS = 4


@pytest.fixture(scope="module")
def prompt(default_model_path) -> list[int]:
    text = " ".join(f"Record {i}: the shipment of {i * 7 % 13} crates left the harbour on day {i}." for i in range(60))
    src = LlamaCppSource(LoadSpec(model_path=str(default_model_path), n_ctx=256))
    try:
        toks = src.tokenize(text)
    finally:
        src.close()
    assert len(toks) > 3 * PREFILL_MIN
    return toks[:3 * PREFILL_MIN + 40]


@pytest.fixture(scope="module")
def source(default_model_path):
    src = LlamaCppSource(LoadSpec(model_path=str(default_model_path), n_ctx=1024, slots=SLOTS, flash_attn=False,
                                  prefill_flash_attn=True))
    assert src._prefill is not None, "the prefill context did not pass its check"
    yield src
    src.close()


@pytest.fixture
def src(source):
    for s in range(SLOTS):
        source.seq_rm(s, -1, -1)
    return source


def _pos_max(src: LlamaCppSource, seq: int) -> int:
    import llama_cpp

    return int(llama_cpp.llama_memory_seq_pos_max(src._mem, seq))


def _feed(src: LlamaCppSource, seq: int, tokens: list[int], pos: int = 0, outputs: int = 0) -> list[int]:
    return src.evaluate([Feed(seq, tokens, pos, outputs)])[0]


def test_the_cells_that_move_are_the_ones_the_flash_attention_context_evaluated(src, prompt):
    pf = src._prefill
    _feed(src, 2, prompt[:2 * PREFILL_MIN])
    assert pf.seq == 2 and _pos_max(src, 2) == -1  # held there, not yet in the main context
    _feed(src, 2, prompt[2 * PREFILL_MIN:3 * PREFILL_MIN], 2 * PREFILL_MIN)
    held = _prefill._state(pf.context, 0)
    saved = np.frombuffer(src.state_save(2), dtype=np.uint8)  # the pool reads the sequence: it moves first
    assert pf.seq is None and _pos_max(src, 2) == 3 * PREFILL_MIN - 1
    back = relayout(saved, n_stream=1, transposed=False)  # the main context's V is transposed: undo it
    assert len(back) == len(held)
    # the same cells (positions; each cell's sequence id is the context's own, which llama.cpp reads past), the same
    # K and V values
    cells = 3 * PREFILL_MIN
    meta = np.arange(16, 16 + 12 * cells).reshape(cells, 12)
    assert np.array_equal(back[meta[:, :8]], held[meta[:, :8]]) and np.array_equal(back[meta[-1, -1] + 1:],
                                                                                   held[meta[-1, -1] + 1:])
    # and back: the main context's block (its cells in stream 2 of 4: two empty streams before, one after)
    block = saved[12 + 4 * 3:len(saved) - 4]
    assert np.array_equal(relayout(back, n_stream=SLOTS, transposed=True)[16:16 + len(block)], block)


def test_a_prompt_ends_with_the_flash_attention_contexts_logits_and_decodes_on(src, prompt, default_model_path):
    n = len(prompt)
    rows = _feed(src, 1, prompt[:PREFILL_MIN * 2])
    rows = _feed(src, 1, prompt[PREFILL_MIN * 2:], PREFILL_MIN * 2, outputs=1)
    assert rows[0] < 0 and src._prefill.seq is None and _pos_max(src, 1) == n - 1  # moved with the prompt's end
    first = src.logits(rows[0])
    tok = int(np.argmax(first))
    nxt = src.logits(_feed(src, 1, [tok], n, outputs=1)[0])  # the main context, over the moved cells
    ref = LlamaCppSource(LoadSpec(model_path=str(default_model_path), n_ctx=1024, flash_attn=True))
    try:
        r = ref.evaluate([Feed(0, prompt, 0, 1)])[0]
        assert np.array_equal(ref.logits(r[0]), first)  # the flash-attention context's logits, unchanged
        want = ref.logits(ref.evaluate([Feed(0, [tok], n, 1)])[0][0])
    finally:
        ref.close()
    # the next token over the moved cells: as with flash attention throughout, but for the kernels' rounding
    # (V rows moved the wrong way round would not be near)
    assert int(np.argmax(nxt)) == int(np.argmax(want)) and np.abs(nxt - want).max() < 1.0


def test_every_way_the_pool_touches_a_sequence_finds_its_cells(src, prompt):
    pf = src._prefill
    k = 2 * PREFILL_MIN
    _feed(src, 0, prompt[:k])
    assert src.seq_cp(0, 3, k) and _pos_max(src, 3) == k - 1 and pf.seq is None  # copied from: moved first
    _feed(src, 0, prompt[k:k + PREFILL_MIN], k)  # its prefix copied back in
    assert pf.seq == 0 and pf.n == k + PREFILL_MIN
    _feed(src, 0, prompt[k + PREFILL_MIN:k + PREFILL_MIN + 8], k + PREFILL_MIN)  # a short chunk: the main context
    assert pf.seq is None and _pos_max(src, 0) == k + PREFILL_MIN + 7
    _feed(src, 1, prompt[:PREFILL_MIN])
    _feed(src, 2, prompt[:PREFILL_MIN])  # another sequence's long chunk: the first one moves
    assert pf.seq == 2 and _pos_max(src, 1) == PREFILL_MIN - 1
    assert src.seq_rm(2, -1, -1) and pf.seq is None and _pos_max(src, 2) == -1  # dropped, not moved
    _feed(src, 1, prompt[PREFILL_MIN:2 * PREFILL_MIN], PREFILL_MIN)
    assert src.seq_rm(1, PREFILL_MIN, -1) and _pos_max(src, 1) == PREFILL_MIN - 1  # a cut: moved, then cut
    _feed(src, 3, prompt[k:k + PREFILL_MIN], k)
    data = src.state_save(0)
    assert src.state_load(3, data) and pf.seq is None and _pos_max(src, 3) == _pos_max(src, 0)  # replaced


def test_a_state_it_cannot_read_is_refused_in_one_sentence():
    with pytest.raises(StateLayoutError, match="magic"):
        relayout(np.zeros(64, dtype=np.uint8), n_stream=2, transposed=True)
    head = np.array([0xAF143CD8, 0, 1, 5], dtype="<u4").view(np.uint8)
    with pytest.raises(StateLayoutError, match="not one this version of localllm reads"):
        relayout(np.concatenate([head, np.full(100, 7, dtype=np.uint8)]), n_stream=2, transposed=True)


def test_a_load_whose_check_fails_evaluates_without_the_context(default_model_path, monkeypatch, caplog):
    def refuse(*a, **k):
        raise StateLayoutError("the state's layout is not one this version of localllm reads")

    monkeypatch.setattr(_prefill, "relayout", refuse)
    with caplog.at_level(logging.WARNING, logger="backends.llamacpp"):
        src = LlamaCppSource(LoadSpec(model_path=str(default_model_path), n_ctx=512, slots=2, flash_attn=False,
                                      prefill_flash_attn=True))
    try:
        assert src._prefill is None
        assert "long prompts evaluated without flash attention" in caplog.text
        toks = src.tokenize("Once upon a time " * 60)[:PREFILL_MIN + 10]
        rows = src.evaluate([Feed(0, toks, 0, 1)])[0]
        assert rows[0] >= 0 and _pos_max(src, 0) == len(toks) - 1  # the main context evaluated it
    finally:
        src.close()


def test_a_move_that_fails_is_named_and_fatal_not_a_silent_loss(src, prompt, monkeypatch):
    """llama.cpp refusing the moved cells (never seen: the load checks the layouts) would leave the pool believing
    the sequence holds its prompt: the request fails in one sentence and the model is given up (``on_fatal``: the
    loop fails what runs and the next request loads it again), rather than answering from missing cells."""
    fatal: list[BaseException] = []
    monkeypatch.setattr(src, "on_fatal", fatal.append)
    monkeypatch.setattr(_prefill, "_load", lambda *a: False)
    with pytest.raises(BackendError, match="refused the cells of sequence 1 .* the sequence is lost"):
        src.evaluate([Feed(1, prompt[:PREFILL_MIN], 0, 1)])
    assert len(fatal) == 1 and "sequence 1" in str(fatal[0]) and src._prefill.seq is None
