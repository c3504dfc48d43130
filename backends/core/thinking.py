"""Reasoning ("thinking") models: tell from the chat template whether and how a model thinks, render ``think``
the way that template expects, and split a stream of generated text into thinking and content.

Three styles are known, all read from the Jinja chat template (``tokenizer.chat_template``):

* **qwen3** -- the template takes ``enable_thinking``; the model writes ``<think>…</think>`` itself, and
  ``enable_thinking=False`` makes the template close an empty thought (``<think>\\n\\n</think>\\n\\n``).
* **deepseek-r1** (and any other template with a known tag pair, name ``tags``) -- the template knows the tags
  (it strips earlier thoughts with ``content.split('</think>')``), newer revisions open ``<think>\\n`` in the
  prompt; there is no switch, so thinking off means a pre-filled empty thought.
* **gemma4** -- the template takes ``enable_thinking`` (``<|think|>`` in the system turn); the model writes
  ``<|channel>thought\n…<channel|>`` before its answer (the channel's name, ``thought``, is not part of the
  thought), and thinking off makes the template close an empty one (``<|channel>thought\n<channel|>``).
* **harmony** (gpt-oss) -- messages on channels, ``<|start|>assistant<|channel|>analysis<|message|>…<|end|>``
  then ``…<|channel|>final<|message|>…``; the template takes ``reasoning_effort`` (low / medium / high) and
  the trace cannot be turned off.

``think`` follows Ollama: None (unset) on a thinking model means on, True means on (level "medium" where the
template takes a level), False off, a level string means on at that level.

>>> qwen = thinking_style("{% if enable_thinking is defined and enable_thinking is false %}"
...                       "<think>\\n\\n</think>\\n\\n{% endif %}")
>>> qwen.name, render_kwargs(qwen, None), render_kwargs(qwen, False)
('qwen3', {'enable_thinking': True}, {'enable_thinking': False})
>>> s = ThinkSplitter(qwen)
>>> s.push("<thi") + s.push("nk>\\nHmm, 2+2.</th") + s.push("ink>\\n\\nIt is 4.") + s.flush()
[('thinking', 'Hmm, 2+2.'), ('content', 'It is 4.')]

Only the standard library is used (``backends`` imports nothing from ``localllm``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

THINKING = "thinking"
CONTENT = "content"
TOOL = "tool"

Piece = tuple[str, str]  # (kind, text): kind is THINKING, CONTENT or TOOL

LEVELS = ("low", "medium", "high")
THINK_VALUES = (True, False, "low", "medium", "high", "max")

# Tag pairs a chat template can put a reasoning trace between (Ollama's thinking/chat_template.go table). A
# pair counts only when the template carries both halves, or splits earlier answers at the closing tag.
TAG_PAIRS = (
    ("<think>", "</think>"),
    ("<|channel>", "<channel|>"),
    ("<|START_THINKING|>", "<|END_THINKING|>"),
    ("<seed:think>", "</seed:think>"),
)

_H_START, _H_MESSAGE, _H_CHANNEL = "<|start|>", "<|message|>", "<|channel|>"
_H_ENDS = ("<|end|>", "<|return|>", "<|call|>")  # <|return|> and <|call|> also end generation
_H_HEADER_LIMIT = 512  # a header longer than this is not harmony after all
HARMONY_ARCHS = ("gpt-oss", "gptoss", "gpt_oss")


@dataclass(frozen=True)
class ThinkStyle:
    """How one chat template does reasoning.

    ``name``            "qwen3" | "gemma4" | "deepseek-r1" | "tags" | "harmony"
    ``open_tag``        what opens a thought (harmony: ``<|channel|>analysis<|message|>``)
    ``label``           a channel name the model writes right after ``open_tag`` (Gemma 4: ``thought``), not
                        part of the thought
    ``ends_at``         text that also ends a thought and begins the answer (Qwen3.5's ``<tool_call>``: it calls
                        tools without closing ``<think>`` at times; llama.cpp's parser ends the thought there too)
    ``close_tag``       what closes it (harmony: ``<|end|>``)
    ``enable_thinking`` the template reads the ``enable_thinking`` kwarg (Qwen3)
    ``levels``          reasoning levels the template takes as ``reasoning_effort`` (harmony); () = on/off only
    ``can_disable``     think=False really stops the trace (False for harmony: its analysis channel stays)
    ``prefill``         the template's generation prompt already ends with ``open_tag`` (R1 since 2025-02, Qwen3
                        Thinking-2507); a guess from the text -- :func:`prompt_in_thought` checks a real prompt
    """

    name: str
    open_tag: str
    close_tag: str
    enable_thinking: bool = False
    levels: tuple[str, ...] = ()
    can_disable: bool = True
    prefill: bool = False
    label: str = ""
    ends_at: tuple[str, ...] = ()

    @property
    def harmony(self) -> bool:
        return self.name == "harmony"

    @property
    def off_block(self) -> str:
        """The empty thought that stands for think=False (``<think>\\n\\n</think>\\n\\n``); "" for harmony."""
        if self.harmony:
            return ""
        if self.label:  # Gemma 4's own empty thought
            return f"{self.open_tag}{self.label}\n{self.close_tag}"
        return f"{self.open_tag}\n\n{self.close_tag}\n\n"


HARMONY = ThinkStyle("harmony", _H_CHANNEL + "analysis" + _H_MESSAGE, _H_ENDS[0], levels=LEVELS, can_disable=False)


def thinking_style(chat_template: str | None, architecture: str | None = None) -> ThinkStyle | None:
    """The reasoning style of a chat template, or None for a model that does not think.

    >>> thinking_style("{{ messages[0].content }}") is None
    True
    >>> r1 = thinking_style("{% set content = content.split('</think>')[-1] %}"
    ...                     "{% if add_generation_prompt %}{{'<｜Assistant｜><think>\\n'}}{% endif %}")
    >>> r1.name, r1.open_tag, r1.enable_thinking, r1.prefill
    ('deepseek-r1', '<think>', False, True)
    >>> thinking_style('{{ "Reasoning: " + reasoning_effort }}<|start|>assistant<|channel|>final<|message|>').levels
    ('low', 'medium', 'high')
    >>> thinking_style(None, "gpt-oss").name
    'harmony'
    """
    t = chat_template or ""
    arch = (architecture or "").lower()
    if (_H_CHANNEL in t and _H_MESSAGE in t) or arch in HARMONY_ARCHS:
        return HARMONY
    if not t:
        return None
    pair = next(((o, c) for o, c in TAG_PAIRS if o in t and c in t), None)
    if pair is None:
        pair = next(((o, c) for o, c in TAG_PAIRS if f"content.split('{c}')" in t or f'content.split("{c}")' in t),
                    None)
    if pair is None:
        return None
    open_tag, close_tag = pair
    takes_switch = "enable_thinking" in t
    label = ""
    if open_tag == "<|channel>":  # Gemma 4: <|channel>thought\n…<channel|>
        name, label = "gemma4", "thought"
    elif takes_switch:
        name = "qwen3"
    elif "｜Assistant｜" in t or "<｜end▁of▁sentence｜>" in t:
        name = "deepseek-r1"
    else:
        name = "tags"
    # Qwen3.5 / Qwen3-Coder tool calls (<tool_call>\n<function=...>): a call ends an unclosed thought
    ends_at = ("<tool_call>",) if open_tag == "<think>" and "<function=" in t and "<tool_call>" in t else ()
    return ThinkStyle(name, open_tag, close_tag, enable_thinking=takes_switch,
                      prefill=_generation_prompt_opens(t, open_tag, close_tag), label=label, ends_at=ends_at)


def _generation_prompt_opens(template: str, open_tag: str, close_tag: str) -> bool:
    """Whether the part of the template after its last ``add_generation_prompt`` writes the opening tag alone
    (an open thought) rather than an empty closed one (Qwen3's think-off branch)."""
    i = template.rfind("add_generation_prompt")
    if i < 0:
        return False
    tail = template[i:]
    return open_tag in tail and close_tag not in tail


# ------------------------------------------------------------------------------------------ think values


def parse_think(value: Any) -> bool | str | None:
    """Check a request's ``think`` (None, True, False, "low", "medium", "high", "max"); ValueError in Ollama's
    words otherwise.

    >>> parse_think("high"), parse_think(None), parse_think(False)
    ('high', None, False)
    >>> parse_think("x")
    Traceback (most recent call last):
    ...
    ValueError: invalid think value: "x" (must be "high", "medium", "low", "max", true, or false)
    """
    if value is None or isinstance(value, bool) or (isinstance(value, str) and value in THINK_VALUES):
        return value
    shown = json.dumps(value) if isinstance(value, str) else repr(value)
    raise ValueError(f'invalid think value: {shown} (must be "high", "medium", "low", "max", true, or false)')


def think_on(style: ThinkStyle | None, think: bool | str | None) -> bool:
    """Whether the request asks for thinking: unset on a thinking model means yes; False means no.

    >>> think_on(HARMONY, None), think_on(HARMONY, False), think_on(None, True)
    (True, False, False)
    """
    return style is not None and think is not False


def think_level(style: ThinkStyle | None, think: bool | str | None) -> str | None:
    """The ``reasoning_effort`` for a template that takes one: "medium" for unset/True, "max" as "high",
    and the lowest level for False (harmony's trace cannot be turned off); None for other templates.

    >>> [think_level(HARMONY, t) for t in (None, True, False, "low", "max")]
    ['medium', 'medium', 'low', 'low', 'high']
    """
    if style is None or not style.levels:
        return None
    if think is None or think is True:
        return "medium" if "medium" in style.levels else style.levels[len(style.levels) // 2]
    if think is False:
        return style.levels[0]
    if think == "max":
        return style.levels[-1]
    return think if think in style.levels else style.levels[-1]


def render_kwargs(style: ThinkStyle | None, think: bool | str | None) -> dict[str, Any]:
    """Extra variables for the Jinja render of the prompt (``enable_thinking``, ``reasoning_effort``).

    >>> render_kwargs(HARMONY, "high"), render_kwargs(None, True)
    ({'reasoning_effort': 'high'}, {})
    """
    out: dict[str, Any] = {}
    if style is None:
        return out
    if style.enable_thinking:
        out["enable_thinking"] = think_on(style, think)
    level = think_level(style, think)
    if level is not None:
        out["reasoning_effort"] = level
    return out


def prompt_in_thought(style: ThinkStyle | None, prompt: str) -> bool:
    """Whether the rendered ``prompt`` ends inside an open thought (the template pre-filled the opening tag),
    so the splitter must start in thinking.

    >>> r1 = ThinkStyle("deepseek-r1", "<think>", "</think>")
    >>> prompt_in_thought(r1, "<｜Assistant｜><think>\\n"), prompt_in_thought(r1, "<think>\\n\\n</think>\\n\\n")
    (True, False)
    """
    return style is not None and prompt.rstrip().endswith(style.open_tag)


def prompt_suffix(style: ThinkStyle | None, think: bool | str | None, prompt: str = "") -> str:
    """Text to append to the rendered ``prompt`` so that it asks for ``think``.

    Thinking off on a tag template: the empty thought (``<think>\\n\\n</think>\\n\\n``), completed if the
    prompt already opened it and nothing if the template wrote it (Qwen3 with ``enable_thinking=False``).
    Thinking on for DeepSeek-R1: ``<think>\\n`` when the template did not open it (DeepSeek's advice: the
    distills sometimes skip the thought otherwise). Harmony and non-thinking models: "".

    >>> r1 = ThinkStyle("deepseek-r1", "<think>", "</think>")
    >>> prompt_suffix(r1, False, "<｜Assistant｜>"), prompt_suffix(r1, False, "<｜Assistant｜><think>\\n")
    ('<think>\\n\\n</think>\\n\\n', '\\n</think>\\n\\n')
    >>> prompt_suffix(r1, None, "<｜Assistant｜>")
    '<think>\\n'
    """
    if style is None or style.harmony:
        return ""
    if think_on(style, think):
        if style.name == "deepseek-r1" and not prompt_in_thought(style, prompt):
            return style.open_tag + "\n"
        return ""
    if prompt.rstrip().endswith(style.close_tag):  # the template closed an empty thought already
        return ""
    if prompt_in_thought(style, prompt):
        ws = prompt[len(prompt.rstrip()):]
        pad = "\n\n"[len(ws):] if "\n\n".startswith(ws) else ""
        return f"{pad}{style.close_tag}\n\n"
    return style.off_block


# ------------------------------------------------------------------------------------------ the splitter


def _overlap(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``tags`` (text to hold back).

    >>> _overlap("abc</th", ("</think>",)), _overlap("abc", ("</think>",))
    (4, 0)
    """
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


class _Out:
    """Pieces of one push, adjacent pieces of one kind merged, empty ones dropped."""

    def __init__(self) -> None:
        self.pieces: list[Piece] = []

    def add(self, kind: str, text: str) -> None:
        if not text:
            return
        if self.pieces and self.pieces[-1][0] == kind:
            self.pieces[-1] = (kind, self.pieces[-1][1] + text)
        else:
            self.pieces.append((kind, text))


# tag-style states (Ollama's thinking/parser.go)
_LOOKING, _START_WS, _THINKING, _DONE_WS, _DONE = range(5)
# harmony states (Ollama's harmony/harmonyparser.go), plus a pass-through when the text is not harmony
_H_LOOK, _H_HEADER, _H_BODY, _H_PLAIN = range(4)


class ThinkSplitter:
    """Streamed text in, ``(kind, text)`` pieces out: kind "thinking", "content" or (harmony) "tool".

    ``style`` None passes everything through as content (a model that does not think, or think=False on a tag
    template: any ``<think>`` text then stays in the content, as in Ollama). ``started_in_thinking``: the
    prompt already opened the thought (:func:`prompt_in_thought`); for harmony, an open analysis message.

    Tag styles: leading whitespace is skipped; if the first other text is not the opening tag, everything is
    content; inside the thought any tail that could begin the closing tag is held back, so a tag cut across
    pushes never leaks; whitespace after either tag is dropped, and so is one repeated opening tag.

    Harmony: ``<|start|>{header}<|message|>{body}<|end|>`` messages after an implicit ``<|start|>assistant``;
    channel ``analysis`` is thinking, ``final`` (or ``commentary`` to no one) content; a message with a
    recipient (``to=functions.get_weather``) is a tool call, returned by :meth:`flush` as one "tool" piece whose
    text is ``{"name": ..., "arguments": ...}`` in JSON (arguments parsed when they are JSON, else the raw text).

    >>> s = ThinkSplitter(HARMONY)
    >>> s.push("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant to=functions.get_weather")
    [('thinking', 'Need weather.')]
    >>> s.push('<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>') + s.flush()
    [('tool', '{"name": "get_weather", "arguments": {"city": "Paris"}}')]
    """

    def __init__(self, style: ThinkStyle | None, started_in_thinking: bool = False):
        self.style = style
        self._acc = ""
        self._done = False
        # tags
        self._state = _START_WS if started_in_thinking else _LOOKING
        self._stripped_repeat = False
        self._label_left = ""  # the part of the style's label still to skip after the opening tag
        # harmony
        self._kind = CONTENT
        self._tools: list[tuple[str, list[str]]] = []
        self._headers = 0
        if style is not None and style.harmony:
            self._state = _H_LOOK
            self._acc = _H_START + "assistant" + (_H_CHANNEL + "analysis" + _H_MESSAGE if started_in_thinking else "")

    def push(self, text: str) -> list[Piece]:
        """Add generated ``text``; return the pieces that are certain now."""
        out = _Out()
        if self.style is None:
            out.add(CONTENT, text)
            return out.pieces
        self._acc += text
        if self.style.harmony:
            self._eat_harmony(out)
        else:
            self._eat_tags(out)
        return out.pieces

    def flush(self) -> list[Piece]:
        """The end of the stream: what was held back, then (harmony) the tool calls."""
        out = _Out()
        if self._done or self.style is None:
            return out.pieces
        self._done = True
        acc, self._acc = self._acc, ""
        if not self.style.harmony:
            if self._state == _LOOKING and acc.strip():
                out.add(CONTENT, acc)  # a partial opening tag that never completed
            elif self._state == _THINKING:
                out.add(THINKING, acc)  # a partial closing tag that never completed
            return out.pieces
        if self._state == _H_BODY:
            self._emit_body(out, acc)
        elif self._state == _H_HEADER and self._headers == 0:
            out.add(CONTENT, acc.removeprefix("assistant"))  # never harmony: plain text after all
        elif self._state == _H_PLAIN:
            out.add(CONTENT, acc)
        for name, chunks in self._tools:
            raw = "".join(chunks).strip()
            try:
                args: Any = json.loads(raw)
            except ValueError:
                args = raw
            call = {"name": name.removeprefix("functions."), "arguments": args}
            out.pieces.append((TOOL, json.dumps(call, ensure_ascii=False)))  # one piece per call, never merged
        return out.pieces

    # -------------------------------------------------------------- tags

    def _eat_tags(self, out: _Out) -> None:
        st = self.style
        assert st is not None
        while True:
            acc = self._acc
            if self._state == _LOOKING:
                trimmed = acc.lstrip()
                if trimmed.startswith(st.open_tag):
                    self._acc = trimmed[len(st.open_tag):]
                    self._state = _START_WS  # whitespace, then maybe a repeated opening tag, then the thought
                    self._label_left = st.label
                    continue
                if st.open_tag.startswith(trimmed):  # nothing yet, or a partial opening tag
                    return
                self._state, self._acc = _DONE, ""
                out.add(CONTENT, acc)
                return
            if self._state == _START_WS:
                if self._label_left:  # the channel's name right after the tag (Gemma 4's "thought")
                    if acc.startswith(self._label_left):
                        acc, self._label_left = acc[len(self._label_left):], ""
                        self._acc = acc
                    elif self._label_left.startswith(acc):
                        return  # a partial label: wait for more
                    else:
                        self._label_left = ""
                trimmed = acc.lstrip()
                if not trimmed:
                    self._acc = ""
                    return
                if not self._stripped_repeat:
                    if trimmed.startswith(st.open_tag):
                        self._stripped_repeat = True
                        self._acc = trimmed[len(st.open_tag):]
                        continue
                    if st.open_tag.startswith(trimmed):
                        self._acc = trimmed
                        return
                self._stripped_repeat = True
                self._state, self._acc = _THINKING, trimmed
                continue
            if self._state == _THINKING:
                i = acc.find(st.close_tag)
                ends = [(k, e) for e in st.ends_at if (k := acc.find(e)) >= 0 and (i < 0 or k < i)]
                if ends:  # e.g. a tool call before any </think>: the thought ends, the call is the answer
                    k = min(ends)[0]
                    out.add(THINKING, acc[:k])
                    self._state, self._acc = _DONE, ""
                    out.add(CONTENT, acc[k:])
                    return
                if i >= 0:
                    out.add(THINKING, acc[:i])
                    rest = acc[i + len(st.close_tag):].lstrip()
                    self._state = _DONE if rest else _DONE_WS
                    self._acc = ""
                    out.add(CONTENT, rest)
                    return
                hold = _overlap(acc, (st.close_tag, *st.ends_at))
                out.add(THINKING, acc[:len(acc) - hold])
                self._acc = acc[len(acc) - hold:]
                return
            if self._state == _DONE_WS:
                trimmed = acc.lstrip()
                if trimmed:
                    self._state = _DONE
                out.add(CONTENT, trimmed)
                self._acc = ""
                return
            out.add(CONTENT, acc)  # _DONE
            self._acc = ""
            return

    # -------------------------------------------------------------- harmony

    def _eat_harmony(self, out: _Out) -> None:
        while True:
            acc = self._acc
            if self._state == _H_PLAIN:
                out.add(CONTENT, acc)
                self._acc = ""
                return
            if self._state == _H_LOOK:
                i = acc.find(_H_START)
                if i < 0:  # text between messages is dropped; keep a tail that may begin <|start|>
                    hold = _overlap(acc, (_H_START,))
                    self._acc = acc[len(acc) - hold:]
                    return
                self._acc = acc[i + len(_H_START):]
                self._state = _H_HEADER
                continue
            if self._state == _H_HEADER:
                i = acc.find(_H_MESSAGE)
                if self._headers == 0 and not 0 <= i <= _H_HEADER_LIMIT \
                        and len(acc) >= _H_HEADER_LIMIT + len(_H_MESSAGE):
                    self._state = _H_PLAIN  # no header where the first one must be: this is not harmony output
                    self._acc = acc.removeprefix("assistant")
                    continue
                if i < 0:
                    return
                header = acc[:i]
                j = header.rfind(_H_START)
                if j >= 0:  # the model started a message again: the header begins after the last start
                    header = header[j + len(_H_START):]
                self._acc = acc[i + len(_H_MESSAGE):]
                self._headers += 1
                self._state = _H_BODY
                self._open(header)
                continue
            # _H_BODY
            ends = [(k, t) for t in _H_ENDS if (k := acc.find(t)) >= 0]
            if ends:
                k, tag = min(ends)
                self._emit_body(out, acc[:k])
                self._acc = acc[k + len(tag):]
                self._state = _H_LOOK
                self._kind = CONTENT
                continue
            hold = _overlap(acc, _H_ENDS)
            self._emit_body(out, acc[:len(acc) - hold])
            self._acc = acc[len(acc) - hold:]
            return

    def _open(self, raw: str) -> None:
        """Start a message from its header (role, ``<|channel|>NAME``, optional recipient, ``<|constrain|>``)."""
        channel = ""
        if "<|constrain|>" in raw:
            raw = raw.replace("<|constrain|>", " <|constrain|>", 1)
        i = raw.find(_H_CHANNEL)
        if i >= 0:
            after = raw[i + len(_H_CHANNEL):]
            parts = after.split(None, 1)
            channel = parts[0] if parts else ""
            raw = raw[:i] + " " + (parts[1] if len(parts) > 1 else "")
        tokens = raw.split()
        recipient = ""
        if tokens and tokens[0].startswith("to="):
            recipient = tokens[0][3:]
        elif len(tokens) > 1 and tokens[1].startswith("to="):
            recipient = tokens[1][3:]
        if recipient:
            self._kind = TOOL
            self._tools.append((recipient, []))
        elif channel == "analysis":
            self._kind = THINKING
        else:
            self._kind = CONTENT

    def _emit_body(self, out: _Out, text: str) -> None:
        if self._kind == TOOL:
            self._tools[-1][1].append(text)
        else:
            out.add(self._kind, text)


def splitter_for(style: ThinkStyle | None, think: bool | str | None, prompt: str) -> ThinkSplitter:
    """The splitter for one request: harmony is always parsed (its channels are the format); a tag template
    splits only when thinking is on (think=False leaves any ``<think>`` in the content, as Ollama does).
    ``prompt`` is the final prompt (after :func:`prompt_suffix`).

    >>> r1 = ThinkStyle("deepseek-r1", "<think>", "</think>")
    >>> sp = splitter_for(r1, None, "<｜Assistant｜><think>\\n")
    >>> sp.push("Short.\\n</think>\\n\\nYes.")
    [('thinking', 'Short.\\n'), ('content', 'Yes.')]
    """
    if style is None:
        return ThinkSplitter(None)
    if style.harmony:
        return ThinkSplitter(style, started_in_thinking=prompt.endswith(style.open_tag))
    if not think_on(style, think):
        return ThinkSplitter(None)
    return ThinkSplitter(style, started_in_thinking=prompt_in_thought(style, prompt))


def split_text(style: ThinkStyle | None, text: str, started_in_thinking: bool = False) -> tuple[str, str, list[str]]:
    """(thinking, content, tool calls) of a whole answer, e.g. one stored in a history.

    >>> split_text(ThinkStyle("qwen3", "<think>", "</think>"), "<think>a</think>b")
    ('a', 'b', [])
    """
    s = ThinkSplitter(style, started_in_thinking)
    parts: dict[str, list[str]] = {THINKING: [], CONTENT: [], TOOL: []}
    for kind, piece in s.push(text) + s.flush():
        parts[kind].append(piece)
    return "".join(parts[THINKING]), "".join(parts[CONTENT]), parts[TOOL]
