"""The KV pool of one loaded model: which tokens each sequence id holds, and how a prompt reuses them.

A :class:`KVPool` keeps one :class:`Seq` per sequence id of a :class:`~backends.contract.source.TokenSource` (the
cells are the source's; the pool knows what they hold) and decides, for the decode loop
(:mod:`backends.core.loop`), everything about those cells that is not evaluation:

* **placement** (:meth:`KVPool.place`): a prompt goes to the sequence whose tokens share the longest prefix
  with it; a prefix held by another sequence (a shared system prompt, ``COPY_MIN`` tokens or more) is copied
  (``seq_cp``) into an empty sequence, else into the idle one used least recently; a longer prefix saved on disk (the
  :class:`~backends.core.prompt_cache.PromptCache`) is restored instead; an exact repeat samples from the logits
  saved after the prompt;
* **joining** another request's prefill (:meth:`KVPool.join`): a prompt that shares a long prefix with one
  still being evaluated waits for it and then copies it;
* **parking** (:meth:`KVPool.park_idle`): in a shared pool (llama.cpp's unified KV; not with a KV stream per
  slot, where a step attends only to its own sequences' cells), idle sequences move to host memory while others
  decode, and come back by a copy when their conversation returns;
* **victims**: when the pool is full, idle sequences go, least recently used first (:meth:`KVPool.make_room`);
* **checkpoints** (memory that cannot drop its tail: the recurrent state of a hybrid model, a sliding window):
  see :class:`CheckpointPolicy`;
* **release** (:meth:`KVPool.release`): a request's sequence becomes an idle prefix whatever ended it
  (finished, cancelled, failed): the evaluated tokens stay for the next request, only cells the pool does
  not know of (a failed evaluation's) are dropped; its long prefixes are owed to the prompt cache on disk
  (:meth:`KVPool.owe_prefixes`): copied out of the pool later, while the model idles (:meth:`KVPool.save_owed`:
  a prefix shorter than its sequence goes through an empty sequence id, so with as many ids as slots it mostly
  waits), before the sequence's cells are cut, copied over, parked or dropped (the longest first, cutting the
  cells down to each), or at close.

Every method runs on the loop's thread; :meth:`KVPool.usage` may be read from any thread (a snapshot).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from backends.contract.errors import BackendError
from backends.contract.source import Checkpoints, SequenceStates, TokenSource, cut_of, positions_of
from backends.core.kvseq import (
    Checkpoint,
    CheckpointPolicy,
    Join,
    Placement,
    PoolCounters,
    PoolUsage,
    Seq,
    common_prefix,
)
from backends.core.prompt_cache import PromptCache

log = logging.getLogger("backends.core.kvpool")

JOIN_MIN = 64  # shared prompt tokens worth waiting for another request's prefill
# Shared prompt tokens worth a copy from another sequence (or loading a parked one back for): fewer (a chat
# template's first tokens) are evaluated again. A copy shares the source's cells, wherever in the pool they are,
# and every step's attention spans the pool up to its highest cell in use: 20 template tokens shared from cells
# 3,000 deep made a 128-token answer decode at 40 instead of 90 tok/s (benchmarks/README.md, issue 47).
COPY_MIN = JOIN_MIN // 2
PARK_ALONE = 512  # idle tokens in the pool that a request running alone parks (two of llama.cpp's 256-cell steps)


def _continues(s: Seq, n: int, prompt: list[int]) -> bool:
    """Whether ``prompt``, sharing ``n`` tokens with ``s``, is ``s``'s conversation continuing (or the same prompt
    again; or its next turn, whose copy of the last answer tokenizes otherwise than the answer was sampled)."""
    return n > 0 and (n == len(s.tokens) or n == len(prompt) or (
        s.prompt_logits is not None and n >= s.prompt_logits[0]))


class KVPool:
    """The sequences of ``source`` and their bookkeeping. ``prompt_cache``: the disk cache to restore from
    and save to (None: off); ``can_park``: idle sequences may move to host memory (a shared pool that can
    save sequence states); ``park_budget``: tokens parked at most (default: half the pool's cells)."""

    def __init__(self, source: TokenSource, *, prompt_cache: PromptCache | None = None, can_park: bool = False,
                 park_budget: int | None = None, checkpoints: CheckpointPolicy | None = None):
        self.source = source
        self.prompt_cache = prompt_cache
        self.can_park = can_park
        self.park_budget = max(1, park_budget if park_budget is not None else source.info.kv_cells // 2)
        self.seqs = [Seq(i) for i in range(source.n_seq_ids)]
        self.counters = PoolCounters()
        # memory that cannot drop its tail: prefixes are reused from checkpoints only (None: plain KV cells)
        caps = source.capabilities
        self._cut, self._positions = cut_of(caps.media), positions_of(caps.media)
        self._ckpt: Checkpoints | None = caps.checkpoints
        self._states: SequenceStates | None = caps.states
        self.checkpointing = (checkpoints or CheckpointPolicy()) if caps.checkpoints is not None else None

    @property
    def _ck(self) -> Checkpoints:
        """The source's checkpoints (asked only while :attr:`checkpointing` is on)."""
        assert self._ckpt is not None
        return self._ckpt

    @property
    def _st(self) -> SequenceStates:
        """The source's sequence states (asked only with a prompt cache or parking, which need them)."""
        assert self._states is not None, "this source cannot save sequence states"
        return self._states

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
        seen: set[int] = set()
        for s in list(self.seqs):
            for c in list(s.checkpoints):
                if id(c) not in seen:  # a prefix restored into another sequence shares its checkpoints
                    seen.add(id(c))
                    u.checkpoints += 1
                    u.checkpoint_bytes += len(c.data)
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
        if self.checkpointing is not None:
            return self._place_from_checkpoints(owner, prompt)
        src = self.source
        while True:
            best, best_n = None, 0
            for s in self.seqs:
                n = common_prefix(s.tokens, prompt)
                if n > best_n or (n == best_n and best is not None and n > 0 and best.owner is not None
                                  and s.owner is None):
                    best, best_n = s, n
            if best is not None and best_n < COPY_MIN and not _continues(best, best_n, prompt):
                best, best_n = None, 0  # a few shared tokens: evaluated again, not copied from wherever they are
            if best is None or best.parked is None or self._unpark(best):
                break  # (a parked sequence that no longer fits the pool is emptied: look again)
        seq: Seq | None = None
        copied = 0
        if best is not None and best.owner is None and _continues(best, best_n, prompt):
            # the same conversation continuing (or the same prompt again; or its next turn, whose copy of the last
            # answer tokenizes otherwise than the answer was sampled: only that answer's tail is cut, no copy)
            seq = best
        elif best is not None and best_n > 0:
            # a shared prefix (a system prompt): copy it into the sequence this request may take, which is
            # an empty one, else the idle one used least recently (that may be ``best`` itself: then trim it)
            target = self._victim()
            if target is best:
                seq = best
            elif target is not None:
                if target.tokens:
                    self.counters.evictions += 1
                self.save_unsaved(target)
                target.parked = None
                best_n, pos = self._cut(best.tokens, best_n)
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
            keep, pos = self._cut(seq.tokens, keep)
            self.save_unsaved(seq, keep)
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

    # ------------------------------------------------------------------ memory without rewind: checkpoints

    def _usable(self, s: Seq, prompt: list[int]) -> tuple[int, Checkpoint | None, Any]:
        """What ``s`` can give ``prompt`` on memory without rewind: (tokens, the checkpoint to restore them from,
        or None when ``s`` itself continues; the saved logits after the whole prompt, an exact repeat)."""
        n = common_prefix(s.tokens, prompt)
        if n == 0:
            return 0, None, None
        if n == len(s.tokens) and n < len(prompt):
            return n, None, None  # the same conversation continuing: append to it
        saved = s.prompt_logits
        logits = saved[1] if saved is not None and saved[0] == len(prompt) == n else None  # an exact repeat
        if logits is not None and n == len(s.tokens):
            return n, None, logits  # (the answer added nothing to the sequence)
        limit = n if logits is not None else min(n, len(prompt) - 1)  # else the last token is evaluated again
        if s.owner is None and s.in_pool() and (self._ckpt is None or self._ckpt.can_cut(s.id, limit)):
            return limit, None, logits if limit == n else None  # (a window still holding what follows the cut)
        ck = next((c for c in reversed(s.checkpoints) if c.n <= limit), None)
        if ck is None:
            return 0, None, None
        return ck.n, ck, logits if ck.n == n else None

    def _place_from_checkpoints(self, owner: object, prompt: list[int]) -> Placement:
        """:meth:`place` on memory that cannot drop its tail: a sequence whose tokens all start the prompt
        continues; any other prefix comes from the latest checkpoint at or before the divergence, restored into
        a fresh sequence (the attention cells below it copied, the partial state loaded), so the sequence it
        came from stays whole for its own conversation."""
        src = self.source
        held = max((common_prefix(s.tokens, prompt) for s in self.seqs), default=0)
        while True:
            best, best_n, best_ck, best_lg = None, 0, None, None
            for s in self.seqs:
                n, ck, lg = self._usable(s, prompt)
                if ck is None and s.owner is not None:
                    continue  # a running request's sequence: only a checkpoint of it can be shared
                if n > best_n or (n == best_n and best is not None and n > 0 and ck is None and best_ck is not None):
                    best, best_n, best_ck, best_lg = s, n, ck, lg
            if best is None or best.parked is None or self._unpark(best):
                break  # (a parked sequence that no longer fits the pool is emptied: look again)
        seq: Seq | None = None
        copied = 0
        if best is not None and best_ck is None:
            seq = best  # continues (or the same prompt again, with nothing evaluated after it), cut where it left
            if best_n < len(seq.tokens) and common_prefix(best.tokens, prompt) < len(prompt):
                # another conversation sharing a prefix that a window still holds: copied, as plain cells are
                target = self._victim()
                if target is not None and target is not best:
                    if target.tokens:
                        self.counters.evictions += 1
                    self.drop(target)
                    keep, pos = self._cut(best.tokens, best_n)
                    ok = src.seq_cp(best.id, target.id, pos)
                    target.tokens = list(best.tokens[:keep]) if ok else []
                    target.checkpoints = [c for c in best.checkpoints if c.n <= keep] if ok else []
                    seq, copied = target, (keep if ok else 0)
            if best_n < len(seq.tokens):
                keep, pos = self._cut(seq.tokens, best_n)
                self.save_unsaved(seq, keep)
                if src.seq_rm(seq.id, pos):
                    del seq.tokens[keep:]
                    seq.checkpoints = [c for c in seq.checkpoints if c.n <= keep]
                else:
                    self.drop(seq)
                    best_lg = None
        elif best is not None and best_ck is not None:
            target = self._victim(exclude=best)
            if target is not None:
                if target.tokens:
                    self.counters.evictions += 1
                self.drop(target)
                if self._ck.checkpoint_restore(best.id, target.id, best_ck.n, best_ck.data):
                    target.tokens = list(prompt[:best_ck.n])
                    target.checkpoints = [c for c in best.checkpoints if c.n <= best_ck.n]
                    target.prompt_logits = (best_ck.n, best_lg) if best_lg is not None else None
                    copied = best_ck.n
                    self.counters.checkpoints_restored += 1
                else:
                    log.warning("a checkpoint of %d tokens could not be restored; the prompt is evaluated", best_ck.n)
                    target.tokens, target.checkpoints, target.prompt_logits = [], [], None
                seq = target
        if seq is None:
            seq = self._free_seq()
            if seq is None:  # cannot happen: there are more sequence ids than slots
                raise BackendError("No free sequence in the KV pool.")
        seq.owner, seq.no_join = owner, False
        out = Placement(seq, copied=copied)
        keep = len(seq.tokens)
        if keep < held < len(prompt):
            out.diverged = held
        if best_lg is not None and keep == len(prompt):
            out.logits = best_lg  # exact repeat: sample from the saved row
        if not (seq.prompt_logits is not None and seq.prompt_logits[0] <= keep):
            seq.prompt_logits = None
        pc = self.prompt_cache
        if out.logits is None and pc is not None and pc.wants(len(prompt)):
            keep, out.restored = self._restore(seq, prompt, keep)
            if out.restored:
                out.copied = 0
        out.cached, out.copied = keep, min(out.copied, keep)
        self.counters.prompt_tokens_cached += keep
        self.counters.prompt_tokens_copied += out.copied
        return out

    def checkpoint_points(self, prompt: list[int], points: Iterable[int] = (), *, chat: bool = False) -> list[int]:
        """Where a checkpoint of ``prompt``'s sequence is worth taking (empty when the memory needs none): the
        given ``points`` (a system prompt's end, :attr:`Placement.diverged`), each message start of a ``chat``
        prompt (the positions of the
        token that starts the first message: a chat template's turn-start token), each image's start, every
        :attr:`CheckpointPolicy.every` tokens, and the end of the prompt. At most ``per_seq`` of them: the
        first and the latest."""
        pol = self.checkpointing
        if pol is None or not prompt:
            return []
        from backends.contract.media import is_image_token

        out = {n for n in points if 0 < n <= len(prompt)}
        out.add(len(prompt))
        out.update(range(pol.every, len(prompt), pol.every))
        lead = 0 if prompt[0] in prompt[1:] or len(prompt) < 2 else 1  # (a BOS before the first message)
        start = prompt[lead]
        if chat and not is_image_token(start):
            out.update(i for i in range(lead + 1, len(prompt)) if prompt[i] == start)
        out.update(i for i in range(1, len(prompt)) if is_image_token(prompt[i]) and not is_image_token(prompt[i - 1]))
        ordered = sorted(out)
        if len(ordered) > pol.per_seq:
            ordered = [ordered[0], *ordered[len(ordered) - pol.per_seq + 1:]]
        return ordered

    def checkpoint(self, seq: Seq) -> None:
        """Take a checkpoint of ``seq`` as it is now (it holds the first ``len(seq.tokens)`` of its prompt) and
        keep the pool's checkpoints within the policy's bounds."""
        pol = self.checkpointing
        n = len(seq.tokens)
        if pol is None or n == 0 or (seq.checkpoints and seq.checkpoints[-1].n >= n):
            return
        try:
            data = self._ck.checkpoint_save(seq.id)
        except Exception as e:  # noqa: BLE001 - a checkpoint that cannot be taken costs only a later evaluation
            log.warning("could not take a checkpoint of %d tokens: %s", n, e)
            return
        seq.checkpoints.append(Checkpoint(n, data))
        self.counters.checkpoints_taken += 1
        if len(seq.checkpoints) > pol.per_seq:
            del seq.checkpoints[1]  # the first (a system prompt's) and the latest stay
        budget = pol.bytes_per_slot * max(1, self.source.info.slots)
        while self.usage().checkpoint_bytes > budget:
            holders = [s for s in self.seqs if s.checkpoints and s is not seq] or [seq]
            victim = min(holders, key=lambda s: (s.owner is not None, s.last_used))
            if victim is seq and len(seq.checkpoints) == 1:
                return  # one checkpoint larger than the budget: kept until the next one
            del victim.checkpoints[1 if len(victim.checkpoints) > 1 else 0]

    def _restore(self, seq: Seq, prompt: list[int], keep: int) -> tuple[int, int]:
        """(tokens held, tokens restored): the longest prefix of ``prompt`` saved on disk, loaded into ``seq``
        when it beats ``keep``."""
        pc = self.prompt_cache
        assert pc is not None
        # memory without rewind: a state of the whole prompt could not give back the last token to evaluate
        n, data = pc.lookup(prompt, max_len=len(prompt) - 1 if self.checkpointing is not None else None,
                            min_len=keep + 1)  # (an entry no longer than what the pool holds is not read)
        if data is None or n <= keep:
            return keep, 0
        if not self._st.state_load(seq.id, data):
            pc.remove(prompt[:n], "the backend refused it")
            self.source.seq_rm(seq.id)
            seq.tokens, seq.prompt_logits, seq.checkpoints = [], None, []
            return 0, 0
        seq.tokens, seq.prompt_logits, seq.checkpoints = list(prompt[:n]), None, []
        if self.checkpointing is not None:
            self.checkpoint(seq)  # a later divergence after it comes back here
        keep = min(n, len(prompt) - 1)  # logits are not saved: the last prompt token is evaluated again
        if keep < n:
            keep, pos = self._cut(seq.tokens, keep)
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
        if self.checkpointing is not None:
            return self._join_checkpoint(seq, prompt, have, limit)
        best, best_n = None, have
        for s in self.seqs:
            if s is not seq and s.in_pool():
                n = min(common_prefix(s.tokens, prompt), limit)
                if n > best_n:
                    best, best_n = s, n
        if best is not None:
            best_n = self._cut(best.tokens, best_n)[0]
        if best is None or best_n - have < COPY_MIN:
            return Join(False, 0)
        if not self.source.seq_cp(best.id, seq.id, self._positions(best.tokens[:best_n])):
            seq.tokens, seq.prompt_logits, seq.no_join = [], None, True  # the copy emptied it
            return Join(False, 0)
        seq.tokens, seq.prompt_logits = list(best.tokens[:best_n]), None
        gained = best_n - have
        self.counters.prompt_tokens_cached += gained
        self.counters.prompt_tokens_copied += gained
        return Join(False, gained)

    def _join_checkpoint(self, seq: Seq, prompt: list[int], have: int, limit: int) -> Join:
        """:meth:`join`'s copy on memory without rewind: the latest checkpoint of another sequence that holds
        more of ``prompt`` than ``seq`` does, restored into ``seq``."""
        best, best_ck = None, None
        for s in self.seqs:
            if s is seq or not s.in_pool():
                continue
            n = min(common_prefix(s.tokens, prompt), limit)
            ck = next((c for c in reversed(s.checkpoints) if c.n <= n), None)
            if ck is not None and ck.n > (best_ck.n if best_ck is not None else have):
                best, best_ck = s, ck
        if best is None or best_ck is None or best_ck.n - have < COPY_MIN:
            return Join(False, 0)
        if not self._ck.checkpoint_restore(best.id, seq.id, best_ck.n, best_ck.data):
            seq.tokens, seq.prompt_logits, seq.checkpoints, seq.no_join = [], None, [], True
            return Join(False, 0)
        seq.tokens, seq.prompt_logits = list(prompt[:best_ck.n]), None
        seq.checkpoints = [c for c in best.checkpoints if c.n <= best_ck.n]
        gained = best_ck.n - have
        self.counters.prompt_tokens_cached += gained
        self.counters.prompt_tokens_copied += gained
        self.counters.checkpoints_restored += 1
        return Join(False, gained)

    def trim(self, seq: Seq, keep: int) -> None:
        """Drop the tokens of ``seq`` after the first ``keep`` (rejected drafts)."""
        if keep < len(seq.tokens):
            keep, pos = self._cut(seq.tokens, keep)
            self.save_unsaved(seq, keep)
            self.source.seq_rm(seq.id, pos)
            del seq.tokens[keep:]
            seq.checkpoints = [c for c in seq.checkpoints if c.n <= keep]

    # ------------------------------------------------------------------ victims

    def _victim(self, exclude: Seq | None = None) -> Seq | None:
        """The sequence a new request may take: an empty one, else the idle one used least recently."""
        empty = [s for s in self.seqs if s.owner is None and not s.tokens and s is not exclude]
        if empty:
            return empty[0]
        return min((s for s in self.seqs if s.owner is None and s is not exclude), key=lambda s: s.last_used,
                   default=None)

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
        """Empty ``s`` (its cells, or its parked state); the prefixes it owes the prompt cache are saved first."""
        self.save_unsaved(s)
        if s.parked is None:
            self.source.seq_rm(s.id)
        s.tokens, s.prompt_logits, s.parked, s.checkpoints = [], None, None, []

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
            short = [t for t in s.unsaved if len(t) < n]  # owed prefixes that parked bytes cannot give
            if short:
                s.unsaved = [t for t in s.unsaved if len(t) >= n]
                for t in short:
                    self._save_prefix(s, t)
            try:
                data = self._st.state_save(s.id)
            except Exception as e:  # noqa: BLE001 - a state that cannot be taken: the cells just go
                log.debug("could not park sequence %d: %s", s.id, e)
                self.drop(s)
                continue
            src.seq_rm(s.id)
            s.parked = data  # (the whole prompt it owes the disk cache is saved from these bytes, later)

    def _unpark(self, s: Seq) -> bool:
        """Load a parked sequence back into the pool; False (and the sequence empty) when it does not fit."""
        data = s.parked
        assert data is not None
        s.parked = None
        try:
            ok = self._st.state_load(s.id, data)
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
            keep, pos = self._cut(seq.tokens, len(seq.tokens))
            self.save_unsaved(seq, keep)
            if self.source.seq_rm(seq.id, pos):
                del seq.tokens[keep:]
                seq.checkpoints = [c for c in seq.checkpoints if c.n <= keep]
            else:
                self.drop(seq)

    def save_prefixes(self, seq: Seq, prompt: list[int], points: Iterable[int] = ()) -> None:
        """Save the KV state of the long prefixes of ``prompt`` that ``seq`` holds to the disk cache now (see
        :meth:`owe_prefixes`, which the loop uses: the same prefixes, saved later)."""
        self.owe_prefixes(seq, prompt, points)
        self.save_unsaved(seq)

    def owe_prefixes(self, seq: Seq, prompt: list[int], points: Iterable[int] = ()) -> None:
        """Note the long prefixes of ``prompt`` that ``seq`` holds (where the system prompt ends, ``points``; the
        whole prompt: the next turn of a chat starts with it; or as much of it as was evaluated) as owed to the
        disk cache, without copying anything: the copy out of the pool is taken later, off the path of the next
        request (:meth:`save_owed` while the model idles; before the sequence's cells change or go: a cut, an
        eviction, parking; at close). A new whole prompt of the same sequence replaces the one it extends (the
        previous turn of the same conversation: the disk keeps the latest)."""
        pc = self.prompt_cache
        if pc is None:
            return
        held = common_prefix(seq.tokens, prompt)
        lengths = sorted({n for n in (*points, len(prompt), held) if pc.wants(n) and n <= held})
        marks = {n for n in points if n <= held}
        if not lengths:
            return
        # what it owed before and still holds: a mark (a system prompt) stays; a previous whole prompt that this
        # one extends goes (the next turn of the same conversation)
        owed = [t for t in seq.unsaved if len(t) in marks and t == seq.tokens[:len(t)]]
        have = {len(t) for t in owed}
        owed += [seq.tokens[:n] for n in lengths if n not in have]
        seq.unsaved = sorted(owed, key=len)

    def _saveable(self, s: Seq) -> list[list[int]]:
        """The prefixes ``s`` owes that can be copied out now without touching its cells: a parked state, its whole
        sequence, or a prefix through an empty sequence id (with a KV stream per slot there is seldom one: those wait
        until the cells go, :meth:`save_unsaved`)."""
        if s.parked is not None or self._spare(s) is not None:
            return s.unsaved
        return [t for t in s.unsaved if len(t) == len(s.tokens)]

    def _spare(self, s: Seq) -> Seq | None:
        return next((t for t in self.seqs if t.owner is None and not t.tokens and t is not s), None)

    def owes(self) -> bool:
        """Whether some sequence owes prefixes to the disk cache that can be saved now."""
        return any(self._saveable(s) for s in self.seqs)

    def save_owed(self) -> bool:
        """Save one owed prefix (the most recently used sequence's longest first); False when none is left. The
        loop calls it while the model idles, one at a time, looking at its queue between them."""
        owing = [s for s in self.seqs if self._saveable(s)]
        if not owing:
            return False
        s = max(owing, key=lambda s: s.last_used)
        toks = self._saveable(s)[-1]
        s.unsaved.remove(toks)
        if s.parked is not None:  # (the shorter prefixes of a parked sequence were saved when it was parked)
            self._save_parked(s, toks)
        else:
            self._save_prefix(s, toks)
        return self.owes()

    def save_unsaved(self, seq: Seq, keep: int = 0) -> None:
        """Save now what ``seq`` owes the disk cache beyond its first ``keep`` tokens (those cells are about to
        change or go)."""
        if not seq.unsaved or len(seq.unsaved[-1]) <= keep:
            return
        owed = [t for t in seq.unsaved if len(t) > keep]
        seq.unsaved = [t for t in seq.unsaved if len(t) <= keep]
        for toks in reversed(owed):  # the longest first: the cells past each one are going anyway
            if seq.parked is not None:
                self._save_parked(seq, toks)
            elif not self._save_prefix(seq, toks, cut=True):
                return

    def _save_parked(self, seq: Seq, toks: list[int]) -> None:
        """The whole state of a parked sequence to the disk cache from its parked bytes (no copy out of the pool)."""
        pc = self.prompt_cache
        if pc is not None and seq.parked is not None and toks == seq.tokens and not pc.has(toks):
            pc.save(toks, seq.parked)

    def _save_prefix(self, seq: Seq, toks: list[int], *, cut: bool = False) -> bool:
        """Copy the state of ``seq``'s first ``len(toks)`` tokens (still ``toks``) out of the pool and queue it for
        the disk (the write and its hash on the cache's thread); ``cut``: the cells past them are going, so they
        may go first (no other sequence id needed); False: no state can be taken now."""
        pc = self.prompt_cache
        n = len(toks)
        if pc is None or not seq.in_pool() or seq.tokens[:n] != toks or pc.has(toks):
            return True
        if cut and n < len(seq.tokens) and self.checkpointing is None:
            at, pos = self._cut(seq.tokens, n)
            if at == n and self.source.seq_rm(seq.id, pos):
                del seq.tokens[n:]
                seq.prompt_logits = seq.prompt_logits if seq.prompt_logits and seq.prompt_logits[0] <= n else None
        tmp = None
        if n != len(seq.tokens):
            tmp = self._spare(seq)
            if tmp is None:
                return False
        try:
            if tmp is None:
                data = self._st.state_save(seq.id)
            elif self.checkpointing is not None:  # memory without rewind: from a checkpoint at n, or not
                ck = next((c for c in seq.checkpoints if c.n == n), None)
                if ck is None or not self._ck.checkpoint_restore(seq.id, tmp.id, n, ck.data):
                    return True
                data = self._st.state_save(tmp.id)
                self.source.seq_rm(tmp.id)
            elif self._cut(toks, n)[0] != n:
                return True  # inside an image that is kept whole
            elif self.source.seq_cp(seq.id, tmp.id, self._positions(toks)):
                data = self._st.state_save(tmp.id)
                self.source.seq_rm(tmp.id)
            else:
                return True
        except Exception as e:  # noqa: BLE001 - a cache that cannot be saved costs nothing but the miss
            log.warning("prompt cache: could not take the state of %d tokens: %s", n, e)
            return False
        pc.save(toks, data)
        return True

    def close(self) -> None:
        """Save what is owed to the prompt cache and finish its writes (the source is the caller's to close)."""
        if self.prompt_cache is not None:
            for s in self.seqs:
                self.save_unsaved(s)
            self.prompt_cache.close()


__all__ = ["COPY_MIN", "JOIN_MIN", "PARK_ALONE", "KVPool"]
