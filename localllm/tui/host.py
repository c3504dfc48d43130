"""What the screens need from the app that hosts them (:class:`localllm.tui.app.LocalLLMApp` implements it):
a Protocol of its own, so the screens type against it without importing the app (no import cycle)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from localllm.chats import ChatStore
    from localllm.session import Session


class AppHost(Protocol):
    """The app's services and state shared by its screens."""

    chats: ChatStore  # the persisted conversations
    model: str  # the model new chats start with
    chat_screen: Any  # the ChatScreen once mounted (typed Any: naming it here would import the screen)

    @property
    def session(self) -> Session: ...  # the in-process engine or the server (made on first use)

    @property
    def session_label(self) -> str: ...

    def default_model_name(self) -> str: ...

    def set_default_model(self, name: str) -> None: ...

    def model_names(self) -> list[str]: ...

    def models_changed(self) -> None: ...
