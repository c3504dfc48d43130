"""The chat screen: conversations on the left, the streaming conversation on the right, a prompt and a
status line below.

One module on purpose: one screen, its widgets and the worker that streams into them.

Streaming: an async worker iterates the runner's async stream (``Runner.agenerate``: the events of an
in-process model's decode loop, or of a server's NDJSON stream, arrive on the event loop without a thread
of ours) and writes the text through ``Markdown.get_stream`` (which merges fragments when the screen cannot
keep up); at the end it sets the whole answer once so code fences render complete. A thinking model's
reasoning streams first into a dimmed, collapsible block above the answer (:class:`ThinkingView`), which
folds when the answer starts; it is saved with the message and comes back folded when the chat is
reopened. The message list is anchored to the bottom: it follows the stream until the user scrolls up, and
picks it up again when they scroll back down.

Tools: a chat's enabled MCP servers (the settings modal, Ctrl+T; new chats get the ``"default": true`` ones)
start in the background when the chat first needs them. When the model's template renders tools, the answer
runs through the tool loop of :mod:`localllm.mcp.loop`: each call appears above the answer as a collapsible
block (:class:`ToolCallView`: tool, arguments, then the result), the first call of each tool asks
(:class:`~localllm.tui.modals.ToolConfirmModal`: allow once, allow for this chat, deny), the result goes back to
the model, and Esc stops a running tool (and the loop). The calls are saved with the answer and come back,
folded, when the chat is reopened.
"""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from textual import events, on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import Collapsible, Footer, Label, Markdown, OptionList, Static, TextArea
from textual.widgets.option_list import Option

from localllm.chats import DEFAULT_TITLE, Conversation, ImageRef
from localllm.errors import LocalLLMError

if TYPE_CHECKING:
    from textual.widgets.markdown import MarkdownStream

    from localllm.engine import Done, GenerateRequest, LoadOptions, Stats
    from localllm.mcp.host import ServerStatus
    from localllm.mcp.loop import ToolCall, ToolChat, ToolTurn
    from localllm.session import Session
    from localllm.thinking import ThinkValue

    from .host import AppHost


EMPTY_HINT = """\
Type a message below and press Enter (Ctrl+J adds a newline, Esc stops an answer).

F3 models: pull, delete, set the default · F4 this machine · F1 every key · Ctrl+P commands"""


@dataclass
class AnswerInfo:
    """What the status line says about the last answer (filled in while it streams)."""

    model: str = ""
    where: str = ""  # where it ran: "llamacpp CPU", "server http://… 100% CPU"
    ttft_s: float | None = None
    stats: Stats | None = None  # of the Done event
    finish_reason: str = ""
    load_s: float | None = None  # the model load this answer waited for


# the settings modal's words → the request's think
THINK: dict[str, ThinkValue] = {"on": True, "off": False, "low": "low", "medium": "medium", "high": "high"}


def request_from(messages: list[dict[str, Any]], params: dict[str, Any]) -> tuple[GenerateRequest, LoadOptions]:
    """A conversation's messages and parameters (the settings modal's) → the runner's request and load options."""
    from localllm.engine import GenerateRequest, LoadOptions, Sampling

    sampling = Sampling(given=frozenset())  # what the settings modal sets wins over a created model's PARAMETERs
    for key in ("temperature", "top_p", "top_k", "seed", "max_tokens"):
        if params.get(key) not in (None, ""):
            sampling.choose(**{key: params[key]})
    load = LoadOptions(num_ctx=int(params["num_ctx"]) if params.get("num_ctx") else None,
                       draft=str(params["draft"]) if params.get("draft") else "auto")
    think = THINK.get(str(params.get("think")))  # unset: the model's default
    return GenerateRequest(messages=messages, sampling=sampling, think=think), load


def describe_loaded(session: Session, model: str) -> str:
    """Where ``model`` runs, for the status line: ``llamacpp CPU``, ``llamacpp GPU 20/30``, ``server URL 100% CPU``."""
    try:
        running = next((r for r in session.runner.ps() if r.name == model), None)
    except Exception:  # noqa: BLE001 - an Ollama without /api/ps still chats
        running = None
    if session.remote:
        return f"{session.label} {running.processor}" if running is not None else session.label
    if running is None:
        return ""
    where = f"GPU {running.n_gpu_layers}/{running.n_layers}" if running.n_gpu_layers else "CPU"
    return f"{running.backend} {where}"


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


class ChatScreen(Screen):
    """Conversations, the conversation, the prompt and the status line.

    The keys avoid the prompt's own editing keys (Ctrl+A/E/D/K/U/W/Y/Z stay emacs-like there)."""

    BINDINGS = [
        Binding("ctrl+n", "new_chat", "New", id="chat.new"),
        Binding("ctrl+r", "rename_chat", "Rename", id="chat.rename"),
        Binding("f8", "delete_chat", "Delete", id="chat.delete"),
        Binding("ctrl+s", "export_chat", "Export", id="chat.export"),
        Binding("ctrl+t", "settings", "Settings", id="chat.settings"),
        Binding("ctrl+g", "regenerate", "Regenerate", id="chat.regenerate"),
        Binding("escape", "stop", "Stop", id="chat.stop"),
        Binding("ctrl+o", "copy_last", "Copy answer", id="chat.copy", show=False),
        Binding("ctrl+f", "copy_code", "Copy code", id="chat.copy_code", show=False),
        Binding("ctrl+b", "toggle_sidebar", "Sidebar", id="chat.sidebar", show=False),
        Binding("ctrl+l", "focus_prompt", "Prompt", id="chat.focus_prompt", show=False),
        Binding("f5", "attach_image", "Attach image", id="chat.attach", show=False),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.conversation: Conversation | None = None
        self.cancel: threading.Event | None = None
        self.generating = False
        self.pending_images: list[ImageRef] = []  # attached (F5, or a path in the prompt) for the next message
        self.last_info: AnswerInfo | None = None
        self.render_lag_s: float | None = None  # end of generation -> last token on screen
        self.answer_done = asyncio.Event()
        self._tool_chats: dict[int, ToolChat] = {}  # per conversation: what the user allowed stays for the session
        self._tools_said: set[str] = set()  # models already told to have no tool support
        self._failures_said: set[str] = set()  # "server: reason" lines already shown
        self._unsubscribe: Any = None

    @property
    def lapp(self) -> AppHost:
        return self.app  # type: ignore[return-value]

    # ------------------------------------------------------------------ layout

    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            with Vertical(id="sidebar"):
                yield Label("Conversations", classes="title")
                yield OptionList(id="conversations")
            with Vertical(id="chat-pane"):
                yield VerticalScroll(id="messages")
                yield Label("", id="attachments")
                yield PromptInput(id="prompt", placeholder="Message (Enter sends, Ctrl+J newline)")
        yield Static("", id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.lapp.chat_screen = self
        self._unsubscribe = self.lapp.mcp.subscribe(self._server_changed)
        if self.lapp.mcp_problem:
            self.notify(self.lapp.mcp_problem, severity="error", timeout=10)
        store = self.lapp.chats
        self.query_one(PromptInput).prompts = store.prompt_history()
        convs = store.conversations()
        self.refresh_list(convs)
        if convs:
            self.open_conversation(convs[0].id)
        else:
            self.update_status()
        self.query_one(PromptInput).focus()

    def on_screen_resume(self) -> None:
        if not self.generating:
            self.update_status()  # the default model may have changed in the model manager

    # ------------------------------------------------------------------ conversations

    def refresh_list(self, convs: list[Conversation] | None = None) -> None:
        convs = self.lapp.chats.conversations() if convs is None else convs
        ol = self.query_one("#conversations", OptionList)
        ol.clear_options()
        ol.add_options([Option(c.title, id=str(c.id)) for c in convs])
        if self.conversation is not None:
            try:
                ol.highlighted = ol.get_option_index(str(self.conversation.id))
            except Exception:  # noqa: BLE001 - not in the list any more
                pass

    @property
    def model(self) -> str:
        if self.conversation is not None and self.conversation.model:
            return self.conversation.model
        return self.lapp.model

    def open_conversation(self, conversation_id: int | None) -> None:
        """Show a conversation (None: an empty new one, created on the first message)."""
        if self.generating:
            self.action_stop()
        self.conversation = self.lapp.chats.get(conversation_id) if conversation_id is not None else None
        box = self.query_one("#messages", VerticalScroll)
        box.remove_children()
        self.last_info = None
        if self.conversation is not None:
            saved = self.lapp.chats.messages(self.conversation.id)
            from localllm.mcp.loop import ToolCall

            views = [MessageView(m.role, m.content, m.id, thinking=m.thinking or "", images=m.images,
                                 stopped=(m.stats or {}).get("finish_reason") == "cancelled",
                                 tool_calls=[ToolCall.from_dict(c) for c in m.tool_calls or []]) for m in saved]
            answers = [m for m in saved if m.role == "assistant"]
            self.last_info = info_from_saved(answers[-1].stats) if answers else None
            if views:
                box.mount_all(views)
            self.refresh_list()
        if self.conversation is None or not box.children:
            box.mount(Static(EMPTY_HINT, id="empty-hint"))
        box.anchor()
        self.update_status()
        self.start_servers()

    @on(OptionList.OptionSelected, "#conversations")
    def _selected(self, event: OptionList.OptionSelected) -> None:
        if event.option.id and (self.conversation is None or str(self.conversation.id) != event.option.id):
            self.open_conversation(int(event.option.id))
        self.query_one(PromptInput).focus()

    def action_new_chat(self) -> None:
        self.open_conversation(None)
        self.query_one("#conversations", OptionList).highlighted = None
        self.query_one(PromptInput).focus()

    def action_rename_chat(self) -> None:
        if self.conversation is None:
            self.notify("Send a message first: an empty chat has nothing to rename.", severity="warning")
            return
        from .modals import TextModal

        conv_id = self.conversation.id

        def done(title: str | None) -> None:
            if title:
                self.lapp.chats.rename(conv_id, title)
                if self.conversation is not None and self.conversation.id == conv_id:
                    self.conversation = self.lapp.chats.get(conv_id)
                self.refresh_list()

        self.app.push_screen(TextModal("Rename conversation", self.conversation.title), done)

    def action_delete_chat(self) -> None:
        if self.conversation is None:
            return
        from .modals import ConfirmModal

        conv = self.conversation

        def done(yes: bool | None) -> None:
            if not yes:
                return
            if self.generating:
                self.action_stop()
            self.lapp.chats.delete(conv.id)
            rest = self.lapp.chats.conversations()
            self.conversation = None
            self.refresh_list(rest)
            self.open_conversation(rest[0].id if rest else None)
            self.notify(f"Deleted “{conv.title}”.", timeout=2)

        self.app.push_screen(ConfirmModal(f"Delete “{conv.title}” and its messages?"), done)

    def action_export_chat(self) -> None:
        if self.conversation is None:
            return
        from localllm.config import paths

        text = self.lapp.chats.export_markdown(self.conversation.id)
        slug = "".join(ch if ch.isalnum() else "-" for ch in self.conversation.title.lower()).strip("-")[:40]
        out = paths().data / "exports" / f"{self.conversation.id}-{slug or 'chat'}.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
        self.app.copy_to_clipboard(text)
        self.notify(f"Exported to {out} (and copied).", timeout=4)

    def action_settings(self) -> None:
        from .modals import SettingsModal

        conv = self.conversation
        models = self.lapp.model_names()

        def done(result: dict[str, Any] | None) -> None:
            if result is None:
                return
            target = self.ensure_conversation()
            self.conversation = self.lapp.chats.update(
                target.id, model=result["model"], system=result["system"], params=result["params"])
            chat = self._tool_chats.get(target.id)
            if chat is not None:  # the allowed tools stay; the servers and tools follow the settings
                chat.servers = list(result["params"].get("mcp") or [])
                chat.disabled = list(result["params"].get("mcp_off") or [])
            self.update_status()
            self.start_servers()
            self.notify("Settings saved for this conversation.", timeout=2)

        self.app.push_screen(SettingsModal(
            conv.model if conv and conv.model else self.lapp.model, models,
            conv.system if conv else "", conv.params if conv else {},
            mcp=self.lapp.mcp, enabled=self.enabled_servers()), done)

    def action_toggle_sidebar(self) -> None:
        sidebar = self.query_one("#sidebar")
        sidebar.display = not sidebar.display

    def action_focus_prompt(self) -> None:
        self.query_one(PromptInput).focus()

    def ensure_conversation(self, title: str = DEFAULT_TITLE) -> Conversation:
        if self.conversation is None:
            self.conversation = self.lapp.chats.create(title=title, model=self.lapp.model)
        return self.conversation

    # ------------------------------------------------------------------ copy

    def _views(self) -> list[MessageView]:
        return list(self.query_one("#messages").query(MessageView))

    def _last_answer(self) -> MessageView | None:
        answers = [v for v in self._views() if v.role == "assistant"]
        return answers[-1] if answers else None

    def action_copy_last(self) -> None:
        view = self.focused if isinstance(self.focused, MessageView) else self._last_answer()
        if view is not None:
            view.action_copy()

    def action_copy_code(self) -> None:
        view = self.focused if isinstance(self.focused, MessageView) else self._last_answer()
        if view is not None:
            view.action_copy_code()

    # ------------------------------------------------------------------ generation

    @on(PromptInput.Submitted)
    def _submitted(self, event: PromptInput.Submitted) -> None:
        if self.generating:
            self.notify("An answer is still streaming: Esc stops it.", severity="warning", timeout=3)
            self.query_one(PromptInput).load_text(event.text)
            return
        from localllm.audio import extract_paths as audio_paths
        from localllm.images import extract_paths

        text, paths = extract_paths(event.text)  # a path typed or pasted in the prompt is attached
        text, clips = audio_paths(text)  # audio files too (a model with an audio projector)
        for p in paths + clips:
            if not self._attach_image(str(p)):
                self.query_one(PromptInput).load_text(event.text)
                return
        images, self.pending_images = self.pending_images, []
        self._show_pending()
        conv = self.ensure_conversation(title=_title(text or event.text))
        if conv.title == DEFAULT_TITLE:
            self.lapp.chats.rename(conv.id, _title(text or event.text))
        msg = self.lapp.chats.add_message(conv.id, "user", text, images=images)  # committed before generating
        self.conversation = self.lapp.chats.get(conv.id)
        self.refresh_list()
        self.query("#empty-hint").remove()
        self.query_one("#messages", VerticalScroll).mount(MessageView("user", text, msg.id, images=images))
        self.start_answer()

    def _attach_image(self, path: str) -> bool:
        """Read, check and keep an image or an audio clip (by its suffix) for the next message; False (and a notice)
        when it is refused."""
        from localllm.audio import AUDIO_SUFFIXES, read_audio
        from localllm.images import read_image

        try:
            data = read_audio(path) if path.lower().endswith(AUDIO_SUFFIXES) else read_image(path)
        except LocalLLMError as e:
            self.notify(str(e), severity="error", timeout=6)
            return False
        self.pending_images.append(self.lapp.chats.save_image(data, Path(path).name))
        self._show_pending()
        return True

    def _show_pending(self) -> None:
        label = self.query_one("#attachments", Label)
        label.update("  ".join(i.chip for i in self.pending_images) if self.pending_images else "")
        label.display = bool(self.pending_images)

    def action_attach_image(self) -> None:
        from .modals import TextModal

        def done(path: str | None) -> None:
            if path and path.strip():
                self._attach_image(path.strip())
            self.query_one(PromptInput).focus()

        self.app.push_screen(TextModal("Attach an image or audio clip (path to a PNG, JPEG, WebP, GIF or BMP file, "
                                       "or a WAV, MP3 or FLAC one)"), done)

    def action_regenerate(self) -> None:
        if self.generating or self.conversation is None:
            return
        messages = self.lapp.chats.messages(self.conversation.id)
        if not messages:
            return
        if messages[-1].role == "assistant":
            self.lapp.chats.delete_message(messages[-1].id)
            for view in self._views():
                if view.message_id == messages[-1].id:
                    view.remove()
        self.start_answer()

    def action_stop(self) -> None:
        if self.cancel is not None:
            self.cancel.set()

    def history(self) -> list[dict[str, Any]]:
        """The messages the model sees: an answer that made tool calls expands to its calls and their results."""
        from localllm.mcp.loop import ToolCall, history_messages

        assert self.conversation is not None
        out: list[dict[str, Any]] = (
            [{"role": "system", "content": self.conversation.system}] if self.conversation.system else [])
        chats = self.lapp.chats
        for m in chats.messages(self.conversation.id):  # images re-sent from the chat's own copies (regenerate too)
            if m.role == "assistant" and m.tool_calls:
                out += history_messages([ToolCall.from_dict(c) for c in m.tool_calls], m.content)
                continue
            msg: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.images:
                msg["images"] = [chats.image_bytes(i) for i in m.images]
            out.append(msg)
        return out

    # ------------------------------------------------------------------ tools (MCP)

    def enabled_servers(self) -> list[str]:
        """The MCP servers this chat uses: its settings' choice, else the config's default ones."""
        params = self.conversation.params if self.conversation is not None else {}
        if "mcp" in params:
            return [n for n in params["mcp"] if n in self.lapp.mcp.names]
        return self.lapp.mcp.config.defaults()

    def start_servers(self) -> None:
        """Start this chat's servers in the background (never waits for them)."""
        try:
            self.lapp.mcp.start(self.enabled_servers())
        except Exception as e:  # noqa: BLE001 - one line; the chat goes on without tools
            self.notify(str(e), severity="error", timeout=8)

    def tool_chat(self, conversation_id: int, params: dict[str, Any]) -> ToolChat | None:
        from localllm.mcp.loop import ToolChat

        servers = self.enabled_servers()
        if not servers:
            return None
        chat = self._tool_chats.get(conversation_id)
        if chat is None:
            chat = self._tool_chats[conversation_id] = ToolChat(self.lapp.mcp, servers, params.get("mcp_off"))
        chat.servers, chat.disabled = servers, list(params.get("mcp_off") or [])
        return chat

    def _server_changed(self, status: ServerStatus) -> None:
        """A server's state changed (the host's thread): a failure of one this chat uses is one line."""
        if status.state != "failed":
            return
        try:
            self.app.call_from_thread(self._say_failed, status)
        except RuntimeError:  # on the app's thread already
            self._say_failed(status)

    def _say_failed(self, status: ServerStatus) -> None:
        line = status.line()
        if status.name in self.enabled_servers() and line not in self._failures_said:
            self._failures_said.add(line)
            self.notify(f"MCP {line}", severity="warning", timeout=8)

    async def _await_servers(self, chat: ToolChat, cancel: threading.Event, model: str) -> None:
        """Wait (without blocking the app) for this chat's servers that are still starting."""
        host = chat.host
        while any(host.status(n).state == "starting" for n in chat.servers) and not cancel.is_set():
            starting = [n for n in chat.servers if host.status(n).state == "starting"]
            self.update_status(f"{model}: starting MCP server {', '.join(starting)}… (Esc stops)")
            await asyncio.sleep(0.1)

    def _supports_tools(self, session: Session, model: str) -> bool:
        try:
            return "tools" in session.models.show(model).capabilities
        except Exception:  # noqa: BLE001 - unknown here: the generation will say what is wrong
            return True

    async def _run_call(self, view: MessageView, turn: ToolTurn, chat: ToolChat, call: ToolCall, model: str,
                        cancel: threading.Event) -> None:
        """Show one call, ask the first time, run it (Esc stops it), show its result."""
        from .modals import ToolConfirmModal

        block = ToolCallView(call)
        view.tool_calls.append(call)
        if view.is_attached:
            await view.mount(block, before=view.markdown)
        if call.info is None:  # no such tool: the model hears which there are
            turn.done(call, None)
            block.finish()
            return
        if chat.needs_asking(call):
            self.update_status(f"{model}: asks to call {call.tool}")
            decision = await self.app.push_screen_wait(ToolConfirmModal(call))
            if not chat.grant(call, decision):
                turn.done(call, None, denied=True)
                block.finish()
                return
        self.update_status(f"{model}: running {call.tool}… (Esc stops it)")
        task = asyncio.ensure_future(chat.host.acall(call.info, call.arguments))
        while not task.done() and not cancel.is_set():
            await asyncio.wait({task}, timeout=0.05)
        if not task.done():
            task.cancel()
            turn.done(call, None, stopped=True)
        else:
            turn.done(call, task.result())
        block.finish()

    def start_answer(self) -> None:
        assert self.conversation is not None
        box = self.query_one("#messages", VerticalScroll)
        view = MessageView("assistant", "")
        box.mount(view)
        box.anchor()
        self.cancel = threading.Event()
        self.generating = True
        self.answer_done.clear()
        self.render_lag_s = None
        info = AnswerInfo(model=self.model)
        self.last_info = info
        self.update_status(f"{self.model}: loading and thinking… (Esc stops)")
        self.stream_answer(view, self.conversation.id, self.model, self.history(),
                           dict(self.conversation.params), self.cancel, info)

    @work(group="answer")
    async def stream_answer(self, view: MessageView, conversation_id: int, model: str,
                            messages: list[dict[str, Any]], params: dict[str, Any], cancel: threading.Event,
                            info: AnswerInfo) -> None:
        """The answer: one generation, or with tools the rounds of the tool loop (each call shown, asked,
        run, its result sent back) until the model answers in words."""
        from localllm.engine import Done, TextChunk, ToolCalls

        parts: list[str] = []
        thought = ""
        thinking_view: ThinkingView | None = None
        done: Done | None = None
        error: str | None = None
        t_end = time.perf_counter()
        markdown = view.markdown
        stream: MarkdownStream | None = None
        turn: ToolTurn | None = None
        try:
            session = await asyncio.to_thread(lambda: self.lapp.session)  # made on first use: may be slow
            chat = self.tool_chat(conversation_id, params)
            if chat is not None:
                chat.start()
                await self._await_servers(chat, cancel, model)
                for name in chat.servers:  # a failure (a bad mcp.json entry too) is said once
                    if chat.host.status(name).state == "failed":
                        self._say_failed(chat.host.status(name))
                if not await asyncio.to_thread(self._supports_tools, session, model):
                    if model not in self._tools_said:
                        self._tools_said.add(model)
                        self.notify(f"The chat template of {model} does not support tools: the MCP tools are not "
                                    "given to it.", severity="warning", timeout=8)
                    chat = None
            turn = chat.turn(messages) if chat is not None else None
            while True:
                tools, fmt = turn.next_request() if turn is not None else (None, None)
                request, options = request_from(turn.messages if turn is not None else messages, params)
                request.tools = tools
                if fmt is not None:
                    request.format = fmt
                parts, calls = [], []
                stream = Markdown.get_stream(markdown)
                t0 = time.perf_counter()
                async with aclosing(session.runner.agenerate(model, request, options, cancel=cancel)) as answer:
                    async for event in answer:
                        t_end = time.perf_counter()
                        if isinstance(event, TextChunk):
                            if info.ttft_s is None:
                                info.ttft_s = t_end - t0
                            if event.thinking:
                                thought += event.text
                                if thinking_view is not None:
                                    thinking_view.show(thought)
                                elif view.is_attached:
                                    self.update_status(f"{model}: thinking… (Esc stops)")
                                    thinking_view = ThinkingView(thought, streaming=True)
                                    await view.mount(thinking_view, before=markdown)
                                continue
                            if not parts and view.is_attached:
                                self.update_status(f"{model}: answering… (Esc stops)")
                                if thinking_view is not None:
                                    thinking_view.finish()
                            parts.append(event.text)
                            if stream is not None and markdown.is_attached:
                                await stream.write(event.text)
                            elif stream is not None:  # the user opened another conversation: keep the text only
                                await stream.stop()
                                stream = None
                        elif isinstance(event, ToolCalls):
                            calls.extend(event.calls)
                        elif isinstance(event, Done):
                            done = event
                            info.stats, info.finish_reason = event.stats, event.finish_reason
                            if event.stats.load_duration:  # TTFT is the answer's: the model load is shown apart
                                info.load_s = event.stats.load_duration / 1e9
                                if info.ttft_s is not None:
                                    info.ttft_s = max(0.0, info.ttft_s - info.load_s)
                            info.where = await asyncio.to_thread(describe_loaded, session, model)
                if stream is not None:
                    await stream.stop()
                    stream = None
                if turn is None or cancel.is_set():
                    break
                pending = turn.answered("".join(parts), calls)
                if not pending:
                    break
                for call in pending:
                    await self._run_call(view, turn, turn.chat, call, model, cancel)
                if cancel.is_set():
                    break
                if markdown.is_attached:
                    await markdown.update("")  # the next round's text replaces this one's
        except Exception as e:  # noqa: BLE001 - shown to the user as one sentence
            error = _error_text(e, model)
        finally:
            if stream is not None:
                await stream.stop()
        text = "".join(parts)
        tool_calls = [c.as_dict() for c in turn.calls] if turn is not None else []
        stopped = cancel.is_set() or (done is not None and done.finish_reason == "cancelled")
        if text or thought or tool_calls:  # saved whatever the screen shows now
            msg = self.lapp.chats.add_message(conversation_id, "assistant", text,
                                              _stats_dict(done, info, model, stopped), thinking=thought or None,
                                              tool_calls=tool_calls or None)
            view.message_id = msg.id
        elif error is None and not stopped:
            error = "the model returned an empty answer"
        self.generating = False
        self.cancel = None
        if view.is_attached:
            view.content, view.thinking = text, thought
            if thinking_view is not None:
                thinking_view.finish()
            if text or thought or tool_calls:
                await markdown.update(text)  # one full render: complete code fences (oterm #308)
                self.call_after_refresh(self._on_screen, t_end)
                if stopped:
                    view.stopped = True
                    view.query_one(".role", Label).update("Assistant (stopped)")
            else:
                await view.remove()
            if error:
                self.notify(error, severity="error", timeout=8)
                self.update_status(f"{model}: {error}")
            else:
                self.update_status()
        self.refresh_list()
        self.answer_done.set()

    def _on_screen(self, t_end: float) -> None:
        self.render_lag_s = time.perf_counter() - t_end

    # ------------------------------------------------------------------ status

    def update_status(self, text: str | None = None) -> None:
        status = self.query_one("#status", Static)
        if text is not None:
            status.update(text)
            return
        status.update(status_text(self.model, self.lapp.session_label, self.last_info))


def status_text(model: str, where: str, info: AnswerInfo | None) -> str:
    """The status line: model, where it runs, tokens/s, TTFT, context used, draft acceptance of the last answer.

    >>> status_text("smollm2:135m", "in-process", None)
    'smollm2:135m · in-process · no answer yet'
    """
    parts = [model, (info.where if info and info.where else where)]
    if info is None or info.stats is None:
        parts.append("no answer yet" if info is None or info.ttft_s is None else "stopped")
        return " · ".join(parts)
    stats = info.stats
    if info.finish_reason == "cancelled":
        parts.append("stopped")
    parts.append(f"{stats.eval_rate:.1f} tok/s")
    if info.ttft_s is not None:
        parts.append(f"TTFT {_duration(info.ttft_s)}")
    if stats.n_ctx:
        parts.append(f"ctx {stats.context_used}/{stats.n_ctx}")
    acceptance = stats.draft_acceptance
    parts.append(f"draft {acceptance:.0%}" if acceptance is not None else "no draft")
    if info.load_s:
        parts.append(f"load {_duration(info.load_s)}")
    return " · ".join(parts)


def _duration(seconds: float) -> str:
    """Milliseconds under a second, else seconds.

    >>> _duration(0.0421), _duration(4.407)
    ('42 ms', '4.41 s')
    """
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _error_text(e: Exception, model: str) -> str:
    """One sentence for the status line, with the way out where there is one."""
    from localllm.errors import ModelNotFoundError

    if isinstance(e, ModelNotFoundError):
        return f"{model} is not installed: F3 opens the model manager to pull it, then Ctrl+G answers."
    return str(e) or type(e).__name__


def _title(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= 40 else line[:39] + "…"


def _stats_dict(done: Done | None, info: AnswerInfo, model: str, stopped: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"model": model, "finish_reason": "cancelled" if stopped else
                           (done.finish_reason if done is not None else "stop")}
    if info.ttft_s is not None:
        out["ttft_ms"] = round(info.ttft_s * 1000, 1)
    if info.where:
        out["backend"] = info.where  # the key older chats have
    if done is not None and done.stats is not None:
        s = done.stats
        out.update(eval_count=s.eval_count, tokens_per_s=round(s.eval_rate, 2), context_used=s.context_used,
                   n_ctx=s.n_ctx, draft_proposed=s.draft_proposed, draft_accepted=s.draft_accepted)
        if s.thinking_tokens:
            out["thinking_tokens"] = s.thinking_tokens
    return out


def info_from_saved(stats: dict[str, Any] | None) -> AnswerInfo | None:
    """The status line's data for an answer saved earlier (so a reopened chat shows its last stats).

    >>> info = info_from_saved({"model": "m", "eval_count": 50, "tokens_per_s": 100.0, "ttft_ms": 40.0,
    ...                         "n_ctx": 4096, "context_used": 120, "backend": "llamacpp CPU"})
    >>> status_text("m", "in-process", info)
    'm · llamacpp CPU · 100.0 tok/s · TTFT 40 ms · ctx 120/4096 · no draft'
    """
    if not stats or not stats.get("eval_count"):
        return None
    from localllm.engine import Stats

    tps = float(stats.get("tokens_per_s") or 0)
    count = int(stats["eval_count"])
    s = Stats(eval_count=count, eval_duration=int(count / tps * 1e9) if tps else 0,
              n_ctx=int(stats.get("n_ctx") or 0), context_used=int(stats.get("context_used") or 0),
              draft_proposed=int(stats.get("draft_proposed") or 0),
              draft_accepted=int(stats.get("draft_accepted") or 0))
    ttft = stats.get("ttft_ms")
    return AnswerInfo(model=str(stats.get("model") or ""), where=str(stats.get("backend") or ""),
                      ttft_s=float(ttft) / 1000 if ttft is not None else None, stats=s,
                      finish_reason=str(stats.get("finish_reason") or ""))
