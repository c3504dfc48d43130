"""Reasoning ("thinking") as the faces need it: whether an installed model thinks, and a request's ``think``
checked in Ollama's words. The work itself (rendering ``think``, splitting the stream) is the backends'
(:mod:`backends.core.thinking`); faces import this module, never ``backends``.

    >>> parse_think("max"), parse_think(True)
    ('high', True)
    >>> thinks({"chat_template": "{{ messages }}", "architecture": "llama"})
    False
"""

from __future__ import annotations

from typing import Any

from backends.contract.specs import ThinkValue
from backends.core.thinking import ThinkStyle, thinking_style
from backends.core.thinking import parse_think as _parse

__all__ = ["parse_think", "style_of", "thinks", "asks_to_think"]


def parse_think(value: Any) -> ThinkValue:
    """A request's ``think``: None, True, False or a level; ``"max"`` is the highest level (Ollama maps it to
    "high" for the templates that take levels, and any level means "on" for the others). Raises ValueError
    with Ollama's message for anything else."""
    v = _parse(value)
    if v == "max":
        return "high"
    return v  # type: ignore[return-value]


def style_of(info: dict[str, Any]) -> ThinkStyle | None:
    """The reasoning style of an installed model from its metadata (``chat_template``, ``architecture``)."""
    return thinking_style(info.get("chat_template"), info.get("architecture"))


def thinks(info: dict[str, Any]) -> bool:
    """Whether the model's template thinks (``/api/show`` lists "thinking" then)."""
    return style_of(info) is not None


def asks_to_think(value: ThinkValue) -> bool:
    """Whether a request's ``think`` asks for thinking (True or a level); unset and False do not *ask*. (Whether
    a model will think is :func:`backends.core.thinking.think_on`: unset on a thinking model means yes.)"""
    return value is not None and value is not False
