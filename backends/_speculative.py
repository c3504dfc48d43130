"""Speculative decoding helpers for the llama.cpp backend: draft proposers, vocab check, the controller.

Drafts implement llama-cpp-python's ``LlamaDraftModel`` interface (``draft(input_ids) -> np.ndarray``) so
they also plug into ``Llama(draft_model=...)``; our own token loop calls them with the sequence so far
(prompt + accepted tokens + the token just sampled) and verifies the proposal in one target batch.

The :class:`SpecController` (backend-neutral: it sees only proposed/accepted/emitted tokens and times)
picks how many tokens to draft from a cost model it measures online (a plain step, and what a drafted
token adds to a step, side by side in the same seconds; the acceptance rate), switches drafting off when
the best expected speed-up is below 1.03, and pays for every later probe out of a time budget (2% of the
plain-equivalent decode time, a draft model's catch-up included), with probes ever rarer and a draft
model's catch-up bounded during them.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

try:  # the interface; keep this module importable for unit tests of the pure parts
    from llama_cpp.llama_speculative import LlamaDraftModel
except ImportError:  # pragma: no cover - llama-cpp-python missing
    import abc

    class LlamaDraftModel(abc.ABC):  # type: ignore[no-redef]
        @abc.abstractmethod
        def __call__(self, input_ids: Any, /, **kwargs: Any) -> Any: ...


_EMPTY = np.empty(0, dtype=np.intc)


# ------------------------------------------------------------------------------------------ low level


def decode(llm: Any, tokens: list[int], *, logits_all: bool) -> None:
    """Evaluate ``tokens`` at ``llm.n_tokens`` on the context of a ``llama_cpp.Llama``, in ``n_batch`` chunks.

    Keeps ``llm.input_ids`` / ``llm.n_tokens`` in step with the KV cache (Llama's own prefix logic relies
    on them). Only the last row has logits unless ``logits_all`` (then every row of a single chunk does).
    """
    n_batch = llm.n_batch
    for i in range(0, len(tokens), n_batch):
        chunk = tokens[i : i + n_batch]
        n_past = llm.n_tokens
        llm._batch.set_batch(batch=chunk, n_past=n_past, logits_all=logits_all)
        llm._ctx.decode(llm._batch)
        llm.input_ids[n_past : n_past + len(chunk)] = chunk
        llm.n_tokens = n_past + len(chunk)


def rewind(llm: Any, n_keep: int) -> bool:
    """Drop KV entries from position ``n_keep`` on. False when the memory cannot do a partial removal."""
    if n_keep >= llm.n_tokens:
        return True
    ok = bool(llm._ctx.kv_cache_seq_rm(0, n_keep, -1))
    if ok:
        llm.n_tokens = n_keep
    return ok


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two int arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    neq = np.nonzero(a[:n] != b[:n])[0]
    return int(neq[0]) if len(neq) else n


# ------------------------------------------------------------------------------------------ drafts


class NgramDraft(LlamaDraftModel):
    """Prompt-lookup drafting: find the latest earlier occurrence of the last n tokens (n = max..min) and
    propose the tokens that followed it.

    >>> d = NgramDraft(num_pred_tokens=3)
    >>> d(np.array([5, 6, 7, 8, 9, 1, 5, 6], dtype=np.intc)).tolist()
    [7, 8, 9]
    """

    name = "ngram"

    def __init__(self, num_pred_tokens: int = 8, max_ngram: int = 4, min_ngram: int = 2):
        self.n = num_pred_tokens
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        ids = np.asarray(input_ids, dtype=np.intc)
        n_pred = int(kwargs.get("n", self.n))
        length = len(ids)
        if n_pred <= 0:
            return _EMPTY
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            pattern = ids[length - n :]
            windows = np.lib.stride_tricks.sliding_window_view(ids[: length - 1], n)
            hits = np.nonzero((windows == pattern).all(axis=1))[0]
            if len(hits):
                start = int(hits[-1]) + n
                return ids[start : start + n_pred].copy()
        return _EMPTY


class ModelDraft(LlamaDraftModel):
    """A second, smaller ``llama_cpp.Llama`` with the same vocabulary proposes tokens greedily.

    Its KV cache follows the target: each call keeps the common prefix with what it saw last time and
    evaluates only the new tokens. ``p_min`` stops a proposal early when the draft is unsure.

    ``max_catchup`` (a call's keyword) bounds that catch-up: when more unseen tokens than that are pending
    (the prompt, or a stretch decoded plainly while drafting was off), only the last ``max_catchup`` are
    evaluated and the older ones are skipped: the draft's context then has a hole, which costs it some
    foresight but keeps a probe cheap. The holes are remembered (``_holes``: where, in the draft's own
    positions, and how many target tokens were skipped), so later calls map the target's sequence onto the
    draft's KV cache; a call whose sequence differs before a hole drops it. ``catchup_ns`` /
    ``catchup_tokens`` tell the caller what the last call spent catching up (0 when it only evaluated the
    one or two tokens of a normal step).
    """

    name = "model"

    def __init__(self, llm: Any, num_pred_tokens: int = 4, p_min: float = 0.0):
        from llama_cpp import _internals as internals

        self.llm = llm
        self.n = num_pred_tokens
        self.p_min = p_min
        self._n_vocab = llm.n_vocab()
        self._greedy = internals.LlamaSampler()
        self._greedy.add_greedy()
        self._holes: list[tuple[int, int]] = []
        self.catchup_ns = 0
        self.catchup_tokens = 0
        try:  # the first evaluation of a context allocates its buffers: at load, not in the first probe
            decode(llm, [int(llm.token_bos())], logits_all=False)
        except Exception:  # noqa: BLE001 - a warm-up only
            pass
        if not rewind(llm, 0):
            llm.reset()

    def _confident(self) -> bool:
        if self.p_min <= 0:
            return True
        import llama_cpp

        ptr = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        logits = np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))
        m = logits.max()
        p = 1.0 / np.exp(logits - m).sum()
        return bool(p >= self.p_min)

    def _view(self, ids: np.ndarray) -> np.ndarray:
        """The target's sequence as the draft holds it: with the skipped stretches left out."""
        for at, skipped in self._holes:
            if len(ids) <= at:
                break
            ids = np.concatenate([ids[:at], ids[at + skipped :]])
        return ids

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        llm = self.llm
        view = self._view(np.asarray(input_ids, dtype=np.intc))
        max_catchup = kwargs.get("max_catchup")
        n_pred = min(int(kwargs.get("n", self.n)), llm.n_ctx() - len(view) - 1)
        self.catchup_ns = self.catchup_tokens = 0
        if n_pred <= 0 or len(view) == 0 or int(view.max()) >= self._n_vocab:
            return _EMPTY
        keep = common_prefix(llm.input_ids[: llm.n_tokens], view)
        if any(at >= keep for at, _ in self._holes):  # the sequence changed before a hole: forget it
            self._holes = [h for h in self._holes if h[0] < keep]
            view = self._view(np.asarray(input_ids, dtype=np.intc))
        if keep == len(view):
            keep -= 1  # re-evaluate the last token to get fresh logits
        if not rewind(llm, keep):
            llm.reset()
            self._holes = []
            view = np.asarray(input_ids, dtype=np.intc)
        new = view[llm.n_tokens :].tolist()
        if max_catchup is not None and len(new) > max(int(max_catchup), 2):
            skip = len(new) - int(max_catchup)
            self._holes.append((llm.n_tokens, skip))
            new = new[skip:]
        t0 = time.perf_counter_ns()
        decode(llm, new, logits_all=False)
        if len(new) > 2:  # more than a normal step's one or two tokens: catching up
            self.catchup_ns, self.catchup_tokens = time.perf_counter_ns() - t0, len(new)
        out: list[int] = []
        while True:
            if not self._confident():
                break
            tok = self._greedy.sample(llm._ctx, -1)
            out.append(tok)
            if len(out) >= n_pred:
                break
            decode(llm, [tok], logits_all=False)
        return np.array(out, dtype=np.intc)

    def close(self) -> None:
        self._greedy.close()
        self.llm.close()


# ------------------------------------------------------------------------------------------ vocab check


@dataclass(frozen=True)
class VocabInfo:
    """Enough of a vocabulary to tell whether two models tokenize alike."""

    n_vocab: int
    samples: tuple[tuple[int, str], ...]  # (token id, token text) at a fixed spread of ids

    @classmethod
    def of(cls, llm: Any, n_samples: int = 64) -> VocabInfo:
        n = llm.n_vocab()
        model = llm._model
        ids = sorted({*np.linspace(0, n - 1, n_samples).astype(int).tolist(), model.token_bos(), model.token_eos()})
        return cls(n, tuple((i, model.token_get_text(i)) for i in ids if 0 <= i < n))


def vocab_mismatch(target: VocabInfo, draft: VocabInfo, *, max_size_diff: int = 128) -> str | None:
    """Why ``draft`` cannot draft for ``target`` (one sentence), or None when the vocabularies match.

    Sizes may differ by padding (<= ``max_size_diff`` extra ids, as llama.cpp allows); the token texts at
    the sampled ids that both have must be the same.

    >>> a = VocabInfo(3, ((0, "a"), (2, "c")))
    >>> vocab_mismatch(a, a) is None
    True
    >>> vocab_mismatch(a, VocabInfo(300, ((0, "a"),)))
    "The draft model's vocabulary has 300 tokens but the target's has 3; a draft model must use the target's tokenizer."
    """
    if abs(target.n_vocab - draft.n_vocab) > max_size_diff:
        return (
            f"The draft model's vocabulary has {draft.n_vocab} tokens but the target's has {target.n_vocab}; "
            "a draft model must use the target's tokenizer."
        )
    theirs = dict(draft.samples)
    for tid, text in target.samples:
        if tid in theirs and theirs[tid] != text:
            return (
                f"The draft model's token {tid} is {theirs[tid]!r} but the target's is {text!r}; "
                "a draft model must use the target's tokenizer."
            )
    return None


# ------------------------------------------------------------------------------------------ controller


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
        self._raw: list[tuple[int, float, float, int]] = []  # (k, ns net, ns, emitted): steps before p was known
        self._acc, self._tried = 3.5, 5.0  # decayed sums of accepted and of judged drafts (a prior of 0.7)
        self.mode = "spec"  # the first probe learns what drafting does
        self._probing = self._learning = True
        self._plain_next = False  # the next step is a plain one (probes alternate; drafting interleaves)
        self._run = 0  # drafting steps since the last plain step
        self._probe_steps = self._probe_tok = 0  # drafting steps and their tokens in the current probe
        self._probe_ns = 0.0  # their time, catch-up included
        self._learn_catchup_ns = 0.0
        self.credit = 0.0  # ns drafting may still lose (negative: a debt that plain decoding repays)
        self.gap = first_gap  # plain tokens before the next probe
        self._since = 0  # plain tokens since drafting stopped
        self._probe_cost = 0.0  # what the last probe lost against plain decoding (ns); the next must be covered
        self.probes, self.lost_probes = 1, 0
        self.loss_ns = 0.0  # what drafting cost beyond plain decoding, catch-up included (negative: gained)
        self.decode_ns = 0.0  # all decode steps reported
        self.tokens = self.drafted_tokens = 0  # tokens emitted, and of those by drafting steps

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
            self._probe_steps = self._probe_tok = 0
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

    def record(self, *, proposed: int, accepted: int, emitted: int, ns: int, overhead_ns: int = 0) -> None:
        """One decode step: tokens proposed/accepted, tokens it produced, its time in ns, of which
        ``overhead_ns`` went to a draft model catching up."""
        net = float(max(ns - overhead_ns, 1))
        p = self.p
        drafted = proposed > 0 or overhead_ns > 0
        self.decode_ns += ns
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
        rejected = 1 if accepted < proposed else 0  # drafts after the first rejection were not judged
        self._acc = 0.85 * self._acc + accepted
        self._tried = 0.85 * self._tried + accepted + rejected
        if p is None:  # judged (and charged) at the end of the first probe
            self._raw.append((proposed, net, float(ns), emitted))
        else:
            self._costs = [*self._costs[-(self.samples - 1):], max(0.0, (net / p - 1) / proposed)]
        if self._learning:  # no cost model yet: all accepted → one more, else what was accepted + 1
            self.n = min(self.n + 1, self.n_max) if accepted == proposed else max(1, accepted + 1)
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
                "drafted_tokens": f"{self.drafted_tokens}/{self.tokens}",
                "cost_vs_plain": f"{100 * self.loss_ns / max(self.decode_ns - self.loss_ns, 1):+.1f}%"}
