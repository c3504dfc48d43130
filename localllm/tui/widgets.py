"""The chat screen's widgets: a message (click to copy it, or one of its code blocks), the prompt (Enter sends,
Up recalls), and the folding blocks above an answer for a thinking model's reasoning and for each tool call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Collapsible, Label, Markdown, Static, TextArea

if TYPE_CHECKING:
    from localllm.chats import ImageRef
    from localllm.mcp.loop import ToolCall


class ThinkingView(Collapsible):
    """A thinking model's reasoning above its answer: dimmed, folded or unfolded by a click (or Enter) on its
    title. Open while the reasoning streams; folded once the answer starts and when a saved chat is shown."""

    DEFAULT_CSS = """
    ThinkingView {
        background: transparent;
        border-top: none;
        padding: 0;
        margin: 0 0 1 0;
    }
    ThinkingView > CollapsibleTitle {
        padding: 0;
        color: $text-muted;
    }
    ThinkingView > Contents {
        padding: 0 0 0 2;
    }
    ThinkingView .thinking-text {
        color: $text-muted;
        text-style: italic;
    }
    """

    def __init__(self, text: str, *, streaming: bool = False):
        self.text = text
        self._body = Static(text, markup=False, classes="thinking-text")
        super().__init__(self._body, title="Thinking…" if streaming else "Thinking", collapsed=not streaming,
                         classes="thinking")

    def show(self, text: str) -> None:
        """The reasoning so far (while it streams)."""
        self.text = text
        self._body.update(text)

    def finish(self) -> None:
        """The reasoning is over: fold it."""
        self.title = "Thinking"
        self.collapsed = True


class ToolCallView(Collapsible):
    """One tool call above the answer: ``⚙ tool {arguments} · state`` as the title; unfolded, the arguments and
    the result. Folded once it has a result, and when a saved chat is shown."""

    def __init__(self, call: ToolCall):
        self.call = call
        self._body = Static(self._body_text(), markup=False, classes="tool-text")
        super().__init__(self._body, title=self._title_text(), collapsed=call.status != "pending",
                         classes="tool-call error" if call.is_error else "tool-call")

    def _title_text(self) -> str:
        state = {"pending": "running… (Esc stops it)", "done": "done", "error": "error", "denied": "denied",
                 "stopped": "stopped"}.get(self.call.status, self.call.status)
        where = f" ({self.call.server})" if self.call.server else ""
        return f"⚙ {self.call.summary()}{where} · {state}"

    def _body_text(self) -> str:
        import json

        args = json.dumps(self.call.arguments, indent=2, ensure_ascii=False)
        result = self.call.result if self.call.status != "pending" else "…"
        return f"arguments:\n{args}\n\nresult:\n{result}"

    def finish(self) -> None:
        """The call has its outcome: show it in the title and the body, and fold."""
        self.title = self._title_text()
        self._body.update(self._body_text())
        self.set_class(self.call.is_error, "error")
        self.collapsed = True


class PromptInput(TextArea):
    """Multi-line prompt: Enter sends, Ctrl+J (or Shift+Enter where the terminal reports it) adds a
    newline, Up on the first line recalls earlier prompts."""

    # Handled in _on_key, in the widget's own queue, so a key typed just before Enter is always in the
    # text that is sent (an app-level priority binding would run ahead of keys still queued here).
    BINDINGS = [
        Binding("enter", "submit", "Send", id="prompt.send"),
        Binding("ctrl+j,shift+enter", "newline", "Newline", id="prompt.newline"),
        Binding("up", "history_prev", "Earlier prompt", id="prompt.history_prev", show=False),
        Binding("down", "history_next", "Later prompt", id="prompt.history_next", show=False),
    ]

    class Submitted(Message):
        def __init__(self, text: str):
            super().__init__()
            self.text = text

    def __init__(self, **kwargs: Any):
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)
        self.prompts: list[str] = []
        self._hist_pos: int | None = None
        self._draft = ""

    def _own_keys(self) -> dict[str, str]:
        keymap = self.app._keymap  # noqa: SLF001 - the keys the config file remapped
        out: dict[str, str] = {}
        for b in self.BINDINGS:
            assert isinstance(b, Binding) and b.id
            for key in keymap.get(b.id, b.key).split(","):
                out[key.strip()] = b.action
        return out

    async def _on_key(self, event: events.Key) -> None:
        keys = self._own_keys()
        action = next((keys[k] for k in (event.key, *event.aliases) if k in keys), None)
        if action is None:
            await super()._on_key(event)
            return
        event.stop()
        event.prevent_default()
        await self.run_action(action)

    def action_submit(self) -> None:
        text = self.text.strip()
        if not text:
            return
        self.post_message(self.Submitted(text))
        if not self.prompts or self.prompts[-1] != text:
            self.prompts.append(text)
        self._hist_pos = None
        self.clear()

    def action_newline(self) -> None:
        self.insert("\n")

    def action_history_prev(self) -> None:
        if self.cursor_location[0] > 0 or not self.prompts:
            self.action_cursor_up()
            return
        if self._hist_pos is None:
            self._draft, self._hist_pos = self.text, len(self.prompts)
        if self._hist_pos > 0:
            self._hist_pos -= 1
            self._show(self.prompts[self._hist_pos])

    def action_history_next(self) -> None:
        last_row = self.document.line_count - 1
        if self._hist_pos is None or self.cursor_location[0] < last_row:
            self.action_cursor_down()
            return
        self._hist_pos += 1
        if self._hist_pos >= len(self.prompts):
            self._hist_pos = None
            self._show(self._draft)
        else:
            self._show(self.prompts[self._hist_pos])

    def _show(self, text: str) -> None:
        self.load_text(text)
        self.move_cursor(self.document.end)


class MessageView(Vertical, can_focus=True):
    """One message. Click it to copy it; click a code block to copy only that block."""

    BINDINGS = [
        Binding("c,y", "copy", "Copy", id="message.copy"),
        Binding("k", "copy_code", "Copy code", id="message.copy_code"),
    ]

    def __init__(self, role: str, content: str, message_id: int | None = None, stopped: bool = False,
                 thinking: str = "", images: list[ImageRef] | None = None,
                 tool_calls: list[ToolCall] | None = None):
        super().__init__(classes=f"message {role}")
        self.role, self.content, self.message_id = role, content, message_id
        self.images = list(images or [])
        self.thinking = thinking
        self.tool_calls = list(tool_calls or [])
        self.stopped = stopped
        self._code_index = 0

    def compose(self) -> ComposeResult:
        label = {"user": "You", "assistant": "Assistant", "system": "System"}.get(self.role, self.role)
        yield Label(label + (" (stopped)" if self.stopped else ""), classes="role")
        if self.thinking:
            yield ThinkingView(self.thinking)
        if self.images:  # chips: file name and pixels (the bytes are kept by content hash with the chat)
            yield Label("  ".join(i.chip for i in self.images), classes="images")
        for call in self.tool_calls:
            yield ToolCallView(call)
        yield Markdown(self.content, classes="body")

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    def code_blocks(self) -> list[str]:
        from textual.widgets._markdown import MarkdownFence

        return [fence.code for fence in self.query(MarkdownFence)]

    def action_copy(self) -> None:
        self.app.copy_to_clipboard(self.content)
        self.notify("Message copied.", timeout=2)

    def action_copy_code(self) -> None:
        blocks = self.code_blocks()
        if not blocks:
            self.notify("This message has no code block.", severity="warning", timeout=2)
            return
        block = blocks[self._code_index % len(blocks)]
        self._code_index += 1
        self.app.copy_to_clipboard(block)
        self.notify(f"Code block {(self._code_index - 1) % len(blocks) + 1}/{len(blocks)} copied.", timeout=2)

    def on_click(self, event: events.Click) -> None:
        from textual.widgets._markdown import MarkdownFence

        node: Widget | None = event.widget
        while node is not None and node is not self:
            if isinstance(node, ThinkingView | ToolCallView):  # folds or unfolds (its title's own click); no copy
                return
            if isinstance(node, MarkdownFence):
                self.app.copy_to_clipboard(node.code)
                self.notify("Code block copied.", timeout=2)
                return
            node = node.parent if isinstance(node.parent, Widget) else None
        self.action_copy()
