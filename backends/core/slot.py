"""A request's slot in the decode loop, in an explicit state, as llama.cpp's server keeps its slots.

A :class:`Slot` is one request from submission to its last event. Its :class:`SlotState` says what the loop
does with it each step, and changes only through the transition methods below, which refuse an illegal
move (:class:`IllegalTransition`: a bug in the loop, never a user's error)::

    LOADING_MEDIA ──► QUEUED ──► PREFILL ──► DECODE ──► DONE
    (audio clips       │            │  ▲         ▲
     decoded off       └──► READY ──┼──┘         │
     the loop)                      └────────────┴──► DONE  (finished, cancelled or failed: from any state)

* ``LOADING_MEDIA`` — its audio clips are decoded on a thread of their own before it is queued;
* ``QUEUED`` — it waits for a free slot (no sequence yet);
* ``PREFILL`` — admitted with a sequence of the KV pool: its prompt is evaluated, one chunk per step (waiting
  while an earlier request evaluates the same prefix, or while the pool is full);
* ``READY`` — admitted with its whole prompt cached: the first token is sampled from the saved logits of the
  prompt's last token, without an evaluation;
* ``DECODE`` — one sampled token (:attr:`Slot.last`, plus drafts) goes into each step;
* ``DONE`` — ended; its sequence is released to the pool as an idle prefix.

What happens to an idle sequence afterwards (kept, parked in host memory, evicted, saved to disk) is the KV
pool's (:mod:`backends.core.kvpool`), not a slot's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from backends.contract.events import Event
from backends.contract.source import Sampler
from backends.core.channel import Channel
from backends.core.kvseq import Seq
from backends.core.stream import RequestStream


class SlotState(enum.Enum):
    LOADING_MEDIA = "loading media"
    QUEUED = "queued"
    PREFILL = "prefill"
    READY = "ready"
    DECODE = "decode"
    DONE = "done"


_LEGAL: dict[SlotState, frozenset[SlotState]] = {
    SlotState.LOADING_MEDIA: frozenset({SlotState.QUEUED, SlotState.DONE}),
    SlotState.QUEUED: frozenset({SlotState.PREFILL, SlotState.READY, SlotState.DONE}),
    SlotState.PREFILL: frozenset({SlotState.DECODE, SlotState.DONE}),
    SlotState.READY: frozenset({SlotState.DECODE, SlotState.DONE}),
    SlotState.DECODE: frozenset({SlotState.DECODE, SlotState.DONE}),
    SlotState.DONE: frozenset(),
}


_DECODE = SlotState.DECODE


class IllegalTransition(RuntimeError):
    """A slot was moved in a way its state does not allow (a bug in the decode loop)."""


@dataclass(eq=False, slots=True)
class Slot:
    """One request in the decode loop. The loop reads :attr:`state`, :attr:`last` and :attr:`saved`; only the
    transition methods change them (and :attr:`seq`, once, at admission)."""

    stream: RequestStream
    channel: Channel[Event]
    t_submit: int
    sampler: Sampler | None = None
    admitted: int = 0  # ns
    points: list[int] = field(default_factory=list)  # prompt lengths at which its sequence takes a checkpoint
    _state: SlotState = SlotState.QUEUED
    _seq: Seq | None = None
    _last: int | None = None  # sampled, sent, not yet evaluated (DECODE)
    _saved: Any = None  # logits to sample the first token from (READY)
    history: list[SlotState] = field(default_factory=list)  # the states it went through, in order
    lagging: bool = False  # its consumer was still busy when a step began: not waited for until it has caught up

    def __post_init__(self) -> None:
        self.history.append(self._state)

    @classmethod
    def loading_media(cls, stream: RequestStream, channel: Channel[Event], t_submit: int) -> Slot:
        """A slot whose request brings audio clips, decoded before it is queued."""
        return cls(stream, channel, t_submit, _state=SlotState.LOADING_MEDIA)

    @property
    def state(self) -> SlotState:
        return self._state

    @property
    def seq(self) -> Seq | None:
        """Its KV sequence, from admission on."""
        return self._seq

    @property
    def last(self) -> int | None:
        """The token sampled last and not yet evaluated (only while it decodes)."""
        return self._last

    @property
    def saved(self) -> Any:
        """Saved logits to sample its first token from (only while READY and not yet sampled)."""
        return self._saved

    def _go(self, to: SlotState) -> None:
        if to not in _LEGAL[self._state]:
            raise IllegalTransition(f"a slot cannot go from {self._state.name} to {to.name}")
        if to is not self._state:
            self.history.append(to)
        self._state = to

    # ------------------------------------------------------------------ transitions

    def queue(self) -> None:
        """LOADING_MEDIA → QUEUED: its clips are ready."""
        self._go(SlotState.QUEUED)

    def admit(self, seq: Seq, saved: Any, points: list[int], now: int) -> None:
        """QUEUED → PREFILL, or READY when ``saved`` logits make its whole prompt cached."""
        self._go(SlotState.PREFILL if saved is None else SlotState.READY)
        self._seq, self._saved, self.points, self.admitted = seq, saved, points, now

    def take_saved(self) -> Any:
        """READY: the saved logits, handed out once (the first token is sampled from them)."""
        if self._state is not SlotState.READY or self._saved is None:
            raise IllegalTransition(f"a slot in {self._state.name} has no saved logits to sample from")
        saved, self._saved = self._saved, None
        return saved

    def decoded(self, token: int) -> None:
        """PREFILL, READY or DECODE → DECODE: ``token`` was sampled and sent; the next step evaluates it."""
        if self._state is not _DECODE:  # (every token but the first stays in DECODE)
            self._go(_DECODE)
        self._last = token

    def finish(self) -> None:
        """Any state but DONE → DONE (finished, cancelled or failed)."""
        self._go(SlotState.DONE)
        self._last = self._saved = None
