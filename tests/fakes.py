"""A fake token source with the real contract, for what a real model cannot show: a crash in the middle
of a stream, an out-of-memory at load, a slow stream to cancel, a tool call on demand.

It runs under the real decode loop and the real per-request stream, so everything above the token
source is exercised. Knobs (:class:`Knobs`) are the class's (:func:`fake` makes one with them) or its
constructor's keywords (a subclass passes them on); the model file is not read:

* ``reply``: the text every generation streams (default: echoes the last user message / the prompt);
* ``chunk``: characters per token of the reply (default 4); ``delay``: seconds per step (default 0);
* ``crash_after``: raise ``RuntimeError("fake backend crashed")`` after this many reply tokens (only in
  requests whose prompt contains ``crash_if``, when that is set);
* ``fail_load``: ``"oom"`` → :class:`ModelLoadError` saying memory ran out; any other string → that message;
* ``tool_calls``: a list of ``{"name", "arguments"}`` the reply becomes (as ``<tool_call>`` text) when
  the request has tools; with ``answer_tool_results`` set, a prompt whose last turn is a tool result is
  answered ``The tool said: <that result>`` instead (so a tool loop ends, and the answer shows what the
  model's rendered prompt held); with ``tool_calls_if``, only a prompt whose last user message contains that
  string makes the calls;

>>> from backends.contract.specs import GenerateRequest, LoadSpec
>>> from backends.registry import load
>>> m = load(fake(reply="hi there"), LoadSpec("fake.gguf"))
>>> [type(e).__name__ for e in m.generate(GenerateRequest(prompt="x"))]
['TextChunk', 'TextChunk', 'Done']
>>> m.close()
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from backends.contract.errors import ModelLoadError
from backends.contract.source import Feed, ModelInfo, TokenSource
from backends.contract.specs import LoadSpec, Sampling

EOS = 0
_MARK = "\x02assistant\x02"  # where the rendered prompt hands over to the answer


class _Vocab:
    """Token ids for arbitrary strings, made up as they are met (id 0 is the end of generation)."""

    def __init__(self) -> None:
        self.pieces: list[str] = ["</s>"]
        self.ids: dict[str, int] = {}

    def id(self, piece: str) -> int:
        i = self.ids.get(piece)
        if i is None:
            i = self.ids[piece] = len(self.pieces)
            self.pieces.append(piece)
        return i


class _Sampler:
    """Plays the reply back: learns the prompt from the first row it samples, then one chunk per token."""

    def __init__(self, src: FakeSource):
        self.src = src
        self.pieces: list[str] | None = None
        self.i = 0
        self.may_crash = True

    def _start(self, prompt: list[int]) -> None:
        if self.pieces is None:
            only = self.src.knobs.crash_if
            self.may_crash = only is None or only in self.src.detokenize(prompt)
            reply = self.src._reply_for(prompt)
            n = self.src._chunk
            self.pieces = [reply[i : i + n] for i in range(0, len(reply), n)]
            self.src.generations += 1

    def _next(self) -> int:
        assert self.pieces is not None
        crash = self.src.knobs.crash_after
        if crash is not None and self.may_crash and self.i >= crash:
            raise RuntimeError("fake backend crashed")
        if self.i >= len(self.pieces):
            return EOS
        self.i += 1
        return self.src.vocab.id(self.pieces[self.i - 1])

    def sample(self, row: int) -> int:
        self._start(self.src.logits(row))
        return self._next()

    def sample_logits(self, logits: Any) -> int:
        self._start(list(logits))
        return self._next()

    def close(self) -> None:
        pass


@dataclass
class Knobs:
    """What the fake does (see the module's docstring)."""

    reply: str | None = None
    chunk: int = 4
    delay: float = 0.0
    crash_after: int | None = None
    crash_if: str | None = None
    fail_load: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    answer_tool_results: bool = False
    tool_calls_if: str | None = None


class FakeSource(TokenSource):
    """Deterministic, instant (unless ``delay``), no weights."""

    name = "fake"
    defaults: ClassVar[Knobs] = Knobs()

    @classmethod
    def available(cls) -> tuple[bool, str]:
        return True, ""

    def __init__(self, spec: LoadSpec, **knobs: Any):
        super().__init__(spec)
        self.knobs = replace(self.defaults, **knobs)
        fail = self.knobs.fail_load
        if fail == "oom":
            raise ModelLoadError(f"Not enough memory to load {spec.model_path} with a {spec.n_ctx}-token context.")
        if fail:
            raise ModelLoadError(str(fail))
        self.closed = False
        self.generations = 0
        self.vocab = _Vocab()
        self._seqs: dict[int, list[int]] = {}
        self._rows: list[tuple[int, int]] = []  # (seq, position) per output row
        self._chunk = max(1, self.knobs.chunk)
        self._info = ModelInfo(architecture="fake", n_ctx=spec.n_ctx, n_ctx_train=spec.n_ctx, n_layers=1,
                               n_vocab=256, chat_template="{{ tools }}", size_bytes=1 << 20,
                               kv_cache_type=spec.kv_cache_type, slots=max(1, spec.slots),
                               kv_cells=spec.n_ctx * max(1, spec.slots),
                               draft=(spec.draft.kind if spec.draft else None))

    @property
    def info(self) -> ModelInfo:
        return self._info

    # ---- text: one token per character of input, one per ``chunk`` characters of the reply
    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        return [self.vocab.id(c) for c in text]

    def prompt_tokens(self, text: str) -> list[int]:
        head, mark, tail = text.rpartition(_MARK)
        if not mark:
            return self.tokenize(text)
        return [*self.tokenize(head), self.vocab.id(_MARK), *self.tokenize(tail)]

    def detokenize(self, tokens: list[int]) -> str:
        return "".join(self.vocab.pieces[t] for t in tokens)

    def piece(self, token: int) -> bytes:
        return self.vocab.pieces[token].encode("utf-8") if token else b""

    def is_eog(self, token: int) -> bool:
        return token == EOS

    def render(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> str:
        text = "".join(f"\x02{m.get('role')}\x02{m.get('content') or ''}" for m in messages)
        if tools:
            text = "\x02tools\x02" + text
        return text + (_MARK if add_generation_prompt else "")

    # ---- evaluation
    def evaluate(self, feeds: Sequence[Feed]) -> list[list[int]]:
        delay = self.knobs.delay
        if delay:
            time.sleep(delay)
        self._rows = []
        out = []
        for f in feeds:
            toks = self._seqs.setdefault(f.seq, [])
            del toks[f.pos:]
            toks.extend(f.tokens)
            mine = []
            for j in range(len(f.tokens) - f.outputs, len(f.tokens)):
                self._rows.append((f.seq, f.pos + j + 1))
                mine.append(len(self._rows) - 1)
            out.append(mine)
        return out

    def _reply_for(self, prompt: list[int]) -> str:
        text = self.detokenize(prompt)
        last = text.rpartition(_MARK)[0].rsplit("\x02", 2)
        if self.knobs.answer_tool_results and len(last) == 3 and last[1] == "tool":
            return f"The tool said: {last[2]}"
        wanted = self.knobs.tool_calls_if
        asked = wanted is None or wanted in text.rpartition("\x02user\x02")[2]
        if self.knobs.tool_calls is not None and text.startswith("\x02tools\x02") and asked:
            return "".join(f"<tool_call>{json.dumps(c)}</tool_call>" for c in self.knobs.tool_calls)
        if self.knobs.reply is not None:
            return self.knobs.reply
        if _MARK not in text:
            return text
        users = text.rpartition(_MARK)[0].split("\x02user\x02")
        return users[-1].split("\x02")[0] if len(users) > 1 else ""

    def logits(self, row: int) -> Any:
        """Not logits: the tokens of the sequence up to this row (what the fake's sampler needs)."""
        seq, n = self._rows[row]
        return list(self._seqs[seq][:n])

    def sampler(self, sampling: Sampling, fmt: str | dict[str, Any] | None) -> _Sampler:
        return _Sampler(self)

    # ---- KV
    def seq_rm(self, seq: int, p0: int = 0, p1: int = -1) -> bool:
        toks = self._seqs.get(seq)
        if toks is not None:
            if p1 < 0:
                del toks[p0:]
            else:
                del toks[p0:p1]
        return True

    def seq_cp(self, src: int, dst: int, n: int) -> bool:
        self._seqs[dst] = list(self._seqs.get(src, [])[:n])
        return True

    def embed(self, texts: list[str]) -> list[list[float]]:
        out = []
        for t in texts:
            v = [0.0] * 8
            for i, b in enumerate(t.encode("utf-8")):
                v[i % 8] += b
            n = sum(x * x for x in v) ** 0.5 or 1.0
            out.append([x / n for x in v])
        return out

    def close(self) -> None:
        self.closed = True


def fake(**knobs: Any) -> type[FakeSource]:
    """A :class:`FakeSource` class with these knobs (:class:`Knobs`), for ``load(fake(reply="hi"), spec)``."""
    return type("FakeSource", (FakeSource,), {"defaults": replace(FakeSource.defaults, **knobs)})
