"""The speculative-decoding controller, one for every backend: how many tokens to draft at the next step.

The drafts themselves (prompt lookup, a draft model following the target) are :mod:`backends.core.drafting`'s;
their verification in the target's batch is a step of the decode loop (:mod:`backends.core.loop`).

The :class:`SpecController` (backend-neutral: it sees only proposed/accepted/emitted tokens and times)
picks how many tokens to draft from a cost model it measures online (a plain step, and what a drafted
token adds to a step, side by side in the same seconds; the acceptance rate), switches drafting off when
the best expected speed-up is below 1.03, and pays for every later probe out of a time budget (2% of the
plain-equivalent decode time, a draft model's catch-up included), with probes ever rarer and a draft
model's catch-up bounded during them.
"""

from __future__ import annotations

import statistics
from typing import Any


class SpecController:
    """How many tokens to draft next (0 = decode plainly), from what drafting costs and what it gains.

    Backend-neutral: the caller reports every decode step with :meth:`record` (tokens proposed, accepted,
    emitted, its wall time in ns, and ``overhead_ns``, the part of it a draft model spent catching up on
    tokens it had not seen: the prompt, or what was decoded plainly meanwhile) and asks :meth:`n_draft`
    before the next one. :meth:`max_catchup` says how many unseen tokens a draft may evaluate now (None =
    all); a draft that has more skips the older ones, so that a probe stays cheap.

    * **A cost model, measured online and side by side.** A plain step costs ``p`` ns: the median of the
      last ``samples`` steps without drafts. While drafting, every ``interleave``-th step is such a plain
      step (during a probe, every other one), so ``p`` is measured in the same seconds as the drafting it
      is compared with: on a machine shared with other jobs the speed changes from one second to the next,
      and a ``p`` from a minute earlier would decide at random. A drafting step with k proposals costs
      ``p * (1 + k*c)``: drafting k tokens, and verifying k+1 in one batch instead of one (on a CPU a bigger
      batch costs more; that is in ``c`` too). ``c`` is the median over the last ``samples`` drafting steps
      of ``(ns/p - 1) / k``, catch-up left out, so a step that another job preempted does not move it, and
      steps cut short at the end of an answer fit the same model. Each drafted token is accepted with
      probability ``a`` (accepted / judged drafts, decayed per step), so a step yields
      ``(1 - a**(k+1)) / (1 - a)`` tokens on average. The controller drafts the k with the best expected
      speed-up over plain decoding while that speed-up is ≥ 1/``margin``, and decodes plainly otherwise.
    * **The budget.** A ledger holds the time drafting may still lose against plain decoding: every step
      adds ``budget`` x its plain-equivalent time (emitted tokens x ``p``), every drafting step takes away
      what it cost beyond that (catch-up included, a preempted step counted at 3x its expected cost; a step
      that gains adds). Credit is capped at ``budget``
      x ``cap_tokens`` plain tokens. Once drafting has lost, plain decoding runs until both (a) at least
      ``gap`` tokens have passed (``first_gap``, x4 after every probe that loses, up to ``max_gap``) and (b)
      the credit covers what the last probe cost. A probe is ``probe`` drafting steps (and ``probe_tokens``
      tokens; at most 3 x ``probe`` steps) alternating with plain ones, the catch-up limited to
      ``catchup_limit`` tokens. So a draft that never pays costs about ``budget`` of the decode time, plus
      the first probe: the one that learns, once per loaded model, twice as long, with up to
      ``learn_catchup`` tokens of the prompt caught up (a draft that copies from the prompt needs to have
      seen it; that first catch-up is the price of loading a draft at all and is not charged).
    * **Resting.** While drafting is paused, :meth:`idle_tokens` says how many plain tokens pass before the next
      probe may start; the caller may report those steps with the cheap :meth:`rest` (tokens only, no timing)
      and let a drafter that reads the target's hidden states stop reading them until shortly before the probe
      (:class:`~backends.core.drafting.Speculation`), so that a paused draft costs nothing beyond its probes.
    * ``margin`` ≤ 0 drafts ``n_max`` tokens always (for tests of the output, whatever the timings say).

    The state lives as long as the loaded model, so what one request learnt the next one uses.
    """

    def __init__(self, n_max: int, *, probe: int = 3, probe_tokens: int = 8, margin: float = 0.97,
                 budget: float = 0.02, cap_tokens: int = 2048, first_gap: int = 64, max_gap: int = 16384,
                 interleave: int = 8, catchup_limit: int = 32, learn_catchup: int = 512, samples: int = 9):
        self.n_max = max(1, n_max)
        self.n = min(self.n_max, 4)  # what to draft next; while learning, adapted by acceptance alone
        self.probe, self.probe_tokens, self.margin, self.budget = probe, probe_tokens, margin, budget
        self.cap_tokens, self.first_gap, self.max_gap, self.interleave = cap_tokens, first_gap, max_gap, interleave
        self.catchup_limit, self.learn_catchup, self.samples = catchup_limit, learn_catchup, samples
        self._plain: list[float] = []  # ns of the last plain steps
        self._costs: list[float] = []  # c of the last drafting steps (in plain steps)
        self._raw: list[tuple[float, float, float, float]] = []  # (k, ns net, ns, emitted): steps before p was known
        self._acc, self._tried = 3.5, 5.0  # decayed sums of accepted and of judged drafts (a prior of 0.7)
        self.mode = "spec"  # the first probe learns what drafting does
        self._probing = self._learning = True
        self._plain_next = False  # the next step is a plain one (probes alternate; drafting interleaves)
        self._run = 0  # drafting steps since the last plain step
        self._probe_steps, self._probe_tok = 0, 0.0  # drafting steps and their tokens in the current probe
        self._probe_ns = 0.0  # their time, catch-up included
        self._learn_catchup_ns = 0.0
        self.credit = 0.0  # ns drafting may still lose (negative: a debt that plain decoding repays)
        self.gap = first_gap  # plain tokens before the next probe
        self._since = 0.0  # plain tokens since drafting stopped
        self._probe_cost = 0.0  # what the last probe lost against plain decoding (ns); the next must be covered
        self.probes, self.lost_probes = 1, 0
        self.loss_ns = 0.0  # what drafting cost beyond plain decoding, catch-up included (negative: gained)
        self.decode_ns = 0.0  # all decode steps reported
        self.tokens = self.drafted_tokens = 0.0  # tokens emitted (per stream), and of those by drafting steps
        self.steps = 0  # decode steps reported
        self.first_off: tuple[int, float] | None = None  # (steps, tokens) when drafting first stopped

    # ------------------------------------------------------------------ the model

    @property
    def drafting(self) -> bool:
        return self.mode == "spec"

    @property
    def p(self) -> float | None:
        """ns of a plain step (median of the recent ones), None before any."""
        return statistics.median(self._plain) if self._plain else None

    @property
    def accept(self) -> float:
        """Per-token acceptance: accepted / judged drafts over the recent steps (geometric estimate)."""
        return self._acc / self._tried if self._tried > 0 else 0.0

    def cost_per_draft(self) -> float | None:
        """``c``: what a drafted token adds to a step, in plain steps; None before any."""
        return statistics.median(self._costs) if self._costs else None

    def speedup(self, k: int) -> float:
        """Expected speed-up of drafting ``k`` tokens per step over plain decoding (1.0 when unknown)."""
        c = self.cost_per_draft()
        if c is None or k <= 0:
            return 1.0
        a = min(self.accept, 0.999)
        return (1 - a ** (k + 1)) / (1 - a) / (1 + k * c)

    def best(self) -> tuple[int, float]:
        """(k, expected speed-up) of the best number of drafts."""
        return max(((k, self.speedup(k)) for k in range(1, self.n_max + 1)), key=lambda x: x[1])

    # ------------------------------------------------------------------ the caller's side

    def n_draft(self) -> int:
        """Tokens to draft at the next step (0 = plain)."""
        if self.margin <= 0:
            return self.n_max
        if self.mode == "spec":
            return 0 if self._plain_next else self.n
        p = self.p
        if p is not None and self._since >= self.gap and self.credit >= self._probe_cost:
            self.mode, self._probing, self._plain_next = "spec", True, False
            self._probe_steps, self._probe_tok = 0, 0.0
            self._probe_ns = 0.0
            self.n = max(2, self.best()[0])
            self.probes += 1
            return self.n
        return 0

    def max_catchup(self) -> int | None:
        """How many unseen tokens a draft model may evaluate before drafting now (None = all of them)."""
        if not self._probing or self.margin <= 0:
            return None
        return self.learn_catchup if self._learning else self.catchup_limit

    def idle_tokens(self) -> float:
        """Tokens (per stream) of plain decoding before the next probe may start: 0 while drafting, or when a
        probe could start now. Both of its conditions count: the gap, and the credit covering the last probe's
        cost (the credit grows by ``budget`` x a plain step per token, up to its cap; a cost above the cap
        never lets a probe start)."""
        p = self.p
        if self.mode == "spec" or p is None or self.margin <= 0:
            return 0.0
        wait = max(self.gap - self._since, 0.0)
        short = self._probe_cost - self.credit
        if short > 0:
            if self._probe_cost > self.budget * self.cap_tokens * p:
                return float("inf")
            wait = max(wait, short / (self.budget * p))
        return wait

    def rest(self, tokens: float, ns: int) -> None:
        """Plain steps that emitted ``tokens`` (per stream) in ``ns`` while drafting is paused and no probe is near
        (:meth:`idle_tokens`): counted towards the next probe, without sampling ``p`` (a probe's plain steps are
        sampled in the last tokens before it). The cheap path of :meth:`record` for a paused drafter."""
        p = self.p
        self.decode_ns += ns
        self.tokens += tokens
        self._since += tokens
        if p is not None:
            self.credit = min(self.credit + self.budget * tokens * p, self.budget * self.cap_tokens * p)

    def sibling(self) -> SpecController:
        """A controller with the same settings and nothing learnt (another regime: several streams drafting)."""
        return SpecController(self.n_max, probe=self.probe, probe_tokens=self.probe_tokens, margin=self.margin,
                              budget=self.budget, cap_tokens=self.cap_tokens, first_gap=self.first_gap,
                              max_gap=self.max_gap, interleave=self.interleave, catchup_limit=self.catchup_limit,
                              learn_catchup=self.learn_catchup, samples=self.samples)

    def record(self, *, proposed: float, accepted: float, emitted: float, ns: int, overhead_ns: int = 0,
               streams: int = 1, rejected: int | None = None) -> None:
        """One decode step: tokens proposed/accepted, tokens it produced, its time in ns, of which
        ``overhead_ns`` went to a draft model catching up.

        A step of several streams (``streams`` > 1) reports the totals over them and how many streams had a draft
        ``rejected``; it is judged per stream (a plain step of that many streams is the unit of ``p``)."""
        if streams > 1:
            rej = float(rejected or 0) / streams
            proposed, accepted, emitted = proposed / streams, accepted / streams, emitted / streams
        else:
            rej = 1.0 if accepted < proposed else 0.0  # drafts after the first rejection were not judged
        net = float(max(ns - overhead_ns, 1))
        p = self.p
        drafted = proposed > 0 or overhead_ns > 0
        self.decode_ns += ns
        self.steps += 1
        self.tokens += emitted
        self.drafted_tokens += emitted if proposed else 0
        if p is not None:
            equiv = emitted * p
            loss = 0.0
            if drafted:  # a step that another job preempted is not drafting's cost (p is a median too)
                c = self.cost_per_draft()
                cost = net if c is None or not proposed else min(net, 3 * p * (1 + proposed * c))
                loss = cost + overhead_ns - equiv
                self.loss_ns += loss
            self.credit = min(self.credit + self.budget * equiv - loss, self.budget * self.cap_tokens * p)
        if not proposed:  # a plain step (or a draft with nothing to propose): a sample of p
            self._plain = [*self._plain[-(self.samples - 1):], net]
            if self.mode == "plain":
                self._since += emitted
            self._plain_next, self._run = False, 0
            return
        self._acc = 0.85 * self._acc + accepted
        self._tried = 0.85 * self._tried + accepted + rej
        if p is None:  # judged (and charged) at the end of the first probe
            self._raw.append((proposed, net, float(ns), emitted))
        else:
            self._costs = [*self._costs[-(self.samples - 1):], max(0.0, (net / p - 1) / proposed)]
        if self._learning:  # no cost model yet: all accepted → one more, else what was accepted + 1
            self.n = min(self.n + 1, self.n_max) if accepted >= proposed else max(1, round(accepted) + 1)
        if self._probing:
            self._probe_steps += 1
            self._probe_tok += emitted
            self._probe_ns += ns
            if self._learning:
                self._learn_catchup_ns += overhead_ns
            self._plain_next = True
            # the first probe learns from scratch: twice as long, unless the answer is already clear
            clear = self.p is not None and not 0.85 <= self.best()[1] * self.margin <= 1.2
            scale = 2 if self._learning and not clear else 1
            short = self._probe_steps < self.probe * scale or self._probe_tok < self.probe_tokens * scale
            if (short and self._probe_steps < 3 * self.probe * scale) or len(self._plain) < 3:
                return
            self._end_probe()
            return
        self._run += 1
        self._plain_next = self._run >= self.interleave
        self._decide()

    # ------------------------------------------------------------------ internals

    def _end_probe(self) -> None:
        p = self.p
        assert p is not None
        for k, net, ns, emitted in self._raw:
            self._costs = [*self._costs[-(self.samples - 1):], max(0.0, (net / p - 1) / k)]
            self.credit -= ns - emitted * p
            self.loss_ns += ns - emitted * p
        self._raw = []
        if self._learning:  # the draft's first catch-up (the prompt) is the price of having a draft: refunded
            self._probe_ns -= self._learn_catchup_ns
            self.credit += self._learn_catchup_ns
        self._probe_cost = max(self._probe_ns - self._probe_tok * p, 0.0)
        self._probing = self._learning = False
        if self._decide():
            self.gap = self.first_gap
        else:
            self.lost_probes += 1
            self.gap = min(self.gap * 4, self.max_gap)

    def _decide(self) -> bool:
        k, gain = self.best()
        if gain * self.margin >= 1.0:
            self.mode, self.n = "spec", k
            return True
        self.mode, self._since, self._plain_next = "plain", 0, False
        if self.first_off is None:
            self.first_off = (self.steps, self.tokens)
        return False

    def state(self) -> dict[str, Any]:
        """For stats and benchmarks: mode, N, plain rate (tokens/s), cost of a drafted token (in plain steps),
        acceptance, the expected speed-up of the best N, the budget's credit (ms), probes, tokens made by
        drafting steps, and what drafting cost against plain decoding so far by the controller's own
        accounting (the same seconds compared, so another job's load cancels out; negative: it gained)."""
        c, p = self.cost_per_draft(), self.p
        k, gain = self.best()
        return {"mode": self.mode, "n": self.n, "rate_plain": round(1e9 / p, 2) if p else None,
                "draft_cost": round(c, 3) if c is not None else None, "accept": round(self.accept, 3),
                "best_n": k, "expected_speedup": round(gain, 3), "credit_ms": round(self.credit / 1e6, 1),
                "gap": self.gap, "probes": self.probes, "lost_probes": self.lost_probes,
                "drafted_tokens": f"{round(self.drafted_tokens)}/{round(self.tokens)}",
                "first_off": None if self.first_off is None else
                f"step {self.first_off[0]} (token {round(self.first_off[1])})",
                "cost_vs_plain": f"{100 * self.loss_ns / max(self.decode_ns - self.loss_ns, 1):+.1f}%"}
