"""Placeholder until the thinking module lands (issue 14): no model is detected as thinking."""

from __future__ import annotations

from typing import Any


class ThinkSplitter:
    def __init__(self, style: Any, started_in_thinking: bool = False):
        self.style = style

    def push(self, text: str) -> list[tuple[str, str]]:
        return [("content", text)]

    def flush(self) -> list[tuple[str, str]]:
        return []


def thinking_style(chat_template: str | None, architecture: str | None = None) -> Any:
    return None


def render_kwargs(style: Any, think: Any) -> dict[str, Any]:
    return {}


def prompt_suffix(style: Any, think: Any) -> str:
    return ""


def thinks(style: Any, think: Any) -> bool:
    return False


def prompt_opens_thinking(style: Any, prompt_text: str) -> bool:
    return False
