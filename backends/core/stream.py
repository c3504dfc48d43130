"""Per request, the same for every backend: from a request to prompt tokens, and from sampled token ids
to the events a caller sees.

:class:`RequestStream` does what no token source should repeat: the chat template and the context
policy (:func:`fit_messages`, below), stop strings that never leak (:class:`~backends.core._stops.StopMatcher`),
UTF-8 held until a character is complete, tool calls (held while the text could still become one,
parsed at the end), thinking split from the answer, ``max_tokens`` and the context end, logprobs, the
stats, and exactly one closing :class:`~backends.contract.events.Done`.

It runs on the decode loop's thread (string work only, no model calls but the source's token tables).
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from backends.contract.errors import ContextOverflowError, UnsupportedError
from backends.contract.events import Done, Event, FinishReason, Stats, TextChunk, TokenLogprob, ToolCalls
from backends.contract.media import IMAGE_MARKER, is_audio, is_image_token
from backends.contract.source import TokenSource
from backends.contract.specs import GenerateRequest
from backends.core import _chatfix
from backends.core import thinking as _thinking
from backends.core._stops import StopMatcher, Utf8Stream, could_be_tool_call, parse_tool_calls, tool_marker_at

MAX_TOP_LOGPROBS = 20
HEADS_KEPT = 4  # rendered system prompts whose tokens are remembered per loaded model

_heads: weakref.WeakKeyDictionary[Any, dict[str, list[int]]] = weakref.WeakKeyDictionary()
_heads_lock = threading.Lock()


def head_tokens(source: TokenSource, text: str) -> list[int]:
    """The tokens of a rendered system prompt (where it ends is a prompt-cache point), remembered per source for
    its ``HEADS_KEPT`` latest texts: every turn of every conversation sends the same one again, and tokenizing it
    anew cost each turn ~50 ms at 20k tokens (an agent's system prompt and tool schemas)."""
    with _heads_lock:
        try:
            memo = _heads.setdefault(source, {})
        except TypeError:  # a source that cannot be weakly referenced: no memory
            memo = None
        toks = memo.pop(text, None) if memo is not None else None
    if toks is None:
        toks = source.prompt_tokens(text)
    if memo is not None:
        with _heads_lock:
            memo[text] = toks
            while len(memo) > HEADS_KEPT:
                del memo[next(iter(memo))]
    return toks


class RequestStream:
    """One request's text pipeline. :meth:`prepare` once (may raise a :class:`~backends.contract.errors.BackendError`),
    then :meth:`push` each sampled token until :attr:`finish` is set, then :meth:`close`."""

    def __init__(self, request: GenerateRequest, t_submit_ns: int | None = None):
        self.request = request
        self.t0 = t_submit_ns if t_submit_ns is not None else time.perf_counter_ns()
        self.stats = Stats()
        self.prompt: list[int] = []
        self.max_new = 0
        self.finish: FinishReason | None = None
        self.generated: list[int] = []
        self.t_first: int | None = None  # first token sampled (prompt done)
        self._stops = StopMatcher(request.sampling.stop)
        self._utf8 = Utf8Stream()
        self._tool_mode = bool(request.tools)
        self._tool_buf = ""  # text held while it may be a tool call
        self._said = False  # content other than whitespace was sent (a call from now on follows words)
        self._tool_after_words = False  # the held text began after words: only a call marker keeps it held
        self._split: _thinking.ThinkSplitter | None = None
        self._pending_lp: list[TokenLogprob] = []
        self._pending_tokens = 0  # tokens pushed since the last chunk
        self._want_lp = bool(request.logprobs)
        self._source: TokenSource | None = None
        self.cache_points: list[int] = []  # prompt prefixes worth keeping on disk (the system prompt's end)

    # ------------------------------------------------------------------ prompt

    def prepare(self, source: TokenSource) -> list[int]:
        """Render and fit the prompt on ``source``; returns its token ids."""
        self._source = source
        req, n_ctx = self.request, source.n_ctx
        if req.top_logprobs and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise UnsupportedError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}.")
        self.stats.n_ctx = n_ctx
        media = req.has_images
        mi = source.capabilities.media if media else None
        if media:
            sent = list(req.images or []) + message_images(list(req.messages or []))
            if any(is_audio(m) for m in sent) and not (mi is not None and mi.audio):
                raise UnsupportedError(source.audio_problem())
            if not all(is_audio(m) for m in sent) and not (mi is not None and mi.vision):
                raise UnsupportedError(source.vision_problem())
        if req.prompt is not None:
            if media:
                imgs = list(req.images or [])
                text = req.prompt
                if IMAGE_MARKER not in text:
                    text = IMAGE_MARKER * len(imgs) + ("\n" + text if text else "")
                assert mi is not None
                toks = mi.prompt_media(text, imgs)
            else:
                toks = source.prompt_tokens(req.prompt)
            check_fits(len(toks), n_ctx)
        else:
            if req.tools and not source.supports_tools():
                raise UnsupportedError("The chat template of this model does not support tools.")
            style = _thinking.thinking_style(source.chat_template, source.info.architecture)
            if req.think not in (None, False) and style is None:
                raise UnsupportedError("This model does not support thinking.")
            kwargs = _thinking.render_kwargs(style, req.think)
            msgs = _chatfix.for_template(source.chat_template, text_messages(list(req.messages or []), images=media))
            tools = req.tools or None
            last_text = [""]

            def render(m: list[dict[str, Any]]) -> list[int]:
                text = source.render(m, tools=tools, add_generation_prompt=req.add_generation_prompt,
                                     template_kwargs=kwargs)
                if req.add_generation_prompt:
                    text += _thinking.prompt_suffix(style, req.think, text)
                last_text[0] = text
                if mi is not None:
                    return mi.prompt_media(text, message_images(m))
                return source.prompt_tokens(text)

            reserve = answer_reserve(req.sampling.max_tokens, n_ctx)
            if req.keep_turns:
                toks = render(msgs)
                if len(toks) > n_ctx - reserve:
                    raise ContextOverflowError(
                        f"The prompt needs {len(toks)} tokens and {reserve} more for the answer, but the context "
                        f"holds {n_ctx}.", prompt_tokens=len(toks), n_ctx=n_ctx)
            else:
                toks, self.stats.dropped_messages = fit_messages(msgs, render, n_ctx, reserve)
            if style is not None and req.add_generation_prompt:
                split = _thinking.splitter_for(style, req.think, last_text[0])
                self._split = split if split.style is not None else None
            n_sys = next((i for i, m in enumerate(msgs) if m.get("role") != "system"), len(msgs))
            # where a shared system prompt ends (one without images)
            if 0 < n_sys < len(msgs) and len(toks) >= 512 and not message_images(msgs[:n_sys]):
                head = head_tokens(source, source.render(msgs[:n_sys], tools=tools, add_generation_prompt=False,
                                                         template_kwargs=kwargs))
                n = 0  # templates may end the turn differently when more follows: the common part
                while n < min(len(head), len(toks)) and head[n] == toks[n]:
                    n += 1
                if n:
                    self.cache_points.append(n)
        if not toks:
            raise UnsupportedError("The prompt is empty and this model has no start token to begin from.")
        self.prompt = toks
        self.stats.prompt_eval_count = len(toks)
        if mi is not None:
            self.stats.audio_tokens = mi.audio_token_count(toks)
            self.stats.image_tokens = sum(1 for t in toks if is_image_token(t)) - self.stats.audio_tokens
            sent = list(req.images or []) if req.prompt is not None else message_images(msgs)
            self.stats.audio_clips = sum(1 for m in sent if is_audio(m))
            self.stats.images = len(sent) - self.stats.audio_clips
        self.max_new = n_ctx - len(toks)
        mt = req.sampling.max_tokens
        if mt is not None and mt > 0:
            self.max_new = min(self.max_new, mt)
        return toks

    # ------------------------------------------------------------------ tokens

    def logprob(self, logits: Any, token: int) -> TokenLogprob:
        """The sampled ``token``'s log-probability under ``logits`` (and the top alternatives, if asked)."""
        import numpy as np

        src = self._source
        assert src is not None
        x = np.asarray(logits, dtype=np.float64)
        m = float(x.max())
        lse = m + math.log(float(np.exp(x - m).sum()))

        def entry(t: int) -> tuple[str, float, list[int]]:
            b = src.piece(t)
            return b.decode("utf-8", errors="replace"), float(x[t] - lse), list(b)

        text, lp, b = entry(token)
        top: list[tuple[str, float, list[int]]] = []
        n = self.request.top_logprobs
        if n:
            idx = np.argpartition(-x, n - 1)[:n]
            top = [entry(int(t)) for t in idx[np.argsort(-x[idx])]]
        return TokenLogprob(text, lp, b, top)

    @property
    def wants_logprobs(self) -> bool:
        return self._want_lp

    def push(self, token: int, logprob: TokenLogprob | None = None) -> list[Event]:
        """Feed one sampled token; returns the events it releases. Sets :attr:`finish` when the request
        is complete (end of generation, a stop string, ``max_tokens``)."""
        src = self._source
        assert src is not None and self.finish is None
        if self.t_first is None:
            self.t_first = time.perf_counter_ns()
            self.stats.prompt_eval_duration = self.t_first - self.t0 - self.stats.queue_duration
        if src.is_eog(token):
            self.finish = "stop"
            return []
        self.generated.append(token)
        self.stats.eval_count += 1
        self._pending_tokens += 1
        if logprob is not None:
            self._pending_lp.append(logprob)
        out: list[Event] = []
        text = self._utf8.push(src.piece(token))
        if text:
            emit, hit = self._stops.push(text)
            out += self._text(emit)
            if hit:
                self.finish = "stop"
                return out
        if len(self.generated) >= self.max_new:
            self.finish = "length"
        return out

    def _text(self, text: str, final: bool = False) -> list[Event]:
        """Text past the stop matcher → thinking/content chunks (tool-call text held)."""
        if not text and not final:
            return []
        parts: list[tuple[str, str]]
        if self._split is not None:
            parts = self._split.push(text) if text else []
            if final:
                parts += self._split.flush()
        else:
            parts = [("content", text)] if text else []
        out: list[Event] = []
        for kind, piece in parts:
            if kind == _thinking.THINKING:
                if piece:
                    out.append(self._chunk(piece, thinking=True))
                continue
            if kind == _thinking.TOOL:  # a harmony tool call: {"name", "arguments"} as JSON
                calls = parse_tool_calls(piece)
                if calls:
                    out.append(ToolCalls(calls))
                continue
            emit = piece
            after_words = self._tool_after_words if self._tool_buf else self._said
            if self._tool_mode and (self._tool_buf or emit) and could_be_tool_call(self._tool_buf + emit, after_words):
                self._tool_buf, emit = self._tool_buf + emit, ""
                self._tool_after_words = after_words
            elif self._tool_buf:
                emit, self._tool_buf = self._tool_buf + emit, ""
            if self._tool_mode and not self._tool_buf and (k := tool_marker_at(emit)) > 0:
                emit, self._tool_buf = emit[:k], emit[k:]  # words, then a call (or the start of one) in one piece
                self._tool_after_words = True
            self._said = self._said or bool(emit.strip())
            if emit:
                out.append(self._chunk(emit))
        return out

    def _chunk(self, text: str, thinking: bool = False) -> TextChunk:
        lps = None
        if self._want_lp:
            lps, self._pending_lp = self._pending_lp, []
        n, self._pending_tokens = self._pending_tokens, 0
        if thinking:
            self.stats.thinking_tokens += n
        return TextChunk(text, n, thinking=thinking, logprobs=lps)

    # ------------------------------------------------------------------ end

    def close(self, reason: FinishReason | None = None) -> list[Event]:
        """Flush what was held back and end with :class:`Done` (``reason`` overrides :attr:`finish`)."""
        finish: FinishReason = reason or self.finish or "stop"
        out: list[Event] = []
        if finish != "cancelled":
            tail = self._utf8.flush()
            emit, hit = self._stops.push(tail)
            if not hit:
                emit += self._stops.flush()
            out += self._text(emit, final=True)
            if self._tool_buf:
                calls = parse_tool_calls(self._tool_buf, self.request.tools)
                out.append(ToolCalls(calls) if calls is not None else self._chunk(self._tool_buf))
                self._tool_buf = ""
        now = time.perf_counter_ns()
        s = self.stats
        if self.t_first is None:
            s.prompt_eval_duration = max(0, now - self.t0 - s.queue_duration)
        else:
            s.eval_duration = now - self.t_first
        s.total_duration = now - self.t0
        out.append(Done(stats=s, finish_reason=finish))
        return out


# ------------------------------------------------------------------------------------ context policy


def check_logit_bias(bias: dict[int, float], n_vocab: int) -> None:
    """Refuse a ``logit_bias`` that names a token outside the model's vocabulary (ids ``0..n_vocab-1``)."""
    bad = [t for t in bias if not 0 <= t < n_vocab]
    if bad:
        raise UnsupportedError(f"logit_bias names token {bad[0]}, which this model's vocabulary "
                               f"(0-{n_vocab - 1}) does not have.")


def answer_reserve(max_tokens: int, n_ctx: int) -> int:
    """Tokens kept free for the answer: ``max_tokens``, else n_ctx/8 (64..1024); at most half the context."""
    want = max_tokens if max_tokens and max_tokens > 0 else min(max(n_ctx // 8, 64), 1024)
    return max(1, min(want, n_ctx // 2))


def fit_messages(
    messages: list[dict[str, Any]], render: Callable[[list[dict[str, Any]]], list[int]], n_ctx: int, reserve: int
) -> tuple[list[int], int]:
    """(prompt tokens, messages dropped): the policy every backend follows when a chat outgrows its context.

    While the rendered prompt leaves less than ``reserve`` tokens for the answer, the oldest turns go
    first — never a system message nor the last user message; an assistant/tool reply right after a
    dropped turn goes with it, so the chat still starts with a user turn. A prompt that does not fit
    at all raises :class:`ContextOverflowError` with the numbers.
    """
    msgs = list(messages)
    toks = render(msgs)
    dropped = 0
    while len(toks) > n_ctx - reserve:
        last_user = max((i for i, m in enumerate(msgs) if m.get("role") == "user"), default=len(msgs) - 1)
        droppable = [i for i, m in enumerate(msgs) if i < last_user and m.get("role") != "system"]
        if not droppable:
            break
        del msgs[droppable[0]]
        dropped += 1
        last_user -= 1
        while True:  # keep the first remaining turn a user turn
            i = next((j for j, m in enumerate(msgs) if m.get("role") != "system"), None)
            if i is None or i >= last_user or msgs[i].get("role") == "user":
                break
            del msgs[i]
            dropped += 1
            last_user -= 1
        toks = render(msgs)
    check_fits(len(toks), n_ctx, dropped)
    return toks, dropped


def check_fits(n_prompt: int, n_ctx: int, dropped: int = 0) -> None:
    """Raise :class:`ContextOverflowError` when ``n_prompt`` tokens leave no room in ``n_ctx``."""
    if n_prompt >= n_ctx:
        what = "The prompt" if dropped == 0 else f"Even after dropping {dropped} older messages, the prompt"
        raise ContextOverflowError(
            f"{what} needs {n_prompt} tokens but the context holds {n_ctx}; shorten it or load the model "
            "with a larger context (num_ctx).", prompt_tokens=n_prompt, n_ctx=n_ctx)


def message_text(content: Any) -> str:
    """The text of a message's ``content`` (a string, or OpenAI content parts of type text).

    >>> message_text([{"type": "text", "text": "a"}, "b"])
    'ab'
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") in (None, "text"):
                parts.append(str(p.get("text", "")))
            elif isinstance(p, str):
                parts.append(p)
            else:
                raise UnsupportedError("This model takes text only; image and audio parts are not supported.")
        return "".join(parts)
    return str(content)


def text_messages(messages: list[dict[str, Any]], *, images: bool = False) -> list[dict[str, Any]]:
    """Messages with text-only ``content``. A message's ``images`` (raw bytes) are refused in one sentence, or,
    with ``images``, kept and announced by one :data:`IMAGE_MARKER` each before the text (as Ollama does)."""
    out = []
    for m in messages:
        imgs = m.get("images")
        if imgs and not images:
            raise UnsupportedError("This model takes text only; images are not supported.")
        text = message_text(m.get("content"))
        if imgs:
            text = IMAGE_MARKER * len(imgs) + ("\n" + text if text else "")
        out.append({**m, "content": text})
    return out


def message_images(messages: list[dict[str, Any]]) -> list[bytes]:
    """The images of ``messages`` in prompt order (the order of their markers once rendered)."""
    return [bytes(i) for m in messages for i in (m.get("images") or [])]
