"""Sampling for the llama.cpp source: one llama.cpp sampler chain per request (:class:`ChainSampler`), with our
penalties and logit bias applied to the row first and the chain handed only the candidates that can win; the
grammar for ``format``; a concrete seed."""

from __future__ import annotations

import ctypes
import random
from collections import Counter, deque
from typing import Any, Protocol

import numpy as np

from backends.contract.errors import BackendError, UnsupportedError
from backends.contract.specs import Sampling, ToolCallFormat
from backends.llamacpp._log import forget_recent, native_reason


class RowSource(Protocol):
    """What a :class:`ChainSampler` reads of its source (:class:`backends.llamacpp.source.LlamaCppSource`): the context
    whose last evaluation it samples, a view of a logits row, and the source's reusable candidate buffers."""

    _ctx: Any
    _all_ids: Any  # every token id (np.intc)
    _candidates: Any  # a llama_token_data array as long as the vocabulary

    def logits(self, row: int) -> Any: ...

    def _row_view(self, ptr: Any) -> Any: ...


def seed32(seed: int | None) -> int:
    """A concrete 32-bit sampler seed. llama.cpp treats 0xFFFFFFFF as "random", so it is remapped; ``seed=0``
    stays 0 (llama-cpp-python's constructor would turn it into "random")."""
    if seed is None:
        return random.getrandbits(31)
    s = int(seed) & 0xFFFFFFFF
    return 0xFFFFFFFE if s == 0xFFFFFFFF else s

def grammar_for(fmt: str | dict[str, Any]) -> str:
    """GBNF for ``format``: ``"json"`` or a JSON Schema."""
    import json

    from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

    if fmt == "json":
        return JSON_GBNF
    if isinstance(fmt, dict):
        try:
            gbnf = json_schema_to_gbnf(json.dumps(fmt))
        except Exception as e:
            raise UnsupportedError(f"This JSON schema cannot be turned into a grammar ({e}).") from None
        # the converter lets raw control characters into strings, which is not JSON: forbid them
        return gbnf.replace('char ::= [^"\\\\]', 'char ::= [^"\\\\\\x7F\\x00-\\x1F]')
    raise UnsupportedError(f"Unknown format {fmt!r}; use \"json\" or a JSON schema.")

class Penalties:
    """Repeat, frequency and presence penalties over the last ``last_n`` sampled tokens, applied to a logits
    row in place: the arithmetic of llama.cpp's penalties sampler (float32, the same order), but on the few
    tokens seen instead of every candidate of the vocabulary (that sampler looks up each of the 49k candidates
    of a small model's vocabulary: two thirds of a step's sampling time).

    >>> p = Penalties(last_n=2, repeat=2.0, frequency=0.5, presence=0.25)
    >>> for t in (1, 1, 2):
    ...     p.accept(t)
    >>> row = np.array([1.0, 4.0, -4.0], dtype=np.single)
    >>> p.apply(row); row.tolist()  # token 0 was never seen; 1 once, 2 once in the last two
    [1.0, 1.25, -8.75]
    """

    def __init__(self, last_n: int, repeat: float, frequency: float, presence: float):
        self.repeat, self.frequency, self.presence = np.single(repeat), np.single(frequency), np.single(presence)
        self._recent: deque[int] = deque(maxlen=max(1, last_n))
        self._counts: Counter[int] = Counter()

    def accept(self, token: int) -> None:
        if len(self._recent) == self._recent.maxlen:
            old = self._recent[0]
            self._counts[old] -= 1
            if not self._counts[old]:
                del self._counts[old]
        self._recent.append(token)
        self._counts[token] += 1

    def apply(self, row: Any) -> None:
        if not self._counts:
            return
        ids = np.fromiter(self._counts.keys(), dtype=np.intp, count=len(self._counts))
        n = np.fromiter(self._counts.values(), dtype=np.single, count=len(self._counts))
        lg = row[ids]
        lg = np.where(lg <= 0, lg * self.repeat, lg / self.repeat)
        row[ids] = lg - (n * self.frequency + (n > 0).astype(np.single) * self.presence)


PREFILTER_WIDTHS = (8.0, 16.0)  # logit distances below the best tried before the whole vocabulary is handed over
PREFILTER_MAX = 4096  # candidates above the previous row's threshold beyond which this row's best is looked up


class ChainSampler:
    """A llama.cpp sampler chain for one request; samples rows of the context's last evaluation.

    Penalties (:class:`Penalties`) and the logit bias are applied to the row first, in place. Without a
    grammar, the chain is then handed only the candidates that can win: with top-k = k, the tokens at or
    above a threshold that at least k of them reach (the previous row's best minus 8, else this row's best
    minus 8 or 16): a superset of the k best, so top-k keeps exactly the tokens it keeps from the whole
    vocabulary, and what follows it draws the same token with the same seed. Greedy is an argmax. This
    spares writing out and partially sorting the whole row (49k-262k candidates, the caches cold from the
    decode): measured, greedy 0.24 vs ~0.30 ms a token on a 49k vocabulary, and 0.43-0.52 vs 0.50-0.57 ms at
    temperature on a 262k one (even at temperature on 49k). With a grammar, top-k = 0 or too few close
    candidates, the chain sees the whole row.
    """

    def __init__(self, src: RowSource, chain: Any, penalties: Penalties | None = None, *,
                 prefilter: bool = False, top_k: int = 0, greedy: bool = False,
                 bias: dict[int, float] | None = None, lazy_grammar: Any = None):
        self._src = src
        self._chain = chain
        # a lazy tool-call grammar, outside the chain: the token drawn without it is checked against it alone, and
        # only a token it refuses makes the whole row go through it (llama.cpp's common sampler does the same: the
        # grammar's pass over a 150k vocabulary costs more than the rest of a step)
        self._lazy = lazy_grammar
        self._one = np.zeros(1, dtype=src._candidates.dtype) if lazy_grammar is not None else None
        self._penalties = penalties
        self._prefilter = prefilter  # False: the chain has the bias and sees the whole row (a grammar)
        self._top_k = top_k
        self._greedy = greedy
        self._last_best: float | None = None  # the best logit of the previous row (a first threshold to try)
        items = sorted((bias or {}).items())
        self._bias_ids = np.array([t for t, _ in items], dtype=np.intp)
        self._bias = np.array([b for _, b in items], dtype=np.single)

    def sample(self, row: int) -> int:
        import llama_cpp

        if row < 0:  # a row saved from an embeddings-only decode of the same step (an image ended the prompt)
            return self.sample_logits(self._src.logits(row))
        ptr = llama_cpp.llama_get_logits_ith(self._src._ctx, row)
        if not ptr:
            raise BackendError(f"No logits for batch row {row}.")
        if self._lazy is not None:
            return self._sample_lazy(self._src._row_view(ptr))  # this row is ours
        if not self._prefilter:
            if self._penalties is not None:
                self._penalties.apply(self._src._row_view(ptr))  # this row is ours
            tok = int(llama_cpp.llama_sampler_sample(self._chain, self._src._ctx, row))
        else:
            tok = self._pick(self._src._row_view(ptr))  # this row is ours
            llama_cpp.llama_sampler_accept(self._chain, tok)
        if self._penalties is not None:
            self._penalties.accept(tok)
        return tok

    def sample_logits(self, logits: Any) -> int:
        import llama_cpp

        row = np.array(logits, dtype=np.single)
        if self._lazy is not None:
            return self._sample_lazy(row)
        if self._prefilter:
            tok = self._pick(row)
        else:
            if self._penalties is not None:
                self._penalties.apply(row)
            tok = self._apply(self._src._all_ids, row)
        llama_cpp.llama_sampler_accept(self._chain, tok)
        if self._penalties is not None:
            self._penalties.accept(tok)
        return tok

    def _sample_lazy(self, row: Any) -> int:
        """Draw as without the grammar; keep the token if the grammar takes it (always, before its trigger), else
        draw again among the tokens it takes. Greedy gives the grammar-first token exactly."""
        import llama_cpp

        tok = self._pick(row)  # penalties and bias applied to ``row`` here, once
        if not self._grammar_takes(tok):
            buf = self._src._candidates
            n = int(self._src._all_ids.shape[0])
            buf["id"][:n] = self._src._all_ids
            buf["logit"][:n] = row
            buf["p"][:n] = 0.0
            arr = llama_cpp.llama_token_data_array(
                data=buf.ctypes.data_as(llama_cpp.llama_token_data_p), size=n, selected=-1, sorted=False)
            llama_cpp.llama_sampler_apply(self._lazy, ctypes.byref(arr))
            ok = np.flatnonzero(np.isfinite(buf["logit"][:n]))
            if not ok.size:
                raise BackendError("The tool-call grammar allows no token here.")
            ids = buf["id"][ok].copy()
            tok = self._apply(ids, buf["logit"][ok].copy())
        llama_cpp.llama_sampler_accept(self._lazy, tok)
        llama_cpp.llama_sampler_accept(self._chain, tok)
        if self._penalties is not None:
            self._penalties.accept(tok)
        return tok

    def _grammar_takes(self, tok: int) -> bool:
        import llama_cpp

        one = self._one
        assert one is not None
        one["id"][0], one["logit"][0], one["p"][0] = tok, 0.0, 0.0
        arr = llama_cpp.llama_token_data_array(
            data=one.ctypes.data_as(llama_cpp.llama_token_data_p), size=1, selected=-1, sorted=False)
        llama_cpp.llama_sampler_apply(self._lazy, ctypes.byref(arr))
        return bool(np.isfinite(one["logit"][0]))

    def _pick(self, row: Any) -> int:
        """The token the chain draws from ``row`` (penalties and bias applied here), handing it the fewest
        candidates that give the same draw."""
        if self._penalties is not None:
            self._penalties.apply(row)
        if self._bias_ids.size:
            row[self._bias_ids] += self._bias
        if self._greedy:
            return int(row.argmax())  # the first of equal maxima, as llama.cpp's greedy sampler
        if self._top_k > 0:
            # Any threshold that at least k tokens reach keeps the k best: try the previous row's best first
            # (one pass fewer over the row), then widths below this row's best.
            if self._last_best is not None:
                ids = np.flatnonzero(row >= self._last_best - PREFILTER_WIDTHS[0])
                if self._top_k <= ids.size <= PREFILTER_MAX:
                    logits = row[ids]
                    self._last_best = float(logits.max())
                    return self._apply(ids.astype(np.intc), logits)
            best = row.max()
            self._last_best = float(best)
            for width in PREFILTER_WIDTHS:
                ids = np.flatnonzero(row >= best - width)
                if ids.size >= self._top_k:
                    return self._apply(ids.astype(np.intc), row[ids])
        return self._apply(self._src._all_ids, row)

    def _apply(self, ids: Any, logits: Any) -> int:
        """Run the chain over the candidates ``ids`` with ``logits`` (ascending ids, as llama.cpp builds them)."""
        import llama_cpp

        n = int(ids.shape[0])
        buf = self._src._candidates
        buf["id"][:n] = ids
        buf["logit"][:n] = logits
        buf["p"][:n] = 0.0
        arr = llama_cpp.llama_token_data_array(
            data=buf.ctypes.data_as(llama_cpp.llama_token_data_p), size=n, selected=-1, sorted=False)
        llama_cpp.llama_sampler_apply(self._chain, ctypes.byref(arr))
        if not 0 <= arr.selected < arr.size:
            raise BackendError("The sampler chain selected no token.")
        return int(buf["id"][arr.selected])

    def close(self) -> None:
        if self._chain is not None:
            import llama_cpp

            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None
            if self._lazy is not None:
                llama_cpp.llama_sampler_free(self._lazy)
                self._lazy = None


def lazy_tool_grammar(vocab: Any, tools: list[dict[str, Any]], json_tags: bool = True) -> Any:
    """llama.cpp's lazy grammar sampler for a call to one of ``tools`` (:mod:`backends.core.tool_grammar`): idle until
    a trigger pattern matches the text, the grammar from there on. None (no constraint) when the tools give no
    grammar or llama.cpp refuses it."""
    import llama_cpp

    from backends.core import tool_grammar
    g = tool_grammar.build(tools, grammar_for, json_tags=json_tags)
    if g is None:
        return None
    pats = (ctypes.c_char_p * len(g.triggers))(*[t.encode() for t in g.triggers])
    forget_recent()
    smpl = llama_cpp.llama_sampler_init_grammar_lazy_patterns(vocab, g.gbnf.encode(), b"root", pats,
                                                              len(g.triggers), None, 0)
    return smpl or None


def make_sampler(src: RowSource, vocab: Any, n_vocab: int, n_ctx: int, sampling: Sampling,
                 fmt: str | dict[str, Any] | ToolCallFormat | None, load_grammar: str | None = None) -> ChainSampler:
    """A fresh sampler chain for one request on ``src`` (the logit bias already checked against the vocabulary):
    the bias, the grammar of ``fmt`` (else ``load_grammar``, a load-wide GBNF; a :class:`ToolCallFormat`: the
    lazy tool-call grammar), greedy or top-k / top-p / min-p, temperature and a seeded draw; penalties applied to
    the row by :class:`ChainSampler`."""
    import llama_cpp

    s = sampling
    grammar = None
    lazy = fmt if isinstance(fmt, ToolCallFormat) else None
    if lazy is not None:
        fmt = None
    gbnf = load_grammar if fmt in (None, "", "text") else None  # a load-wide GBNF (tests)
    if fmt not in (None, "", "text"):
        gbnf = grammar_for(fmt)  # type: ignore[arg-type]
    lazy_grammar = lazy_tool_grammar(vocab, lazy.tools, lazy.json_tags) if lazy is not None and not gbnf else None
    if gbnf:
        forget_recent()
        grammar = llama_cpp.llama_sampler_init_grammar(vocab, gbnf.encode(), b"root")
        if not grammar:
            why = native_reason()
            raise UnsupportedError(f"llama.cpp rejected the grammar for this format{f' ({why})' if why else ''}.")
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())

    def add(smpl: Any) -> None:
        llama_cpp.llama_sampler_chain_add(chain, smpl)  # the chain owns it now

    prefilter = grammar is None  # the bias goes on the row and the chain sees only the close candidates
    if s.logit_bias and not prefilter:
        arr = (llama_cpp.llama_logit_bias * len(s.logit_bias))()
        for i, (t, b) in enumerate(s.logit_bias.items()):
            arr[i] = llama_cpp.llama_logit_bias(int(t), float(b))
        add(llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(s.logit_bias), arr))
    penalties = None
    last_n = n_ctx if s.repeat_last_n == -1 else max(0, s.repeat_last_n)
    if last_n and (s.repeat_penalty not in (0, 1.0) or s.presence_penalty or s.frequency_penalty):
        penalties = Penalties(last_n, s.repeat_penalty or 1.0, s.frequency_penalty, s.presence_penalty)
    if grammar is not None:
        add(grammar)
    greedy = s.temperature is None or s.temperature <= 0
    if greedy:
        add(llama_cpp.llama_sampler_init_greedy())
    else:
        if s.top_k and s.top_k > 0:
            add(llama_cpp.llama_sampler_init_top_k(int(s.top_k)))
        if s.top_p is not None and 0 < s.top_p < 1:
            add(llama_cpp.llama_sampler_init_top_p(float(s.top_p), 1))
        if s.min_p and s.min_p > 0:
            add(llama_cpp.llama_sampler_init_min_p(float(s.min_p), 1))
        add(llama_cpp.llama_sampler_init_temp(float(s.temperature)))
        add(llama_cpp.llama_sampler_init_dist(seed32(s.seed)))
    return ChainSampler(src, chain, penalties, prefilter=prefilter, greedy=greedy, lazy_grammar=lazy_grammar,
                         top_k=int(s.top_k) if s.top_k and s.top_k > 0 else 0,
                         bias={int(t): float(b) for t, b in s.logit_bias.items()} if prefilter and s.logit_bias
                         else None)
