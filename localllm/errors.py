"""The exception tree of localllm (drawn in ``localllm/__init__.py``)."""

from __future__ import annotations


class LocalLLMError(Exception):
    """An error a user can cause. ``str(e)`` is one clear sentence meant for them."""


class InvalidNameError(LocalLLMError, ValueError):
    """A model name that is empty, malformed, or would leave the models directory."""


class ModelNotFoundError(LocalLLMError, LookupError):
    """No such model. ``suggestions`` holds close matches, best first."""

    def __init__(self, message: str, suggestions: list[str] | None = None):
        self.suggestions = list(suggestions or [])
        if self.suggestions:
            message = f"{message} Did you mean: {', '.join(self.suggestions)}?"
        super().__init__(message)


class PullError(LocalLLMError):
    """A download failed: network, hash mismatch, not enough disk space."""


class SourceUnavailable(PullError):
    """One source could not be reached (offline, DNS failure, 404); the next source is tried."""


class InvalidModelFileError(LocalLLMError):
    """A model file that is not a valid GGUF, or whose tensors do not fit its length."""


class PlanError(LocalLLMError):
    """The model cannot be loaded on this machine as asked; the message carries the numbers."""
