"""Sampling for the MLX source, per request (:class:`MLXSampler`): a private random key (``seed`` reproduces the
text whatever else runs), penalties over the tokens this request generated (as llama.cpp's chain), logit bias,
the JSON constraint for ``format``, then temperature / top-k / top-p / min-p through mlx-lm's functions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from backends.contract.specs import Sampling
from backends.core.stream import check_logit_bias


class MLXSampler:
    """One request's sampler: processors (penalties, JSON) then temperature / top-k / top-p / min-p."""

    def __init__(self, s: Sampling, *, row: Callable[[int], Any], n_ctx: int, n_vocab: int, json: Any = None):
        """``row(i)``: the source's logits row ``i`` of its last evaluation; ``json``: the source's JSON
        constraint for ``format`` (:class:`backends.mlx._json.JSONConstraint`), or None."""
        import mlx.core as mx
        from mlx_lm.sample_utils import (
            make_frequency_penalty,
            make_presence_penalty,
            make_repetition_penalty,
        )

        self._row = row
        self._mx = mx
        self._temp = max(0.0, float(s.temperature or 0.0))
        self._top_k = max(0, int(s.top_k or 0))
        self._top_p = float(s.top_p) if s.top_p is not None and 0 < s.top_p < 1 else 0.0
        self._min_p = max(0.0, float(s.min_p or 0.0))
        seed = s.seed if s.seed is not None else int.from_bytes(__import__("os").urandom(4), "little")
        self._key = mx.random.key(int(seed) & 0xFFFFFFFF)
        self.history: list[int] = []
        n = n_ctx if s.repeat_last_n == -1 else max(0, s.repeat_last_n)
        self._procs: list[Any] = []
        if n > 0:
            if s.repeat_penalty and s.repeat_penalty != 1.0:
                self._procs.append(make_repetition_penalty(s.repeat_penalty, n))
            if s.presence_penalty:
                self._procs.append(make_presence_penalty(s.presence_penalty, n))
            if s.frequency_penalty:
                self._procs.append(make_frequency_penalty(s.frequency_penalty, n))
        self._json = json
        self._bias = None
        if s.logit_bias:
            check_logit_bias(s.logit_bias, n_vocab)
            bias = [0.0] * n_vocab
            for t, b in s.logit_bias.items():
                bias[t] = float(b)
            self._bias = mx.array(bias, dtype=mx.float32)

    def _pick(self, logits: Any) -> int:
        mx = self._mx
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

        row = logits.reshape(1, -1).astype(mx.float32)
        if self.history and self._procs:
            toks = mx.array(self.history, dtype=mx.int32)
            for p in self._procs:
                row = p(toks, row)
        if self._bias is not None:
            row = row + self._bias[: row.shape[-1]]
        if self._json is not None:
            row = self._json.apply(row)
        if self._temp <= 0:
            tok = int(mx.argmax(row, axis=-1).item())
        else:
            lp = row - mx.logsumexp(row, axis=-1, keepdims=True)
            if self._top_k > 0:
                lp = apply_top_k(lp, self._top_k)
            if 0 < self._top_p < 1:
                lp = apply_top_p(lp, self._top_p)
            if self._min_p > 0:
                lp = apply_min_p(lp, self._min_p)
            self._key, sub = mx.random.split(self._key)
            tok = int(mx.random.categorical(lp * (1.0 / self._temp), key=sub).item())
        self.history.append(tok)
        if self._json is not None:
            self._json.advance(tok)
        return tok

    def sample(self, row: int) -> int:
        return self._pick(self._row(row))

    def sample_logits(self, logits: Any) -> int:
        return self._pick(self._mx.array(logits))

    def close(self) -> None:
        self._json = None
