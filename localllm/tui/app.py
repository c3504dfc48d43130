"""The terminal app: chat, model manager and hardware view in one window.

    $ localllm chat [MODEL] [--host URL]      # or just `localllm` in a terminal

Screens are app modes (F2 chat, F3 models, F4 hardware; F1 lists every key). Every binding has an
id; ``[keymap]`` in the config file remaps it (see :mod:`localllm.tui.settings`), and the command
palette (Ctrl+P) offers the same actions through :class:`ActionCommands`.

The screens' data source is a :class:`~localllm.session.Session` (``app.session``): the models and the
runner (in-process, or a server with ``--host``), and in-process the advisor (fit verdicts, catalog,
hardware). Made on first use, from a worker (it may be slow). ``app.mcp`` is the MCP host of ``mcp.json``
(:mod:`localllm.mcp`): made on first use too, its servers started in the background when a chat needs them,
and stopped with the app.
"""

from __future__ import annotations

import threading
from functools import partial
from pathlib import Path
from typing import Any

from textual.app import App
from textual.binding import Binding
from textual.command import DiscoveryHit, Hit, Hits, Provider

from localllm.chats import ChatStore
from localllm.config import DEFAULT_MODEL
from localllm.mcp.host import McpHost
from localllm.session import Session, open_session

from . import settings
from .chat import ChatScreen, MessageView, PromptInput
from .host import AppHost
from .models import HardwareScreen, ModelsScreen

CSS_PATH = Path(__file__).resolve().parent.parent / "assets" / "localllm.tcss"

SCREEN_TITLES = {ChatScreen: "Chat", ModelsScreen: "Models", HardwareScreen: "Hardware"}


def binding_table() -> list[tuple[str, type, Binding]]:
    """(where, class, binding) for every binding the app defines, in help order."""
    from .modals import ConfirmModal, HelpScreen, SettingsModal, TextModal, ToolConfirmModal

    out: list[tuple[str, type, Binding]] = []
    for where, cls in (("App", LocalLLMApp), ("Chat", ChatScreen), ("Prompt", PromptInput),
                       ("Message", MessageView), ("Models", ModelsScreen), ("Hardware", HardwareScreen),
                       ("Settings", SettingsModal), ("Dialogs", ConfirmModal), ("Dialogs", TextModal),
                       ("Tool call", ToolConfirmModal), ("Help", HelpScreen)):
        for b in cls.BINDINGS:
            if isinstance(b, Binding) and b.id and not any(b.id == o.id for _, _, o in out):
                out.append((where, cls, b))
    return out


class ActionCommands(Provider):
    """The command palette's view of the bindings: every action with an id, for the current screen
    and the app, runnable without knowing its key."""

    def _commands(self) -> list[tuple[str, str, Any, str]]:
        app = self.app
        screen = self.screen
        keymap = app._keymap  # noqa: SLF001 - the effective keys shown beside each command
        out = []
        nodes: list[tuple[str, Any]] = [(SCREEN_TITLES.get(type(screen), "Screen"), screen), ("App", app)]
        for label, node in nodes:
            for b in node.BINDINGS:
                if not isinstance(b, Binding) or not b.id or not b.description or b.id.startswith("modal."):
                    continue
                keys = keymap.get(b.id, b.key)
                out.append((f"{label}: {b.description}", f"{b.id} ({keys})", node, b.action))
        return out

    async def discover(self) -> Hits:
        for title, help_text, node, action in self._commands():
            yield DiscoveryHit(title, partial(node.run_action, action), help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, help_text, node, action in self._commands():
            score = matcher.match(title)
            if score > 0:
                yield Hit(score, matcher.highlight(title), partial(node.run_action, action), help=help_text)


class LocalLLMApp(App):
    """localllm's terminal app."""

    TITLE = "localllm"
    CSS_PATH = CSS_PATH
    COMMANDS = App.COMMANDS | {ActionCommands}
    MODES = {"chat": ChatScreen, "models": ModelsScreen, "hardware": HardwareScreen}
    DEFAULT_MODE = "chat"
    BINDINGS = [
        Binding("f1", "help", "Help", id="app.help"),
        Binding("f2", "switch_mode('chat')", "Chat", id="app.chat"),
        Binding("f3", "switch_mode('models')", "Models", id="app.models"),
        Binding("f4", "switch_mode('hardware')", "Hardware", id="app.hardware"),
        Binding("ctrl+q", "quit", "Quit", id="app.quit", priority=True),
    ]

    def __init__(self, model: str | None = None, host: str | None = None, *,
                 session: Session | None = None, chats: ChatStore | None = None, mcp: McpHost | None = None):
        super().__init__()
        self._mcp = mcp
        self.mcp_problem: str | None = None  # a config file that could not be read: said once
        self.requested_model = model
        self.host = host
        self._session = session
        self._session_lock = threading.Lock()
        self._own_chats = chats is None
        self.chats = chats or ChatStore()
        self.model = model or settings.default_model() or DEFAULT_MODEL
        self._model_names: list[str] | None = None
        self.chat_screen: ChatScreen | None = None
        keymap = settings.keymap()
        known = {b.id for _, _, b in binding_table()}
        self.unknown_keymap_ids = sorted(set(keymap) - known)
        self.set_keymap({k: v for k, v in keymap.items() if k in known})

    # ------------------------------------------------------------------ services

    @property
    def session(self) -> Session:
        """The in-process engine or the server, made on first use (from a worker: it may be slow)."""
        with self._session_lock:
            if self._session is None:
                self._session = open_session(self.host)
            return self._session

    @property
    def session_label(self) -> str:
        """``in-process`` or ``server URL`` (before the session exists: what it will be)."""
        if self._session is not None:
            return self._session.label
        return self.host or "in-process"

    @property
    def mcp(self) -> McpHost:
        """The MCP host of ``mcp.json`` (an empty one when the file cannot be read: the reason is kept in
        :attr:`mcp_problem` and shown once)."""
        if self._mcp is None:
            from localllm.errors import LocalLLMError
            from localllm.mcp.config import McpConfig, config_path, load_config

            try:
                config = load_config()
            except LocalLLMError as e:
                self.mcp_problem = str(e)
                config = McpConfig(path=config_path())
            self._mcp = McpHost(config)
        return self._mcp

    def default_model_name(self) -> str:
        return settings.default_model() or DEFAULT_MODEL

    def set_default_model(self, name: str) -> None:
        settings.set_default_model(name)
        if self.requested_model is None:
            self.model = name

    def model_names(self) -> list[str]:
        """Installed model names (cached; refreshed when the model manager changes them)."""
        if self._model_names is None:
            try:
                self._model_names = [m.name for m in self.session.models.list()]
            except Exception:  # noqa: BLE001 - the settings modal still lets the current model stay
                self._model_names = []
        return self._model_names

    def models_changed(self) -> None:
        self._model_names = None

    # ------------------------------------------------------------------ lifecycle

    def on_mount(self) -> None:
        if self.unknown_keymap_ids:
            self.notify(f"[keymap] has unknown binding ids: {', '.join(self.unknown_keymap_ids)} (F1 lists them).",
                        severity="warning", timeout=8)

    def on_unmount(self) -> None:
        screen = self.chat_screen
        if screen is not None and screen.cancel is not None:
            screen.cancel.set()  # the generator stops at the next token; the model is freed by close()
        if self._mcp is not None:
            self._mcp.close()  # every server's process ends with the app
        if self._session is not None:
            self._session.close()
        if self._own_chats:
            self.chats.close()

    # ------------------------------------------------------------------ help

    def help_rows(self) -> list[tuple[str, str, str, str]]:
        rows = []
        for where, _cls, b in binding_table():
            keys = self._keymap.get(b.id, b.key) if b.id else b.key
            rows.append((where, keys, b.description or b.action, b.id or ""))
        return rows

    def action_help(self) -> None:
        from .modals import HelpScreen

        self.push_screen(HelpScreen(self.help_rows()))


def run(model: str | None = None, host: str | None = None) -> None:
    """Open the app (``localllm chat``). With ``host``, the server is checked first, so a wrong address
    is one sentence on the terminal rather than an error inside the app."""
    session = open_session(host) if host else None
    LocalLLMApp(model=model, host=host, session=session).run()


def _hosts_the_screens(app: LocalLLMApp) -> AppHost:
    """For mypy: the app is what the screens type against (:class:`localllm.tui.host.AppHost`)."""
    return app
