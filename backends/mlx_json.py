"""JSON mode for the MLX backend: a logits processor that only lets through tokens keeping the output
a prefix of one valid JSON object (Ollama's ``format: "json"``), then only end-of-sequence.

A byte-level pushdown automaton (:class:`JSONState`, immutable, hashable) runs over each token's bytes.
The allowed-token mask of a state is computed once and cached: inside strings every token free of
``"``/``\\``/control bytes is allowed without simulation, elsewhere a byte trie of the vocabulary is
walked with pruning, so a mask costs milliseconds and repeats are free. Whitespace runs are capped so
greedy decoding cannot loop on newlines. JSON Schemas are not handled here (refused by the backend).

    >>> s = JSONState.start()
    >>> for b in b'{"a": [1, -2.5e3, true, "x\\\\n"], "b": null}':
    ...     s = s.step(b)
    ...     assert s is not None
    >>> s.done
    True
    >>> JSONState.start().feed(b'{"a": tru ') is None, JSONState.start().feed(b'[1]') is None
    (True, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_WS = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
MAX_WS_RUN = 8  # consecutive whitespace bytes allowed between tokens of structure


@dataclass(frozen=True)
class JSONState:
    """Where we are in a JSON object. ``mode`` is one of: value, key_or_end, key, colon, after, string,
    esc, uhex, number, literal, done. ``stack`` holds "o"/"a" per open container."""

    mode: str
    stack: tuple[str, ...] = ()
    aux: Any = None  # string: is_key; uhex: digits left; number: phase; literal: bytes left
    ws: int = 0

    @classmethod
    def start(cls) -> JSONState:
        return cls("value")

    @property
    def done(self) -> bool:
        return self.mode == "done"

    def feed(self, data: bytes) -> JSONState | None:
        s: JSONState | None = self
        for b in data:
            s = s.step(b)
            if s is None:
                return None
        return s

    def _after_value(self, stack: tuple[str, ...]) -> JSONState:
        return JSONState("after", stack) if stack else JSONState("done")

    def step(self, b: int) -> JSONState | None:  # noqa: C901 - one automaton, read top to bottom
        m, st = self.mode, self.stack
        if m == "string":
            if b == 0x22:  # closing quote
                return JSONState("colon", st) if self.aux else self._after_value(st)
            if b == 0x5C:
                return JSONState("esc", st, self.aux)
            return None if b < 0x20 else self
        if m == "esc":
            if b in b'"\\/bfnrt':
                return JSONState("string", st, self.aux)
            return JSONState("uhex", st, (self.aux, 4)) if b == ord("u") else None
        if m == "uhex":
            if chr(b) not in "0123456789abcdefABCDEF":
                return None
            is_key, left = self.aux
            return JSONState("string", st, is_key) if left == 1 else JSONState("uhex", st, (is_key, left - 1))
        if m == "literal":
            if b != self.aux[0]:
                return None
            rest = self.aux[1:]
            return JSONState("literal", st, rest) if rest else self._after_value(st)
        if m == "number":
            phase = self.aux  # sign, zero, int, dot, frac, exp, expsign, expdig
            if b in _DIGITS:
                nxt = {"sign": "zero" if b == 0x30 else "int", "int": "int", "dot": "frac", "frac": "frac",
                       "exp": "expdig", "expsign": "expdig", "expdig": "expdig"}.get(phase)
                return JSONState("number", st, nxt) if nxt else None
            if b == ord(".") and phase in ("zero", "int"):
                return JSONState("number", st, "dot")
            if b in b"eE" and phase in ("zero", "int", "frac"):
                return JSONState("number", st, "exp")
            if b in b"+-" and phase == "exp":
                return JSONState("number", st, "expsign")
            if phase not in ("zero", "int", "frac", "expdig"):
                return None
            return JSONState("after", st).step(b)  # the number ended: this byte belongs to what follows
        if b in _WS:
            if m == "done" or self.ws >= MAX_WS_RUN:
                return None
            return JSONState(m, st, self.aux, self.ws + 1)
        if m == "done":
            return None
        if m == "value":
            if not st and b != ord("{"):
                return None  # the top level is an object
            if b == ord("{"):
                return JSONState("key_or_end", (*st, "o"))
            if b == ord("["):
                return JSONState("value_or_end", (*st, "a"))
            if b == 0x22:
                return JSONState("string", st, False)
            if b == ord("-"):
                return JSONState("number", st, "sign")
            if b in _DIGITS:
                return JSONState("number", st, "zero" if b == 0x30 else "int")
            lit = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}.get(b)
            return JSONState("literal", st, lit) if lit else None
        if m == "value_or_end":
            if b == ord("]"):
                return self._after_value(st[:-1])
            return JSONState("value", st).step(b)
        if m in ("key_or_end", "key"):
            if b == 0x22:
                return JSONState("string", st, True)
            if b == ord("}") and m == "key_or_end":
                return self._after_value(st[:-1])
            return None
        if m == "colon":
            return JSONState("value", st) if b == ord(":") else None
        if m == "after":
            top = st[-1]
            if b == ord(","):
                return JSONState("key" if top == "o" else "value", st)
            if (b == ord("}") and top == "o") or (b == ord("]") and top == "a"):
                return self._after_value(st[:-1])
            return None
        return None


class JSONConstraint:
    """Masks logits so that generation stays valid JSON; one per request (stateful).

    Build once per tokenizer with :meth:`vocabulary` (the byte string of every token, ``None`` for
    special tokens) and reuse the result: it is the expensive part.
    """

    def __init__(self, vocab: tuple[list[bytes | None], Any], eos_ids: set[int], n_logits: int):
        self.token_bytes, self.trie = vocab
        self.eos = sorted(eos_ids)
        self.n = n_logits
        self.state = JSONState.start()
        self._masks: dict[JSONState, Any] = {}
        self._string_safe: list[int] | None = None
        self._string_other: list[int] | None = None

    @staticmethod
    def vocabulary(tokenizer: Any) -> tuple[list[bytes | None], Any]:
        """(bytes of each token id, byte trie {byte: (ids ending here, children)}) of a byte-level BPE
        tokenizer. Raises ValueError for other tokenizers."""
        from mlx_lm.tokenizer_utils import _byte_decoder

        dec = _byte_decoder()
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        n = len(hf)
        pieces = hf.convert_ids_to_tokens(list(range(n)))
        special = set(getattr(hf, "all_special_ids", []) or [])
        added = getattr(hf, "added_tokens_decoder", {}) or {}
        special |= {i for i, t in added.items() if getattr(t, "special", False)}
        out: list[bytes | None] = []
        misses = 0
        for i, p in enumerate(pieces):
            if p is None or i in special:
                out.append(None)
                continue
            try:
                out.append(bytes(dec[c] for c in p))
            except KeyError:
                misses += 1
                out.append(None)
        if misses > n // 10:
            raise ValueError("not a byte-level BPE vocabulary")
        trie: dict[int, Any] = {}
        for i, bs in enumerate(out):
            if not bs:
                continue
            node = trie
            for j, b in enumerate(bs):
                ids, children = node.setdefault(b, ([], {}))
                if j == len(bs) - 1:
                    ids.append(i)
                node = children
        return out, trie

    # --------------------------------------------------------------------------------- masks

    def _allowed(self, state: JSONState) -> list[int]:
        if state.done:
            return list(self.eos)
        if state.mode == "string":
            return self._in_string(state)
        out: list[int] = []
        stack: list[tuple[dict[int, Any], JSONState]] = [(self.trie, state)]
        while stack:
            node, s = stack.pop()
            for b, (ids, children) in node.items():
                t = s.step(b)
                if t is None:
                    continue
                out.extend(ids)
                if children:
                    stack.append((children, t))
        return out

    def _in_string(self, state: JSONState) -> list[int]:
        if self._string_safe is None:
            safe, other = [], []
            for i, bs in enumerate(self.token_bytes):
                if not bs:
                    continue
                (safe if all(b >= 0x20 and b not in (0x22, 0x5C) for b in bs) else other).append(i)
            self._string_safe, self._string_other = safe, other
        out = list(self._string_safe)
        assert self._string_other is not None
        out.extend(i for i in self._string_other if state.feed(self.token_bytes[i]) is not None)  # type: ignore[arg-type]
        return out

    def _mask(self, state: JSONState) -> Any:
        key = state
        mask = self._masks.get(key)
        if mask is None:
            import mlx.core as mx
            import numpy as np

            m = np.full((self.n,), -np.inf, dtype=np.float32)
            allowed = self._allowed(state)
            if allowed:
                m[np.asarray(allowed, dtype=np.int64)] = 0.0
            else:  # nothing fits (cannot happen for a sane vocabulary): let EOS end it
                m[self.eos] = 0.0
            mask = mx.array(m)
            self._masks[key] = mask
        return mask

    # ------------------------------------------------------------------------------ protocol

    def advance(self, token: int) -> None:
        """Move past a sampled token (EOS or an unknown token leaves the state as it is)."""
        bs = self.token_bytes[token] if 0 <= token < len(self.token_bytes) else None
        if bs:
            nxt = self.state.feed(bs)
            if nxt is not None:
                self.state = nxt

    def apply(self, logits: Any) -> Any:
        """``logits`` (1, V) → masked logits for the current state."""
        return logits + self._mask(self.state)[: logits.shape[-1]]
