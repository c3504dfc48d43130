"""What the KV pool (:mod:`backends.core.kvpool`) keeps for each sequence and reports: a :class:`Seq` (one sequence id
and the tokens its cells hold, its checkpoints, what it owes the prompt cache on disk), the :class:`CheckpointPolicy`
for memory that cannot drop its tail, and the records of a placement, a join, the counters and the usage."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple


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


@dataclass(frozen=True)
class Checkpoint:
    """The partial state (:meth:`Checkpoints.checkpoint_save`) of a sequence when it held exactly its first ``n``
    tokens: with the sequence's attention cells below ``n`` it gives that prefix back."""

    n: int
    data: bytes


@dataclass(frozen=True)
class CheckpointPolicy:
    """Where and how many checkpoints a pool takes, on memory that cannot drop its tail (recurrent state; a
    sliding window kept at window size). A checkpoint is taken when a prompt's evaluation reaches the start of
    each message (the end of the system prompt, each turn boundary of the chat template: the positions of the
    template's turn-start token), the start of each image, every ``every`` tokens of a long prompt and the end
    of the prompt. A sequence keeps at most ``per_seq`` of them (the first, usually the system prompt's, and
    the latest); all sequences together at most ``bytes_per_slot`` times the slots (the least recently used
    sequences' go first). The made 4-layer hybrid's checkpoint is 58 KB, a 4B hybrid's some tens of MB,
    gemma3:270m's (its window) ~8 MB."""

    every: int = 1024
    per_seq: int = 16
    bytes_per_slot: int = 256 << 20


@dataclass
class Seq:
    """One KV sequence id and what its cells hold: one cell per token, at positions ``0 .. len(tokens)-1``, or
    fewer positions where an image takes fewer than its tokens (M-RoPE: see :meth:`MediaInput.positions`)."""

    id: int
    tokens: list[int] = field(default_factory=list)
    owner: object | None = None  # the request running on it; None: idle (its tokens are a prefix for reuse)
    last_used: float = 0.0
    prompt_logits: tuple[int, Any] | None = None  # (prompt length, logits after it) for exact repeats
    parked: bytes | None = None  # its KV state, moved to host memory while other sequences decode (no cells)
    no_join: bool = False  # a copy into it failed (recurrent memory): its request never waits for a prefill
    checkpoints: list[Checkpoint] = field(default_factory=list)  # by n, ascending (memory without rewind)
    unsaved: list[list[int]] = field(default_factory=list)  # prefixes of ``tokens`` owed to the prompt cache on disk

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
    diverged: int = 0  # memory without rewind: where the prompt left the longest prefix the pool held (when that
    # is past what a checkpoint gave back: the next prompt that leaves there finds a checkpoint)


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
    checkpoints_taken: int = 0
    checkpoints_restored: int = 0  # prefixes given back from a checkpoint (their tokens count as copied)


@dataclass
class PoolUsage:
    """Tokens held now, by kind of sequence."""

    active: int = 0  # by sequences of running requests
    idle: int = 0  # in the pool's cells by idle sequences, for reuse
    parked: int = 0  # by idle sequences parked in host memory
    parked_bytes: int = 0
    checkpoints: int = 0  # checkpoints kept (host memory), of all sequences
    checkpoint_bytes: int = 0


__all__ = ["Checkpoint", "CheckpointPolicy", "Join", "Placement", "PoolCounters", "PoolUsage", "Seq", "common_prefix"]
