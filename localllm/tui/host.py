"""What the screens need from the app that hosts them (:class:`localllm.tui.app.LocalLLMApp` implements it):
a Protocol of its own, so the screens type against it without importing the app (no import cycle)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from localllm.chats import ChatStore
    from localllm.mcp.host import McpHost
    from localllm.session import Session


class AppHost(Protocol):
    """The app's services and state shared by its screens."""

    chats: ChatStore  # the persisted conversations
    model: str  # the model new chats start with
    chat_screen: Any  # the ChatScreen once mounted (typed Any: naming it here would import the screen)
    mcp_problem: str | None  # why mcp.json could not be read (None: it was, or there is none)

    @property
    def session(self) -> Session: ...  # the in-process engine or the server (made on first use)

    @property
    def session_label(self) -> str: ...

    @property
    def mcp(self) -> McpHost: ...  # the MCP servers of mcp.json (nothing starts until a chat needs a server)

    def default_model_name(self) -> str: ...

    def set_default_model(self, name: str) -> None: ...

    def model_names(self) -> list[str]: ...

    def models_changed(self) -> None: ...
