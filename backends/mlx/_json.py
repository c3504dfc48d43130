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

import json
from dataclasses import dataclass
from typing import Any, TypeVar

_WS = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
MAX_WS_RUN = 8  # consecutive whitespace bytes allowed between tokens of structure


_S = TypeVar("_S", "JSONState", "SchemaState")


def _feed(state: _S, data: bytes) -> _S | None:
    """``state`` after the bytes ``data`` one by one; None as soon as one cannot follow."""
    s: _S | None = state
    for b in data:
        assert s is not None
        s = s.step(b)  # type: ignore[assignment]
        if s is None:
            return None
    return s


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

    def string_budget(self) -> float | None:
        """Inside a string: how many more characters fit (inf = any); else None."""
        return float("inf") if self.mode == "string" else None

    def feed(self, data: bytes) -> JSONState | None:
        return _feed(self, data)

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

    Build once per tokenizer (:meth:`vocabulary_bytes`: the byte string of every token, ``None`` for special
    tokens; :meth:`byte_trie` of them, ten times the cost) and reuse the pair: it is the expensive part.
    """

    def __init__(self, vocab: tuple[list[bytes | None], Any], eos_ids: set[int], n_logits: int, start: Any = None):
        self.token_bytes, self.trie = vocab
        self.eos = sorted(eos_ids)
        self.n = n_logits
        self.state = start if start is not None else JSONState.start()
        self._masks: dict[Any, Any] = {}
        self._string_safe: Any = None  # numpy ids of tokens that are plain string content
        self._string_len: Any = None  # their length in characters
        self._string_other: list[int] | None = None

    @staticmethod
    def vocabulary_bytes(tokenizer: Any) -> list[bytes | None]:
        """The bytes of each token id of a byte-level BPE tokenizer (``None`` for special tokens): ~40 ms for a
        49k vocabulary, a tenth of :meth:`byte_trie`. Raises ValueError for other tokenizers."""
        from mlx_lm.tokenizer_utils import _byte_decoder

        # byte-level BPE spells each byte as one character: map the characters to latin-1 code points and
        # the whole piece decodes in C (str.translate + encode) instead of byte by byte in Python
        table = {ord(c): chr(b) for c, b in _byte_decoder().items()}
        table.update({c: "\uffff" for c in range(256) if c not in table})  # not a byte character: a miss
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
                out.append(p.translate(table).encode("latin-1"))
            except UnicodeEncodeError:  # a character that is not one of the 256 byte characters
                misses += 1
                out.append(None)
        if misses > n // 10:
            raise ValueError("not a byte-level BPE vocabulary")
        return out

    @staticmethod
    def byte_trie(token_bytes: list[bytes | None]) -> dict[int, Any]:
        """The byte trie {byte: (ids ending here, children)} of ``token_bytes``: what JSON mode walks."""
        trie: dict[int, Any] = {}
        for i, bs in enumerate(token_bytes):
            if not bs:
                continue
            node = trie
            for j, b in enumerate(bs):
                ids, children = node.setdefault(b, ([], {}))
                if j == len(bs) - 1:
                    ids.append(i)
                node = children
        return trie

    # --------------------------------------------------------------------------------- masks

    def _allowed(self, state: Any) -> list[int]:
        if state.done:
            return list(self.eos)
        budget = state.string_budget()
        if budget is not None:
            return self._in_string(state, budget)
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

    def _in_string(self, state: Any, budget: float) -> list[int]:
        import numpy as np

        if self._string_safe is None:
            safe, lens, other = [], [], []
            for i, bs in enumerate(self.token_bytes):
                if not bs:
                    continue
                if all(b >= 0x20 and b not in (0x22, 0x5C) for b in bs):
                    safe.append(i)
                    lens.append(sum(1 for b in bs if b & 0xC0 != 0x80))
                else:
                    other.append(i)
            self._string_safe, self._string_len = np.asarray(safe), np.asarray(lens)
            self._string_other = other
        fits = self._string_safe if budget == float("inf") else self._string_safe[self._string_len <= budget]
        out = fits.tolist()
        assert self._string_other is not None
        out.extend(i for i in self._string_other if state.feed(self.token_bytes[i]) is not None)  # type: ignore[arg-type]
        return out

    def _mask(self, state: Any) -> Any:
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


# ------------------------------------------------------------------------------------ JSON Schema

class SchemaError(ValueError):
    """A JSON Schema (or part of one) that the MLX constraint cannot follow."""


_SCHEMA_NOISE = {"title", "description", "$schema", "$id", "examples", "default", "$comment"}


def compile_schema(schema: dict[str, Any]) -> SchemaState:
    """The start state of a constraint that follows ``schema`` (a subset of JSON Schema).

    Supported: ``type`` object (``properties``, ``required``, ``additionalProperties``: every listed
    property is written, in order), string (``enum``, ``minLength``, ``maxLength``), integer, number,
    boolean, null, array (``items``, ``minItems``, ``maxItems``), ``enum``/``const`` of scalars, and a
    list of types is refused. Anything else (``$ref``, ``anyOf``, ``pattern``...) raises
    :class:`SchemaError` naming it. The top level must be an object. Output is compact JSON with an
    optional space after ``:`` and ``,``.

    >>> s = compile_schema({"type": "object", "properties": {"n": {"type": "integer"},
    ...                     "ok": {"type": "boolean"}}, "required": ["n"]})
    >>> s.feed(b'{"n": -12, "ok": true}').done, s.feed(b'{"ok": true}') is None, s.feed(b'{"n": 1.5') is None
    (True, True, True)
    """
    node = _node(schema)
    if node[0] not in ("seq", "any_object"):
        raise SchemaError("the top level of a schema must be an object")
    return SchemaState((node,))


def _node(schema: Any) -> tuple[Any, ...]:  # noqa: C901 - one keyword per branch
    if not isinstance(schema, dict):
        raise SchemaError(f"a schema must be an object, not {schema!r}")
    if schema == {}:
        return ("any",)
    if "const" in schema:
        return ("enum", (json.dumps(schema["const"], separators=(",", ":")).encode(),), 0)
    if "enum" in schema:
        opts = tuple(json.dumps(v, separators=(",", ":")).encode() for v in schema["enum"])
        if not opts:
            raise SchemaError("an empty enum admits nothing")
        return ("enum", opts, 0)
    t = schema.get("type")
    known = {
        "object": {"type", "properties", "required", "additionalProperties"},
        "string": {"type", "minLength", "maxLength"},
        "integer": {"type"},
        "number": {"type"},
        "boolean": {"type"},
        "null": {"type"},
        "array": {"type", "items", "minItems", "maxItems"},
    }
    if t is None:
        t = "object" if "properties" in schema else "array" if "items" in schema else None
    if t is None:
        unknown = set(schema) - set().union(*known.values()) - _SCHEMA_NOISE
        raise SchemaError(f"{', '.join(sorted(unknown)) or 'a schema without a type'} is not supported")
    if not isinstance(t, str) or t not in known:
        raise SchemaError(f"type {t!r} is not supported (one of {', '.join(known)})")
    extra = set(schema) - known[t] - _SCHEMA_NOISE
    if extra:
        raise SchemaError(f"{', '.join(sorted(extra))} in a {t} schema is not supported")
    if t == "object":
        props = schema.get("properties") or {}
        if not props:
            return ("any_object",)
        parts: list[tuple[Any, ...]] = [("lit", b"{", 0)]
        for i, (name, sub) in enumerate(props.items()):
            key = json.dumps(name).encode()
            if i:
                parts += [("lit", b",", 0), ("ws",)]
            parts += [("lit", key + b":", 0), ("ws",), _node(sub)]
        parts.append(("lit", b"}", 0))
        return ("seq", tuple(parts))
    if t == "string":
        return ("str", int(schema.get("minLength", 0)), schema.get("maxLength"), 0, "open")
    if t in ("integer", "number"):
        return ("num", t == "integer", "start")
    if t == "boolean":
        return ("enum", (b"true", b"false"), 0)
    if t == "null":
        return ("enum", (b"null",), 0)
    return ("arr", _node(schema.get("items", {})), int(schema.get("minItems", 0)), schema.get("maxItems"), 0, "open")


def schema_problem(schema: Any) -> str | None:
    """The part of a JSON schema MLX's constraint cannot follow (one sentence), or None (the backend's rules).

    >>> schema_problem({"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}]}}})
    'this JSON schema cannot be followed on MLX: anyOf is not supported'
    """
    try:
        compile_schema(schema)
    except SchemaError as e:
        return f"this JSON schema cannot be followed on MLX: {e}"
    return None


@dataclass(frozen=True)
class SchemaState:
    """A stack of pending grammar nodes (head first); empty = the object is complete."""

    items: tuple[tuple[Any, ...], ...]

    @property
    def done(self) -> bool:
        return not self.items

    def string_budget(self) -> float | None:
        if self.items and self.items[0][0] == "str" and self.items[0][4] == "in":
            _, _, mx_len, count, _ = self.items[0]
            return float("inf") if mx_len is None else mx_len - count
        if self.items and self.items[0][0] == "json" and self.items[0][1].mode == "string":
            return float("inf")
        return None

    def feed(self, data: bytes) -> SchemaState | None:
        return _feed(self, data)

    def step(self, b: int) -> SchemaState | None:
        items = _step(self.items, b)
        return None if items is None else SchemaState(items)


def _step(items: tuple[Any, ...], b: int) -> tuple[Any, ...] | None:  # noqa: C901 - the grammar, top to bottom
    if not items:
        return None
    head, rest = items[0], items[1:]
    kind = head[0]
    if kind == "seq":
        return _step(head[1] + rest, b)
    if kind == "lit":
        data, pos = head[1], head[2]
        if data[pos] != b:
            return None
        return rest if pos + 1 == len(data) else (("lit", data, pos + 1), *rest)
    if kind == "ws":
        return rest if b == 0x20 else _step(rest, b)
    if kind == "enum":
        opts, pos = head[1], head[2]
        live = tuple(o for o in opts if len(o) > pos and o[pos] == b)
        if not live:
            return _step(rest, b) if any(len(o) == pos for o in opts) else None
        if all(len(o) == pos + 1 for o in live):
            return rest
        return (("enum", live, pos + 1), *rest)
    if kind == "str":
        _, mn, mx_len, count, phase = head
        if phase == "open":
            return (("str", mn, mx_len, 0, "in"), *rest) if b == 0x22 else None
        if phase == "in":
            if b == 0x22:
                return rest if count >= mn else None
            if b < 0x20:
                return None
            grows = b & 0xC0 != 0x80  # a character starts (UTF-8 continuation bytes do not count)
            if grows and mx_len is not None and count + 1 > mx_len:
                return None
            nxt = "esc" if b == 0x5C else "in"
            return (("str", mn, mx_len, count + (1 if grows else 0), nxt), *rest)
        if phase == "esc":
            if b in b'"\\/bfnrt':
                return (("str", mn, mx_len, count, "in"), *rest)
            return (("str", mn, mx_len, count, "u4"), *rest) if b == ord("u") else None
        if phase.startswith("u"):  # \uXXXX
            if chr(b) not in "0123456789abcdefABCDEF":
                return None
            left = int(phase[1:]) - 1
            return (("str", mn, mx_len, count, "in" if left == 0 else f"u{left}"), *rest)
    if kind == "num":
        _, integer, phase = head
        st = JSONState("number", ("a",), {"start": None}.get(phase, phase))
        if phase == "start":
            if b == ord("-"):
                return (("num", integer, "sign"), *rest)
            if b in _DIGITS:
                return (("num", integer, "zero" if b == 0x30 else "int"), *rest)
            return None
        if integer and b in b".eE":
            return None
        after = st.step(b)
        if after is not None and after.mode == "number":
            return (("num", integer, after.aux), *rest)
        if phase in ("zero", "int", "frac", "expdig"):
            return _step(rest, b)  # the number ended: this byte belongs to what follows
        return None
    if kind == "arr":
        _, item, mn, mxi, count, phase = head
        if phase == "open":
            return (("arr", item, mn, mxi, 0, "first"), *rest) if b == ord("[") else None
        if phase == "first":
            if b == ord("]"):
                return rest if mn == 0 else None
            if mxi == 0:
                return None
            return _step((item, ("arr", item, mn, mxi, 1, "after"), *rest), b)
        if phase == "after":
            if b == ord("]"):
                return rest if count >= mn else None
            if b == ord(",") and (mxi is None or count < mxi):
                return (("ws",), item, ("arr", item, mn, mxi, count + 1, "after"), *rest)
            return None
    if kind in ("any", "any_object"):  # a free JSON value: hand over to the JSON automaton
        if kind == "any_object" and b != ord("{"):
            return None
        return _step((("json", JSONState("value", ("a",))), *rest), b)
    if kind == "json":
        st = head[1]
        nxt = st.step(b)
        if st.mode == "number" and st.stack == ("a",) and (nxt is None or nxt.mode != "number"):
            # a top-level number of the free value ends at the first byte that cannot continue it
            return _step(rest, b) if st.aux in ("zero", "int", "frac", "expdig") else None
        if nxt is None:
            return None
        if nxt.mode == "after" and nxt.stack == ("a",):  # the free value is complete
            return rest
        return (("json", nxt), *rest)
    return None
