"""The KV pool of one loaded model: which tokens each sequence id holds, and how a prompt reuses them.

A :class:`KVPool` keeps one :class:`Seq` per sequence id of a :class:`~backends.base.TokenSource` (the
cells are the source's; the pool knows what they hold) and decides, for the decode loop
(:mod:`backends.loop`), everything about those cells that is not evaluation:

* **placement** (:meth:`KVPool.place`): a prompt goes to the sequence whose tokens share the longest prefix
  with it; a prefix held by another sequence (a shared system prompt) is copied (``seq_cp``) into an empty
  sequence, else into the idle one used least recently; a longer prefix saved on disk (the
  :class:`~backends.prompt_cache.PromptCache`) is restored instead; an exact repeat samples from the logits
  saved after the prompt;
* **joining** another request's prefill (:meth:`KVPool.join`): a prompt that shares a long prefix with one
  still being evaluated waits for it and then copies it;
* **parking** (:meth:`KVPool.park_idle`): in a shared pool, idle sequences move to host memory while
  others decode, and come back by a copy when their conversation returns;
* **victims**: when the pool is full, idle sequences go, least recently used first (:meth:`KVPool.make_room`);
* **release** (:meth:`KVPool.release`): a request's sequence becomes an idle prefix whatever ended it
  (finished, cancelled, failed): the evaluated tokens stay for the next request, only cells the pool does
  not know of (a failed evaluation's) are dropped; its long prefixes are saved to the prompt cache on disk.

Every method runs on the loop's thread; :meth:`KVPool.usage` may be read from any thread (a snapshot).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from backends.base import BackendError, TokenSource
from backends.prompt_cache import PromptCache

log = logging.getLogger("backends.kvpool")

JOIN_MIN = 64  # shared prompt tokens worth waiting for another request's prefill (half of it: worth a copy)
PARK_ALONE = 512  # idle tokens in the pool that a request running alone parks (two of llama.cpp's 256-cell steps)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists.

    >>> common_prefix([1, 2, 3], [1, 2, 4, 5])
    2
    """
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Seq:
    """One KV sequence id and what its cells hold: one cell per token, at positions ``0 .. len(tokens)-1``, or
    fewer positions where an image takes fewer than its tokens (M-RoPE: see :meth:`TokenSource.positions`)."""

    id: int
    tokens: list[int] = field(default_factory=list)
    owner: object | None = None  # the request running on it; None: idle (its tokens are a prefix for reuse)
    last_used: float = 0.0
    prompt_logits: tuple[int, Any] | None = None  # (prompt length, logits after it) for exact repeats
    parked: bytes | None = None  # its KV state, moved to host memory while other sequences decode (no cells)
    no_join: bool = False  # a copy into it failed (recurrent memory): its request never waits for a prefill

    def in_pool(self) -> bool:
        """Whether its tokens are in the pool's cells (an idle sequence may be parked in host memory)."""
        return bool(self.tokens) and self.parked is None


@dataclass
class Placement:
    """Where :meth:`KVPool.place` put a prompt and what it reused."""

    seq: Seq
    cached: int = 0  # prompt tokens the sequence already holds (copied and restored ones included)
    copied: int = 0  # of those, copied from another sequence
    restored: int = 0  # of those, restored from the prompt cache on disk
    logits: Any = None  # the saved logits after the whole prompt (an exact repeat: nothing to evaluate)


class Join(NamedTuple):
    """What :meth:`KVPool.join` did: ``wait`` (an earlier request is evaluating a longer shared prefix),
    ``gained`` (prompt tokens copied from another sequence now)."""

    wait: bool
    gained: int


@dataclass
class PoolCounters:
    """Counters since load."""

    prompt_tokens_cached: int = 0  # reused instead of evaluated (copied and restored ones included)
    prompt_tokens_copied: int = 0
    prompt_tokens_restored: int = 0
    evictions: int = 0  # idle sequences dropped to make room


@dataclass
class PoolUsage:
    """Tokens held now, by kind of sequence."""

    active: int = 0  # by sequences of running requests
    idle: int = 0  # in the pool's cells by idle sequences, for reuse
    parked: int = 0  # by idle sequences parked in host memory
    parked_bytes: int = 0


class KVPool:
    """The sequences of ``source`` and their bookkeeping. ``prompt_cache``: the disk cache to restore from
    and save to (None: off); ``can_park``: idle sequences may move to host memory (a shared pool that can
    save sequence states); ``park_budget``: tokens parked at most (default: half the pool's cells)."""

    def __init__(self, source: TokenSource, *, prompt_cache: PromptCache | None = None, can_park: bool = False,
                 park_budget: int | None = None):
        self.source = source
        self.prompt_cache = prompt_cache
        self.can_park = can_park
        self.park_budget = max(1, park_budget if park_budget is not None else source.info.kv_cells // 2)
        self.seqs = [Seq(i) for i in range(source.n_seq_ids)]
        self.counters = PoolCounters()

    # ------------------------------------------------------------------ what it holds

    def usage(self) -> PoolUsage:
        u = PoolUsage()
        for s in list(self.seqs):
            if s.owner is not None:
                u.active += len(s.tokens)
            elif s.parked is not None:
                u.parked += len(s.tokens)
                u.parked_bytes += len(s.parked)
            else:
                u.idle += len(s.tokens)
        return u

    def parked_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.seqs if s.parked is not None)

    def idle_in_pool(self) -> int:
        return sum(len(s.tokens) for s in self.seqs if s.owner is None and s.parked is None)

    # ------------------------------------------------------------------ placement

    def place(self, owner: object, prompt: list[int]) -> Placement:
        """Give ``owner`` a sequence for ``prompt`` holding the longest prefix of it that the pool (or the
        disk) has; the rest of the prompt is for the caller to evaluate (at least its last token, for its
        logits, unless ``logits`` is set)."""
        src = self.source
        while True:
            best, best_n = None, 0
            for s in self.seqs:
                n = common_prefix(s.tokens, prompt)
                if n > best_n or (n == best_n and best is not None and n > 0 and best.owner is not None
                                  and s.owner is None):
                    best, best_n = s, n
            if best is None or best.parked is None or self._unpark(best):
                break  # (a parked sequence that no longer fits the pool is emptied: look again)
        seq: Seq | None = None
        copied = 0
        if best is not None and best.owner is None and (best_n == len(best.tokens) or best_n == len(prompt)):
            seq = best  # the same conversation continuing (or the same prompt again)
        elif best is not None and best_n > 0:
            # a shared prefix (a system prompt): copy it into the sequence this request may take, which is
            # an empty one, else the idle one used least recently (that may be ``best`` itself: then trim it)
            target = self._victim()
            if target is best:
                seq = best
            elif target is not None:
                if target.tokens:
                    self.counters.evictions += 1
                target.parked = None
                best_n, pos = src.kv_cut(best.tokens, best_n)
                ok = src.seq_cp(best.id, target.id, pos)  # empties the target first
                target.tokens = list(best.tokens[:best_n]) if ok else []
                target.prompt_logits = None
                seq, copied = target, (best_n if ok else 0)
        if seq is None:
            seq = self._free_seq()
            if seq is None:  # cannot happen: there are more sequence ids than slots
                raise BackendError("No free sequence in the KV pool.")
        seq.owner, seq.no_join = owner, False
        out = Placement(seq)
        keep = common_prefix(seq.tokens, prompt)
        saved = seq.prompt_logits
        if keep == len(prompt) and saved is not None and saved[0] == len(prompt):
            out.logits = saved[1]  # exact repeat: sample from the saved row
        elif keep >= len(prompt):
            keep = len(prompt) - 1  # the last prompt token is evaluated again for its logits
        if keep < len(seq.tokens):
            keep, pos = src.kv_cut(seq.tokens, keep)
            if not src.seq_rm(seq.id, pos):
                src.seq_rm(seq.id)  # memory without partial removal: nothing is kept, the saved row is stale
                keep, saved, out.logits = 0, None, None
            del seq.tokens[keep:]
        if not (saved is not None and saved[0] <= keep):
            seq.prompt_logits = None
        pc = self.prompt_cache
        if out.logits is None and pc is not None and pc.wants(len(prompt)):
            keep, out.restored = self._restore(seq, prompt, keep)
        out.cached, out.copied = keep, min(copied, keep)
        self.counters.prompt_tokens_cached += keep
        self.counters.prompt_tokens_copied += out.copied
        return out

    def _restore(self, seq: Seq, prompt: list[int], keep: int) -> tuple[int, int]:
        """(tokens held, tokens restored): the longest prefix of ``prompt`` saved on disk, loaded into ``seq``
        when it beats ``keep``."""
        pc = self.prompt_cache
        assert pc is not None
        n, data = pc.lookup(prompt)
        if data is None or n <= keep:
            return keep, 0
        if not self.source.state_load(seq.id, data):
            pc.remove(prompt[:n], "the backend refused it")
            self.source.seq_rm(seq.id)
            seq.tokens, seq.prompt_logits = [], None
            return 0, 0
        seq.tokens, seq.prompt_logits = list(prompt[:n]), None
        keep = min(n, len(prompt) - 1)  # logits are not saved: the last prompt token is evaluated again
        if keep < n:
            keep, pos = self.source.kv_cut(seq.tokens, keep)
            self.source.seq_rm(seq.id, pos)
            del seq.tokens[keep:]
        self.counters.prompt_tokens_restored += keep
        pc.stats.restored_tokens += keep
        return keep, keep

    def join(self, seq: Seq, prompt: list[int], ahead: Iterable[tuple[list[int], Seq]]) -> Join:
        """Share a prefix with the requests around ``seq`` while its ``prompt`` is still being evaluated: copy
        what another sequence already holds of it (a system prompt that an earlier request has evaluated
        meanwhile), and wait (``Join.wait``) while an earlier request (``ahead``: the prompts and sequences of
        those admitted before it that are still evaluating their prompts) is evaluating a longer shared
        prefix. Four clients that send the same long system prompt at once thus evaluate it once."""
        have, limit = len(seq.tokens), len(prompt) - 1  # the last prompt token is evaluated for its logits
        if seq.no_join or limit - have < JOIN_MIN:
            return Join(False, 0)
        for q_prompt, q_seq in ahead:
            n = min(common_prefix(q_prompt, prompt), limit)
            if n - have >= JOIN_MIN and len(q_seq.tokens) < n:
                return Join(True, 0)
        best, best_n = None, have
        for s in self.seqs:
            if s is not seq and s.in_pool():
                n = min(common_prefix(s.tokens, prompt), limit)
                if n > best_n:
                    best, best_n = s, n
        if best is not None:
            best_n = self.source.kv_cut(best.tokens, best_n)[0]
        if best is None or best_n - have < JOIN_MIN // 2:
            return Join(False, 0)
        if not self.source.seq_cp(best.id, seq.id, self.source.positions(best.tokens[:best_n])):
            seq.tokens, seq.prompt_logits, seq.no_join = [], None, True  # the copy emptied it
            return Join(False, 0)
        seq.tokens, seq.prompt_logits = list(best.tokens[:best_n]), None
        gained = best_n - have
        self.counters.prompt_tokens_cached += gained
        self.counters.prompt_tokens_copied += gained
        return Join(False, gained)

    def trim(self, seq: Seq, keep: int) -> None:
        """Drop the tokens of ``seq`` after the first ``keep`` (rejected drafts)."""
        if keep < len(seq.tokens):
            keep, pos = self.source.kv_cut(seq.tokens, keep)
            self.source.seq_rm(seq.id, pos)
            del seq.tokens[keep:]

    # ------------------------------------------------------------------ victims

    def _victim(self) -> Seq | None:
        """The sequence a new request may take: an empty one, else the idle one used least recently."""
        empty = [s for s in self.seqs if s.owner is None and not s.tokens]
        if empty:
            return empty[0]
        return min((s for s in self.seqs if s.owner is None), key=lambda s: s.last_used, default=None)

    def _free_seq(self) -> Seq | None:
        """An empty sequence id: an empty one, else the least recently used idle one, emptied."""
        victim = self._victim()
        if victim is not None and victim.tokens:
            self.drop(victim)
            self.counters.evictions += 1
        return victim

    def make_room(self) -> bool:
        """Drop the idle sequence in the pool used least recently (the pool is full); False: none is left."""
        idle = min((s for s in self.seqs if s.owner is None and s.in_pool()), key=lambda s: s.last_used, default=None)
        if idle is None:
            return False
        self.drop(idle)
        self.counters.evictions += 1
        return True

    def drop(self, s: Seq) -> None:
        """Empty ``s`` (its cells, or its parked state)."""
        if s.parked is None:
            self.source.seq_rm(s.id)
        s.tokens, s.prompt_logits, s.parked = [], None, None

    def clear(self) -> None:
        """Empty every idle sequence."""
        for s in self.seqs:
            if s.owner is None:
                self.drop(s)

    # ------------------------------------------------------------------ parking idle KV in host memory

    def park_idle(self, running: int) -> None:
        """Move idle sequences' KV out of the pool while several requests run (``running``). In a unified pool
        every step's attention spans the cells up to the highest one in use, so cells kept for reuse cost each
        decoding row some work (~15% of throughput at 8 streams with 2,500 kept cells on a 135M model). Parked,
        a sequence's state waits in host memory (at most ``park_budget`` tokens, least recently used out first)
        and is loaded back by a copy when its conversation returns. A request running alone parks the idle
        sequences only once they hold ``PARK_ALONE`` tokens or more (a single stream beside 1,000 idle cells
        decodes ~20% slower). Loaded back, a sequence's cells may sit elsewhere in the pool, and attention then
        sums in another order: the last bits can differ from what it would have computed."""
        if not self.can_park or (running <= 1 and self.idle_in_pool() < PARK_ALONE):
            return
        src = self.source
        budget = self.park_budget
        for s in sorted((s for s in self.seqs if s.owner is None and s.in_pool()), key=lambda s: s.last_used,
                        reverse=True):
            n = len(s.tokens)
            if n > budget:
                self.drop(s)
                continue
            while self.parked_tokens() + n > budget:  # (n <= budget: empties before nothing is parked)
                old = min((p for p in self.seqs if p.parked is not None), key=lambda p: p.last_used, default=None)
                if old is None or old.last_used > s.last_used:
                    break
                self.drop(old)
                self.counters.evictions += 1
            if self.parked_tokens() + n > budget:  # what is parked was used more recently: this one goes
                self.drop(s)
                continue
            try:
                data = src.state_save(s.id)
            except Exception as e:  # noqa: BLE001 - a state that cannot be taken: the cells just go
                log.debug("could not park sequence %d: %s", s.id, e)
                self.drop(s)
                continue
            src.seq_rm(s.id)
            s.parked = data

    def _unpark(self, s: Seq) -> bool:
        """Load a parked sequence back into the pool; False (and the sequence empty) when it does not fit."""
        data = s.parked
        assert data is not None
        s.parked = None
        try:
            ok = self.source.state_load(s.id, data)
        except Exception as e:  # noqa: BLE001 - treated as a miss
            log.debug("could not restore parked sequence %d: %s", s.id, e)
            ok = False
        if not ok:
            self.source.seq_rm(s.id)
            s.tokens, s.prompt_logits = [], None
        return ok

    # ------------------------------------------------------------------ the end of a request

    def release(self, seq: Seq, *, failed: bool = False) -> None:
        """``seq``'s request ended (finished, cancelled or ``failed``): its evaluated tokens stay as an idle
        prefix for the next request; after a failure, cells past them (a failed evaluation may have written
        some) are dropped, and all of them when the memory cannot drop a tail."""
        seq.owner = None
        seq.last_used = time.monotonic()
        if failed:
            keep, pos = self.source.kv_cut(seq.tokens, len(seq.tokens))
            if self.source.seq_rm(seq.id, pos):
                del seq.tokens[keep:]
            else:
                self.drop(seq)

    def save_prefixes(self, seq: Seq, prompt: list[int], points: Iterable[int] = ()) -> None:
        """Save the KV state of the long prefixes of ``prompt`` that ``seq`` holds to the disk cache (where
        the system prompt ends, ``points``; the whole prompt: the next turn of a chat starts with it; or as
        much of it as was evaluated) unless the disk already has them. The copy is taken here, on the loop's
        thread (about 50 ms for 2,000 tokens of an f16 cache on a small model: the other streams wait one
        step that long); the file is written in the background."""
        pc = self.prompt_cache
        if pc is None:
            return
        held = common_prefix(seq.tokens, prompt)
        for n in sorted({n for n in (*points, len(prompt), held) if pc.wants(n) and n <= held}):
            toks = seq.tokens[:n]
            if pc.has(toks):
                continue
            tmp = next((s for s in self.seqs if s.owner is None and not s.tokens and s is not seq), None)
            if tmp is None:
                return
            try:
                if n == len(seq.tokens):
                    data = self.source.state_save(seq.id)
                elif self.source.kv_cut(toks, n)[0] != n:
                    continue  # inside an image that is kept whole
                elif self.source.seq_cp(seq.id, tmp.id, self.source.positions(toks)):
                    data = self.source.state_save(tmp.id)
                    self.source.seq_rm(tmp.id)
                else:
                    continue
            except Exception as e:  # noqa: BLE001 - a cache that cannot be saved costs nothing but the miss
                log.warning("prompt cache: could not take the state of %d tokens: %s", n, e)
                return
            pc.save(toks, data)

    def close(self) -> None:
        """Finish the prompt cache's writes (the source is the caller's to close)."""
        if self.prompt_cache is not None:
            self.prompt_cache.close()


__all__ = ["JOIN_MIN", "PARK_ALONE", "Join", "KVPool", "Placement", "PoolCounters", "PoolUsage", "Seq",
           "common_prefix"]
