"""The KV pool's contract, without the decode loop: placement, prefix copies, waiting for another prefill,
the end of a request, victims, parking and the prompt cache on disk.

KV operations run on the real default model (llama.cpp, F32 so that batch shapes move the logits little; one
source for the module, each test starts from an empty pool): a prefix the pool says a sequence holds must give
the logits a fresh evaluation gives. The
parking budget's bookkeeping runs on a minimal in-test source.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from backends.contract.source import Feed, ModelInfo, TokenSource
from backends.contract.specs import LoadSpec, Sampling, Tuning
from backends.core.kvpool import COPY_MIN, JOIN_MIN, PARK_ALONE, KVPool
from backends.core.kvseq import Seq
from backends.core.prompt_cache import PromptCache

TEXT = ("The lighthouse keeper climbed the stairs every evening, counted the ships on the horizon and wrote "
        "their names in a book that nobody read. ")


@pytest.fixture(scope="module", params=["streams", "unified"])
def source(derived_model, request):
    """Both of llama.cpp's KV layouts, with 4 sequence ids: a stream each (the default's layout: there a stream per
    slot) and one unified pool (LOCALLLM_KV_UNIFIED; and the memory of sliding-window and hybrid models)."""
    from backends.llamacpp.source import LlamaCppSource

    src = LlamaCppSource(LoadSpec(str(derived_model("f32")), n_ctx=1024, slots=2, tuning=Tuning(n_seq_ids=4),
                                  kv_unified=request.param == "unified"))
    assert src.info.kv_streams == (request.param == "streams")
    yield src
    src.close()


@pytest.fixture
def src(source) -> TokenSource:
    for i in range(source.n_seq_ids):
        source.seq_rm(i)
    return source


def toks(src: TokenSource, text: str) -> list[int]:
    return src.prompt_tokens(text)


def more(src: TokenSource, text: str) -> list[int]:
    """Tokens that follow a prompt (no BOS)."""
    return src.tokenize(text)


def run(src: TokenSource, seq: Seq, tokens: list[int], *, record: bool = True) -> np.ndarray:
    """Evaluate ``tokens`` after what ``seq`` holds (recorded in the sequence); the logits after the last."""
    pos, rows = len(seq.tokens), [0]
    for i in range(0, len(tokens), src.n_batch):
        chunk = tokens[i : i + src.n_batch]
        rows = src.evaluate([Feed(seq.id, chunk, pos, 1)])[0]
        pos += len(chunk)
        if record:
            seq.tokens.extend(chunk)
    return np.asarray(src.logits(rows[-1]))


def fresh(src: TokenSource, tokens: list[int]) -> np.ndarray:
    """The logits after ``tokens`` evaluated from scratch (on the last sequence id, emptied after)."""
    s = Seq(src.n_seq_ids - 1)
    src.seq_rm(s.id)
    out = run(src, s, tokens)
    src.seq_rm(s.id)
    return out


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """The same logits, up to what other batch shapes move in F32 (~0.02 here; a wrong prefix moves them by units)."""
    return int(a.argmax()) == int(b.argmax()) and float(np.abs(a - b).max()) < 0.1


def test_a_prompt_continues_the_sequence_that_holds_its_longest_prefix(src):
    pool = KVPool(src)
    p = toks(src, TEXT * 2)
    first = pool.place("a", p)
    assert first.cached == 0 and first.seq.owner == "a"
    run(src, first.seq, p)
    pool.release(first.seq)
    q = more(src, " What did the keeper count?")
    again = pool.place("b", p + q)
    assert again.seq is first.seq and again.cached == len(p) and again.copied == 0
    assert same(run(src, again.seq, q), fresh(src, p + q))
    assert pool.counters.prompt_tokens_cached == len(p)


def test_an_exact_repeat_samples_from_the_saved_logits(src):
    pool = KVPool(src)
    p = toks(src, TEXT)
    a = pool.place("a", p)
    logits = run(src, a.seq, p)
    a.seq.prompt_logits = (len(p), logits)  # what the loop keeps after a prompt
    pool.release(a.seq)
    b = pool.place("b", p)
    assert b.seq is a.seq and b.cached == len(p) and b.logits is logits


def test_a_shared_prefix_is_copied_into_another_sequence(src):
    pool = KVPool(src)
    system = toks(src, TEXT * 2)
    pa = system + more(src, " Question one?")
    a = pool.place("a", pa)
    run(src, a.seq, pa)  # a still runs
    other = system + more(src, " Why, please?")
    b = pool.place("b", other)
    assert b.seq is not a.seq and b.copied == b.cached >= len(system) - 1
    assert b.seq.tokens == other[: b.cached]
    assert same(run(src, b.seq, other[b.cached :]), fresh(src, other))
    assert pool.counters.prompt_tokens_copied == b.copied


def test_a_prompt_waits_for_an_earlier_prefill_of_the_same_prefix_then_copies_it(src):
    pool = KVPool(src)
    system = toks(src, TEXT * 8)
    assert len(system) > 2 * JOIN_MIN
    pa, pb = system + more(src, " Tell me more."), system + more(src, " Why the book?")
    a = pool.place("a", pa)
    run(src, a.seq, pa[:32])  # the first chunk of a's prompt
    b = pool.place("b", pb)
    assert b.cached == 32  # what a held already was copied
    assert pool.join(b.seq, pb, [(pa, a.seq)]) == (True, 0)  # a is evaluating the rest of the prefix: wait
    run(src, a.seq, pa[32:])
    wait, gained = pool.join(b.seq, pb, [])
    assert not wait and gained >= len(system) - 32 - 1 and len(b.seq.tokens) == 32 + gained
    assert same(run(src, b.seq, pb[len(b.seq.tokens) :]), fresh(src, pb))
    assert pool.join(b.seq, pb, [(pa, a.seq)]) == (False, 0)  # less than JOIN_MIN left to share


def test_a_request_that_ends_keeps_what_it_evaluated_and_a_failed_one_drops_only_the_rest(src):
    pool = KVPool(src)
    p = toks(src, TEXT * 2)
    a = pool.place("a", p)
    run(src, a.seq, p)
    pool.release(a.seq)  # cancelled: nothing to drop
    assert a.seq.owner is None and a.seq.tokens == p and pool.usage().idle == len(p)
    b = pool.place("b", p + more(src, " And then?"))
    assert b.seq is a.seq and b.cached == len(p)
    run(src, b.seq, more(src, " And then? The"), record=False)  # a failed evaluation left cells behind
    pool.release(b.seq, failed=True)
    assert b.seq.tokens == p and pool.usage().idle == len(p)
    q = more(src, " Who read it?")
    c = pool.place("c", p + q)
    assert c.seq is a.seq and c.cached == len(p)
    assert same(run(src, c.seq, q), fresh(src, p + q))  # the cells past the prefix are gone


def test_a_full_pool_drops_the_idle_sequence_used_least_recently(src):
    pool = KVPool(src)
    seqs = []
    for i, text in enumerate(("One day.", "Two days.", "Three days.")):
        r = pool.place(i, toks(src, text))
        run(src, r.seq, toks(src, text))
        seqs.append(r.seq)
    pool.release(seqs[1])
    pool.release(seqs[0])
    assert pool.make_room() and seqs[1].tokens == [] and seqs[0].tokens  # the older idle one went
    assert pool.make_room() and seqs[0].tokens == []
    assert not pool.make_room() and seqs[2].tokens  # a running request's sequence is never a victim
    assert pool.counters.evictions == 2


def test_idle_sequences_park_in_host_memory_and_come_back(src):
    pool = KVPool(src, can_park=True)
    p = toks(src, TEXT * 2)
    a = pool.place("a", p)
    run(src, a.seq, p)
    pool.release(a.seq)
    pool.park_idle(running=1)  # alone beside fewer than PARK_ALONE idle tokens: stays
    assert len(p) < PARK_ALONE and pool.usage().idle == len(p) and pool.usage().parked == 0
    pool.park_idle(running=2)
    u = pool.usage()
    assert u.parked == len(p) and u.idle == 0 and u.parked_bytes > 0 and a.seq.parked is not None
    q = more(src, " What did the keeper count?")
    back = pool.place("b", p + q)
    assert back.seq is a.seq and back.cached == len(p) and a.seq.parked is None
    assert same(run(src, back.seq, q), fresh(src, p + q))


def test_a_few_shared_tokens_are_evaluated_again_not_copied_nor_loaded_back(src):
    """A prompt sharing fewer than COPY_MIN tokens with another sequence (a chat template's first tokens) takes an
    empty sequence and evaluates them: a copy would share the other's cells wherever they are in the pool (every
    step attends up to the highest cell in use), and loading a parked conversation back for them costs its copy."""
    pool = KVPool(src, can_park=True)
    p = toks(src, TEXT * 4)
    a = pool.place("a", p)
    run(src, a.seq, p)
    pool.release(a.seq)
    pool.park_idle(running=2)
    assert a.seq.parked is not None
    few = p[:COPY_MIN - 1] + more(src, " Tell me about ships instead.")
    b = pool.place("b", few)
    assert (b.cached, b.copied) == (0, 0) and b.seq is not a.seq and a.seq.parked is not None  # still parked
    assert same(run(src, b.seq, few), fresh(src, few))
    pool.release(b.seq)
    enough = p[:COPY_MIN + 8] + more(src, " And the harbour?")
    c = pool.place("c", enough)  # a prefix worth a copy: the parked conversation comes back for it
    assert c.copied == c.cached >= COPY_MIN and a.seq.parked is None
    assert same(run(src, c.seq, enough[c.cached:]), fresh(src, enough))


def test_the_prompt_cache_on_disk_saves_the_evaluated_prefixes_and_restores_them(src, tmp_path: Path):
    cache = PromptCache(tmp_path, key="smollm2 test", max_bytes=1 << 30, min_tokens=16)
    pool = KVPool(src, prompt_cache=cache)
    system = toks(src, TEXT * 2)
    p = system + more(src, " A question about ships?")
    a = pool.place("a", p)
    run(src, a.seq, p[:-3])  # cancelled before the end of its prompt
    pool.release(a.seq)
    pool.save_prefixes(a.seq, p, points=[len(system)])
    cache.flush()
    assert sorted(int(f.name.split("-")[0]) for f in tmp_path.glob("*.kv")) == [len(system), len(p) - 3]
    for i in range(src.n_seq_ids):  # another process: an empty pool
        src.seq_rm(i)
    pool = KVPool(src, prompt_cache=cache)
    q = system + more(src, " Why?")
    b = pool.place("b", q)
    assert b.restored == b.cached == len(system) and pool.counters.prompt_tokens_restored == len(system)
    assert same(run(src, b.seq, q[b.cached :]), fresh(src, q))


def test_a_saved_state_the_backend_refuses_is_removed(src, tmp_path: Path, caplog):
    cache = PromptCache(tmp_path, key="smollm2 test", max_bytes=1 << 30, min_tokens=16)
    p = toks(src, TEXT)
    assert cache.save_now(p, b"not a state")
    r = KVPool(src, prompt_cache=cache).place("a", p + more(src, " More?"))
    assert r.restored == r.cached == 0 and r.seq.tokens == []
    assert not list(tmp_path.glob("*.kv")) and "the backend refused it" in caplog.text


# ------------------------------------------------------------------ bookkeeping (a minimal source)


class Cells(TokenSource):
    """Sequences as token lists; states are their bytes. Just enough for the pool's bookkeeping."""

    name = "cells"

    def __init__(self, n_seq_ids: int = 6, kv_cells: int = 1000):
        super().__init__(LoadSpec("cells"))
        self.held: dict[int, list[int]] = {}
        self._n, self._info = n_seq_ids, ModelInfo("cells", 1000, 1000, 1, 256, None, kv_cells=kv_cells)

    @classmethod
    def available(cls) -> tuple[bool, str]:
        return True, ""

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def n_seq_ids(self) -> int:
        return self._n

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        return list(text.encode())

    def prompt_tokens(self, text: str) -> list[int]:
        return list(text.encode())

    def detokenize(self, tokens: list[int]) -> str:
        return bytes(tokens).decode()

    def piece(self, token: int) -> bytes:
        return bytes([token])

    def is_eog(self, token: int) -> bool:
        return False

    def render(self, messages: list[dict[str, Any]], **kw: Any) -> str:
        return ""

    def evaluate(self, feeds: Sequence[Feed]) -> list[list[int]]:
        for f in feeds:
            self.held.setdefault(f.seq, [])[f.pos :] = f.tokens
        return [[] for _ in feeds]

    def sampler(self, sampling: Sampling, fmt: Any) -> Any:
        raise NotImplementedError

    def logits(self, row: int) -> Any:
        raise NotImplementedError

    def seq_rm(self, seq: int, p0: int = 0, p1: int = -1) -> bool:
        del self.held.setdefault(seq, [])[p0 : None if p1 < 0 else p1]
        return True

    def seq_cp(self, src: int, dst: int, n: int) -> bool:
        self.held[dst] = list(self.held.get(src, [])[:n])
        return True

    def state_key(self) -> str | None:
        return "cells"

    def state_save(self, seq: int) -> bytes:
        return bytes(self.held.get(seq, []))

    def state_load(self, seq: int, data: bytes) -> bool:
        self.held[seq] = list(data)
        return True

    def embed(self, texts: list[str]) -> list[list[float]]:
        return []

    def close(self) -> None:
        pass


def idle(pool: KVPool, n: int, t: float) -> Seq:
    """An idle sequence holding ``n`` tokens, used last at ``t``."""
    tokens = [int(t)] + [120] * (n - 1)  # no common prefix with another one's
    r = pool.place(object(), tokens)
    pool.source.evaluate([Feed(r.seq.id, tokens, 0)])
    r.seq.tokens = tokens
    pool.release(r.seq)
    r.seq.last_used = t
    return r.seq


def test_parking_stays_within_its_budget():
    src = Cells()
    pool = KVPool(src, can_park=True, park_budget=100)
    old, mid, new = idle(pool, 40, 1), idle(pool, 50, 2), idle(pool, 100, 3)
    big = idle(pool, 120, 4)
    pool.park_idle(running=2)
    assert big.tokens == [] and src.held[big.id] == []  # bigger than the budget: dropped, not parked
    assert new.parked is not None and pool.parked_tokens() == 100  # the most recently used one
    assert old.tokens == mid.tokens == []  # older than what is parked: dropped, not parked in its place
    assert all(src.held.get(s.id, []) == [] for s in (old, mid, new))  # no cells left in the pool
    assert pool.usage().idle == 0 and pool.usage().parked == 100
    fill, small = idle(pool, 60, 5), idle(pool, 40, 6)
    pool.park_idle(running=2)  # newer ones to park: the least recently used parked one leaves for them
    assert new.tokens == [] and fill.parked is not None and small.parked is not None
    assert pool.parked_tokens() == 100


def test_a_request_takes_an_empty_sequence_before_an_idle_one():
    src = Cells(n_seq_ids=3)
    pool = KVPool(src)
    a = idle(pool, 10, 1)
    b = pool.place("b", list(b"unrelated prompt"))
    assert b.seq is not a and a.tokens  # an empty id was free: a's prefix stays
    c = idle(pool, 10, 5)
    assert c is not a and a.tokens
    d = pool.place("d", list(b"third prompt"))
    assert d.seq is a and d.cached == 0 and c.tokens  # no empty id: the idle one used least recently
    assert pool.counters.evictions == 1


def test_each_slot_gets_a_kv_stream_of_its_own_unless_the_pool_is_unified(derived_model):
    """Several slots of a plain-attention model: a llama.cpp KV stream per slot (llama-server's layout; a step
    attends to its own sequences' cells), one sequence id each; LOCALLLM_KV_UNIFIED's one pool has twice the ids
    over the same cells; one slot is one pool either way."""
    from backends.llamacpp.source import LlamaCppSource

    path = str(derived_model("f32"))
    layouts = {}
    for slots, unified in ((3, False), (3, True), (1, False)):
        s = LlamaCppSource(LoadSpec(path, n_ctx=512, slots=slots, kv_unified=unified))
        try:
            layouts[(slots, unified)] = (s.info.kv_streams, s.n_seq_ids, s.info.kv_cells, s.shared_pool)
        finally:
            s.close()
    assert layouts[(3, False)] == (True, 3, 3 * 512, False)  # nothing to park: idle cells cost no step anything
    assert layouts[(3, True)] == (False, 6, 3 * 512, True)
    assert layouts[(1, False)] == (False, 2, 512, True)
