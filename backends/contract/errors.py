"""Backend errors: each a :class:`BackendError` whose ``str()`` is one sentence a user can act on::

    BackendError
    ├── ModelLoadError        the file cannot be loaded (corrupt, unsupported architecture, no memory)
    ├── UnsupportedError      a feature the model / build cannot do (quantized KV type, draft pairing, format)
    ├── ContextOverflowError  the prompt does not fit the context even after dropping old turns
    ├── InputTooLargeError    embedding / rerank inputs over the caller's token cap (nothing was evaluated)
    ├── RequestCancelled      the caller cancelled the work (its client went away)
    └── PoolFullError         the shared KV pool has no room for this step (the loop frees idle cells and retries)
"""

from __future__ import annotations


class BackendError(Exception):
    """Base of every backend error; ``str(e)`` is one sentence a user can act on."""


class ModelLoadError(BackendError):
    """The weights could not be loaded."""


class UnsupportedError(BackendError):
    """The model or the build cannot do what was asked (KV type, draft pair, format, images...)."""


class ContextOverflowError(BackendError):
    """The prompt does not fit even after dropping the oldest turns."""

    def __init__(self, message: str, prompt_tokens: int = 0, n_ctx: int = 0):
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.n_ctx = n_ctx


class InputTooLargeError(BackendError):
    """Embedding or rerank inputs that take more tokens than the caller allows one request."""

    def __init__(self, message: str, tokens: int = 0, limit: int = 0):
        super().__init__(message)
        self.tokens = tokens
        self.limit = limit


class RequestCancelled(BackendError):
    """The work was cancelled by its caller (a client that went away) before it was done."""


class PoolFullError(BackendError):
    """:meth:`TokenSource.evaluate` found no free KV cells for the batch; the memory is unchanged."""
