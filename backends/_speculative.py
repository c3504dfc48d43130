"""Speculative decoding helpers for the llama.cpp backend: draft proposers, vocab check, the controller.

Drafts implement llama-cpp-python's ``LlamaDraftModel`` interface (``draft(input_ids) -> np.ndarray``) so
they also plug into ``Llama(draft_model=...)``; our own token loop calls them with the sequence so far
(prompt + accepted tokens + the token just sampled) and verifies the proposal in one target batch.

The :class:`SpecController` adapts the number of drafted tokens to the measured acceptance and switches
drafting off when it does not pay: it compares decode throughput in windows with and without drafting
and keeps drafting only while it is at least as fast as plain decoding (minus a 3% margin), re-probing
with exponentially rarer short windows afterwards, so a losing draft costs well under 5%.
"""

from __future__ import annotations

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
        self.catchup_ns = 0

    def _confident(self) -> bool:
        if self.p_min <= 0:
            return True
        import llama_cpp

        ptr = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        logits = np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))
        m = logits.max()
        p = 1.0 / np.exp(logits - m).sum()
        return bool(p >= self.p_min)

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        llm = self.llm
        ids = np.asarray(input_ids, dtype=np.intc)
        n_pred = min(int(kwargs.get("n", self.n)), llm.n_ctx() - len(ids) - 1)
        if n_pred <= 0 or len(ids) == 0 or int(ids.max()) >= self._n_vocab:
            return _EMPTY
        keep = common_prefix(llm.input_ids[: llm.n_tokens], ids)
        if keep == len(ids):
            keep -= 1  # re-evaluate the last token to get fresh logits
        if not rewind(llm, keep):
            llm.reset()
        t0 = time.perf_counter_ns()
        new = ids[llm.n_tokens :].tolist()
        decode(llm, new, logits_all=False)
        # catching up after plain decoding is a one-off cost: report it so the controller can discount it
        self.catchup_ns = time.perf_counter_ns() - t0 if len(new) > 2 else 0
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
    """How many tokens to draft next (0 = decode plainly), from measured acceptance and throughput.

    * N adapts to acceptance: all proposed accepted → N+1 (up to ``n_max``); otherwise N = accepted+1.
    * Throughput (emitted tokens per second of decode work, the caller's time excluded) is measured in
      windows, separately with and without drafting (moving averages). Plain windows cost nothing relative
      to plain decoding, so the controller spends freely on them and sparingly on drafting: it probes
      drafting for ``probe`` steps, measures ``window`` plain tokens, then decides. Drafting stays on while
      its rate is ≥ ``margin`` × the plain rate; when it loses, plain decoding runs for ``first_backoff``
      windows (doubling on every loss, up to ``max_backoff``) before the next short probe. While drafting wins, the
      plain rate is re-measured every ``remeasure`` windows, as both drift (context length, machine load).
      The state lives as long as the loaded model, so what one request learnt the next one uses.
    """

    def __init__(self, n_max: int, *, window: int = 24, probe: int = 3, margin: float = 0.97,
                 first_backoff: int = 4, max_backoff: int = 128, remeasure: int = 16):
        self.n_max = max(1, n_max)
        self.n = min(self.n_max, 4)
        self.window, self.probe, self.margin = window, probe, margin
        self.first_backoff, self.max_backoff, self.remeasure = first_backoff, max_backoff, remeasure
        self.rate: dict[str, float | None] = {"spec": None, "plain": None}
        self.mode = "spec"  # a short probe first, then the plain baseline, then decide
        self._probing = True
        self._backoff = first_backoff
        self._left = 1  # windows left in the current mode
        self._since_plain = 0
        self._win_tok = self._win_ns = self._win_steps = 0

    @property
    def drafting(self) -> bool:
        return self.mode == "spec"

    def n_draft(self) -> int:
        return self.n if self.mode == "spec" else 0

    def record(self, *, proposed: int, accepted: int, emitted: int, ns: int) -> None:
        """One decode step: tokens proposed/accepted, tokens it produced, compute time in ns."""
        if proposed:
            self.n = min(self.n + 1, self.n_max) if accepted == proposed else max(1, accepted + 1)
        self._win_tok += emitted
        self._win_ns += ns
        self._win_steps += 1
        full = self._win_steps >= self.probe if self._probing else self._win_tok >= self.window
        if full:
            self._close_window()

    def _close_window(self) -> None:
        rate = self._win_tok / max(self._win_ns, 1) * 1e9
        self._win_tok = self._win_ns = self._win_steps = 0
        old = self.rate[self.mode]
        self.rate[self.mode] = rate if old is None or self._probing else 0.5 * old + 0.5 * rate
        self._probing = False
        self._left -= 1
        if self._left > 0:
            return
        spec, plain = self.rate["spec"], self.rate["plain"]
        if plain is None:  # no baseline yet: measure it
            self.mode, self._left = "plain", 1
        elif spec is None:  # after a back-off: probe drafting again, briefly
            self.mode, self._left, self._probing, self._since_plain = "spec", 1, True, 0
        elif spec < self.margin * plain:  # drafting does not pay: plain for a while, then probe afresh
            self.mode, self._left = "plain", self._backoff
            self._backoff = min(self._backoff * 2, self.max_backoff)
            self.rate["spec"] = None
        elif self.mode == "plain":  # baseline re-measured and drafting still wins
            self.mode, self._left, self._since_plain = "spec", 1, 0
        else:
            self._backoff = self.first_backoff
            self._since_plain += 1
            self.mode, self._left = ("plain", 1) if self._since_plain >= self.remeasure else ("spec", 1)

    def state(self) -> dict[str, Any]:
        return {"mode": self.mode, "n": self.n, "rate_spec": self.rate["spec"], "rate_plain": self.rate["plain"],
                "backoff": self._backoff}
