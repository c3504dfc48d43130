"""The chat screen: conversations on the left, the streaming conversation on the right, a prompt and a
status line below.

The chat screen's own concerns are the conversations (open, new, rename, delete, export, settings), the
prompt's attachments, copying, and starting an answer. The widgets are in :mod:`localllm.tui.widgets`; streaming an
answer (the runner's events, the thinking block, the tool loop's rounds) is :mod:`localllm.tui.answer`'s.
When an answer ends the screen saves it (with its reasoning and tool calls, which come back folded when the chat
is reopened) and renders it once in full, so code fences render complete. The message list is anchored to the
bottom: it follows the stream until the user scrolls up, and picks it up again when they scroll back down.

Tools: a chat's enabled MCP servers (the settings modal, Ctrl+T; new chats get the ``"default": true`` ones)
start in the background when the chat first needs them. When the model's template renders tools, the answer
runs through the tool loop of :mod:`localllm.mcp.loop`: each call appears above the answer as a collapsible
block (:class:`~localllm.tui.widgets.ToolCallView`: tool, arguments, then the result), the first call of each
tool asks (:class:`~localllm.tui.modals.ToolConfirmModal`: allow once, allow for this chat, deny), the result goes
back to the model, and Esc stops a running tool (and the loop).
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Label, OptionList, Static
from textual.widgets.option_list import Option

from localllm.chats import DEFAULT_TITLE, Conversation, ImageRef
from localllm.errors import LocalLLMError

from .answer import AnswerInfo, AnswerStreamer, info_from_saved, stats_dict, status_text
from .widgets import MessageView, PromptInput

if TYPE_CHECKING:
    from localllm.mcp.host import ServerStatus
    from localllm.mcp.loop import ToolCall, ToolChat

    from .host import AppHost


EMPTY_HINT = """\
Type a message below and press Enter (Ctrl+J adds a newline, Esc stops an answer).

F3 models: pull, delete, set the default · F4 this machine · F1 every key · Ctrl+P commands"""


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
        self.tools_said: set[str] = set()  # models already told to have no tool support
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
            self.app.call_from_thread(self.say_failed, status)
        except RuntimeError:  # on the app's thread already
            self.say_failed(status)

    def say_failed(self, status: ServerStatus) -> None:
        line = status.line()
        if status.name in self.enabled_servers() and line not in self._failures_said:
            self._failures_said.add(line)
            self.notify(f"MCP {line}", severity="warning", timeout=8)

    async def ask_tool(self, call: ToolCall) -> str:
        """The first call of a tool in this chat: allow once, for the chat, or deny (the modal's answer)."""
        from .modals import ToolConfirmModal

        return await self.app.push_screen_wait(ToolConfirmModal(call))

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
        """The answer, streamed by :class:`~localllm.tui.answer.AnswerStreamer`; then saved and shown in full."""
        answer = await AnswerStreamer(self, view, model, cancel, info).run(conversation_id, messages, params)
        text, thought, tool_calls, error = answer.text, answer.thought, answer.tool_calls, answer.error
        stopped = cancel.is_set() or (answer.done is not None and answer.done.finish_reason == "cancelled")
        if text or thought or tool_calls:  # saved whatever the screen shows now
            msg = self.lapp.chats.add_message(conversation_id, "assistant", text,
                                              stats_dict(answer, info, model, stopped), thinking=thought or None,
                                              tool_calls=tool_calls or None)
            view.message_id = msg.id
        elif error is None and not stopped:
            error = "the model returned an empty answer"
        self.generating = False
        self.cancel = None
        if view.is_attached:
            view.content, view.thinking = text, thought
            if answer.thinking_view is not None:
                answer.thinking_view.finish()
            if text or thought or tool_calls:
                await view.markdown.update(text)  # one full render: complete code fences (oterm #308)
                self.call_after_refresh(self._on_screen, answer.t_end)
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


def _title(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= 40 else line[:39] + "…"
