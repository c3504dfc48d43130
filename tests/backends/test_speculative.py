"""The speculative-decoding controller (``backends.core._speculative.SpecController``) against synthetic timings,
and the draft model's bounded catch-up on the real default model.

The controller is pure logic over reported measurements, so it is driven here by a small simulated machine
(deterministic: a seeded RNG, no wall clock): plain steps cost ``plain`` ms per token; a drafting step with
k drafts costs ``k * draft`` + ``verify(k)`` ms, with acceptance drawn per token; a draft model that has
not seen the last tokens first catches up at ``catchup`` ms per token (as many as the controller allows,
the rest skipped). Noise: every step's time is scaled by a random factor, and now and then another job
takes the core for 100 ms (the longer a step, the likelier). The budget is "never more than 5% slower than
plain decoding" (README).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from backends.core._speculative import SpecController


@dataclass
class Machine:
    plain: float  # ms per plain token
    draft: float  # ms per drafted token
    verify_base: float  # ms of a verification batch of k+1 tokens: verify_base + verify_per * k
    verify_per: float
    accept: float  # per-token acceptance probability
    catchup: float = 0.0  # ms per token a draft model catches up (0: n-gram drafts)
    noise: float = 0.0  # relative spread of every step's time
    preempt: float = 0.0  # preemptions per ms of work: each one adds 100 ms (another job ran)
    rng: random.Random = field(default_factory=lambda: random.Random(7))
    unseen: int = 0  # tokens the draft has not evaluated yet

    def jitter(self, ms: float) -> float:
        out = ms * (1.0 + self.noise * (2 * self.rng.random() - 1))
        if self.rng.random() < ms * self.preempt:
            out += 100.0
        return out

    def step(self, ctl: SpecController, room: int) -> tuple[int, float, float]:
        """One decode step as the backend runs it: (emitted, ms, ms plain decoding would take for them)."""
        k = min(ctl.n_draft(), room)
        if k <= 0:
            ms = self.jitter(self.plain)
            ctl.record(proposed=0, accepted=0, emitted=1, ns=int(ms * 1e6))
            self.unseen += 1
            return 1, ms, self.plain * self.mean_factor
        limit = ctl.max_catchup()
        caught = self.unseen if limit is None else min(self.unseen, limit)
        overhead = self.jitter(caught * self.catchup) if caught > 2 else 0.0
        accepted = 0
        while accepted < k and self.rng.random() < self.accept:
            accepted += 1
        emitted = accepted + 1
        ms = overhead + self.jitter(k * self.draft + self.verify_base + self.verify_per * k)
        ctl.record(proposed=k, accepted=accepted, emitted=emitted, ns=int(ms * 1e6), overhead_ns=int(overhead * 1e6))
        self.unseen = 1  # the draft saw all but the token sampled last
        return emitted, ms, emitted * self.plain * self.mean_factor

    @property
    def mean_factor(self) -> float:
        """What noise and preemption add to a step on average (plain decoding pays it too)."""
        return 1.0 + 100.0 * self.preempt


def session(ctl: SpecController, m: Machine, requests: int, tokens: int, prompt: int = 100) -> list[float]:
    """Per request: time taken / time plain decoding would take (>1: slower)."""
    out = []
    for _ in range(requests):
        m.unseen += prompt  # a new prompt the draft has not seen
        n = 0
        took = plain = 0.0
        while n < tokens:
            e, ms, p = m.step(ctl, tokens - n - 1)
            n += e
            took += ms
            plain += p
        out.append(took / plain)
    return out


# F32 target with a Q4 draft on this 2-core machine, roughly: plain 20 ms/token, a drafted token 9 ms, a
# verification of k+1 tokens 22 + 3k ms, the draft's catch-up 3.5 ms/token.
F32_Q4 = dict(plain=20.0, draft=9.0, verify_base=22.0, verify_per=3.0, catchup=3.5)


def test_a_draft_that_pays_is_kept():
    ctl = SpecController(8)
    slow = session(ctl, Machine(**F32_Q4, accept=0.97), requests=8, tokens=200)
    # each request pays the draft's catch-up on its new prompt (~9% here); drafting itself is ~1.4x
    assert slow[0] < 0.95 and max(slow[1:]) < 0.95 and sorted(slow)[4] < 0.86, slow
    assert ctl.drafting and ctl.lost_probes == 0


def test_a_draft_that_does_not_pay_is_switched_off_and_stays_off():
    ctl = SpecController(8)
    m = Machine(**F32_Q4, accept=0.35)  # mostly rejected: each step costs more than the tokens it yields
    slow = session(ctl, m, requests=20, tokens=200)
    # the first request pays the probe that learns: ~9% here is the draft's catch-up on the 100-token prompt
    assert slow[0] < 1.16, slow
    later = slow[1:]
    assert sum(later) / len(later) < 1.02 and max(later) < 1.08, slow  # a later probe costs its request < 8%
    probes = ctl.probes
    more = session(ctl, m, requests=20, tokens=200)
    assert sum(more) / len(more) < 1.02, more  # probes ever rarer
    assert ctl.probes - probes <= 3 and not ctl.drafting


def test_the_budget_holds_on_a_noisy_machine():
    for accept in (0.2, 0.5, 0.7):
        ctl = SpecController(8)
        m = Machine(**F32_Q4, accept=accept, noise=0.3, preempt=0.001, rng=random.Random(int(accept * 100)))
        slow = session(ctl, m, requests=30, tokens=200)
        assert sum(slow[1:]) / len(slow[1:]) < 1.05, (accept, slow)


def test_a_winning_draft_survives_noise():
    ctl = SpecController(8)
    m = Machine(**F32_Q4, accept=0.95, noise=0.3, preempt=0.001)
    slow = session(ctl, m, requests=12, tokens=200)
    assert sum(slow[1:]) / len(slow[1:]) < 0.92 and ctl.lost_probes == 0, slow


def test_expensive_verification_backs_off():
    """On one core a 9-token F32 batch costs nearly 9 single steps: even perfect acceptance cannot pay."""
    ctl = SpecController(8)
    m = Machine(plain=40.0, draft=18.0, verify_base=40.0, verify_per=36.0, accept=0.97, catchup=7.0)
    slow = session(ctl, m, requests=10, tokens=200)
    assert slow[0] < 1.18 and sum(slow[1:]) / len(slow[1:]) < 1.02 and max(slow[1:]) < 1.08, slow
    assert not ctl.drafting


def test_ngram_without_matches_costs_little():
    """N-gram drafts cost nothing to make and need no catch-up, but a rejected batch costs more than one token."""
    ctl = SpecController(8)
    m = Machine(plain=7.0, draft=0.05, verify_base=8.0, verify_per=1.5, accept=0.05)
    slow = session(ctl, m, requests=10, tokens=128)
    assert sum(slow) / len(slow) < 1.03, slow


def test_margin_zero_always_drafts():
    ctl = SpecController(6)
    ctl.margin = 0.0
    m = Machine(**F32_Q4, accept=0.0)
    for _ in range(300):
        assert ctl.n_draft() > 0
        m.step(ctl, 100)


def test_idle_tokens_count_down_to_the_next_probe():
    """While drafting is paused, ``idle_tokens`` says how many plain tokens pass before a probe may start (a
    drafter that reads hidden states stops reading them until shortly before): never 0 while ``n_draft`` stays
    0 for longer than that, and a probe starts when it reaches 0."""
    ctl = SpecController(8)
    m = Machine(**F32_Q4, accept=0.2)
    assert ctl.idle_tokens() == 0  # learning: drafting
    waits: list[float] = []
    for _ in range(4000):
        idle = ctl.idle_tokens()
        k = ctl.n_draft()
        if not ctl.drafting:
            assert idle > 0 and k == 0
        if k and waits and waits[-1] > 0:  # a probe started: the count had run down to 0
            assert idle == 0, (idle, waits[-5:])
        waits.append(idle)
        m.step(ctl, 100)
    assert ctl.probes >= 3 and ctl.lost_probes >= 3
    paused = [w for w in waits if w > 0]
    assert len(paused) > 3000 and max(paused) > 500  # the gaps grow, so the drafter rests longer and longer


def test_catchup_is_bounded_only_while_probing():
    ctl = SpecController(8, catchup_limit=48, learn_catchup=300)
    assert ctl.max_catchup() == 300  # the first probe, the one that learns: the prompt matters
    m = Machine(**F32_Q4, accept=0.97)
    session(ctl, m, requests=2, tokens=200)
    assert ctl.drafting and ctl.max_catchup() is None  # drafting pays: a new prompt is caught up in full


# ------------------------------------------------------------------------------ the draft model's catch-up


@pytest.fixture(scope="module")
def draft(default_model_path):
    from backends.contract.specs import LoadSpec
    from backends.core.drafting import ModelDrafter
    from backends.llamacpp.source import LlamaCppSource

    d = ModelDrafter(LlamaCppSource(LoadSpec(str(default_model_path), n_ctx=512)))
    yield d
    d.close()


def test_draft_catchup_skips_old_tokens_and_keeps_following(draft):
    src = draft.source
    ids = src.prompt_tokens("The quick brown fox jumps over the lazy dog. " * 12)
    assert len(ids) > 100
    src.seq_rm(0)
    draft.tokens, draft._holes = [], []
    out = draft.propose(ids[:20], 4)
    assert len(out) == 4 and draft.catchup_tokens == 20 and len(draft.tokens) == 20 + 3
    out = draft.propose(ids, 4, max_catchup=16)  # 80+ unseen tokens: only the last 16 are evaluated
    assert draft.catchup_tokens == 16 and len(draft._holes) == 1
    at, skipped = draft._holes[0]  # kept: the 20 tokens (and any of its 3 drafts that were right)
    assert 20 <= at <= 23 and at + skipped + 16 == len(ids)
    assert len(draft.tokens) == at + 16 + 3 and len(out) == 4  # the skipped tokens take no positions
    more = [*ids, *out[:2]]
    draft.propose(more, 4, max_catchup=16)  # a normal step: one or two new tokens, no catch-up
    assert draft.catchup_tokens == 0 and len(draft._holes) == 1
    draft.propose(ids[:10], 4)  # another sequence that differs before the hole: the hole is forgotten
    assert draft._holes == [] and len(draft.tokens) == 10 + 3
