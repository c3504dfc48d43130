"""A request's slot in the decode loop: its explicit states and the only transitions between them
(:mod:`backends.core.slot`), alone and under the real loop (the fake source: a prefill that takes many steps)."""

from __future__ import annotations

import threading
import time

import pytest

from backends.contract.events import Done, Event
from backends.contract.specs import GenerateRequest, LoadSpec, Tuning
from backends.core.channel import Channel
from backends.core.kvseq import Seq
from backends.core.slot import IllegalTransition, Slot, SlotState
from backends.core.stream import RequestStream
from backends.registry import load
from tests.fakes import fake

S = SlotState


def slot(*, media: bool = False) -> Slot:
    stream, channel = RequestStream(GenerateRequest(prompt="hi")), Channel[Event]()
    return Slot.loading_media(stream, channel, 0) if media else Slot(stream, channel, 0)


def test_a_slot_goes_through_its_states_by_its_transitions_only():
    s = slot(media=True)
    assert s.state is S.LOADING_MEDIA and s.seq is None and s.last is None
    s.queue()
    s.admit(Seq(3), None, [16], now=5)
    assert (s.state, s.seq.id if s.seq else None, s.points, s.admitted) == (S.PREFILL, 3, [16], 5)
    s.decoded(7)
    s.decoded(8)  # one token a step: DECODE stays DECODE
    assert s.state is S.DECODE and s.last == 8
    s.finish()
    assert s.state is S.DONE and s.last is None
    assert s.history == [S.LOADING_MEDIA, S.QUEUED, S.PREFILL, S.DECODE, S.DONE]

    cached = slot()  # a fully cached prompt: the first token from the saved logits, no evaluation
    cached.admit(Seq(0), [0.5, 1.5], [], now=1)
    assert cached.state is S.READY and cached.take_saved() == [0.5, 1.5] and cached.saved is None
    cached.decoded(1)
    assert cached.history == [S.QUEUED, S.READY, S.DECODE]


def test_cancelled_mid_prefill_a_slot_is_done_without_decoding():
    s = slot()
    s.admit(Seq(0), None, [], now=1)
    s.finish()
    assert s.history == [S.QUEUED, S.PREFILL, S.DONE]
    with pytest.raises(IllegalTransition, match="from DONE to DECODE"):
        s.decoded(1)  # a token sampled for a request that has ended


@pytest.mark.parametrize("move", [
    lambda s: s.decoded(1),  # a queued slot has no sequence to decode in
    lambda s: s.take_saved(),  # nor saved logits
    lambda s: s.queue(),  # it is queued already
])
def test_an_illegal_transition_raises_and_changes_nothing(move):
    s = slot()
    with pytest.raises(IllegalTransition):
        move(s)
    assert s.state is S.QUEUED and s.history == [S.QUEUED]
    s.admit(Seq(1), None, [], now=1)
    with pytest.raises(IllegalTransition, match="from PREFILL to QUEUED"):
        s.queue()
    s.finish()
    with pytest.raises(IllegalTransition, match="from DONE to DONE"):
        s.finish()  # ended twice: its sequence would be released twice


def _wait_for(m, want: list[SlotState], timeout: float = 10.0) -> list[SlotState]:
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        seen = m.slot_states()
        if seen == want:
            return seen
        time.sleep(0.005)
    return seen


def test_the_loop_cancels_a_slot_mid_prefill_and_admits_the_queued_one():
    """One slot, a 400-token prompt fed 8 tokens a step (20 ms each): the first request is in PREFILL for
    seconds, the second waits QUEUED; cancelled mid-prefill, the first ends at once with no token generated
    and the second takes the slot."""
    spec = LoadSpec("fake.gguf", slots=1, n_batch=8, tuning=Tuning(prefill_chunk=8))
    with load(fake(delay=0.02, reply="ok"), spec) as m:
        cancel = threading.Event()
        first = m.submit(GenerateRequest(prompt="x" * 400), cancel)
        second = m.submit(GenerateRequest(prompt="y"))
        assert _wait_for(m, [S.PREFILL, S.QUEUED]) == [S.PREFILL, S.QUEUED]
        cancel.set()
        events = list(first)
        assert isinstance(events[-1], Done) and events[-1].finish_reason == "cancelled"
        assert events[-1].stats.eval_count == 0 and len(events) == 1  # never reached DECODE
        rest = list(second)
        assert isinstance(rest[-1], Done) and rest[-1].finish_reason == "stop"
        assert "".join(getattr(e, "text", "") for e in rest) == "ok"
        assert m.slot_states() == []
