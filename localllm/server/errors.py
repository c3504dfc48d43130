"""Request errors and messages safe to send: :class:`APIError` (a status and one sentence), and what any
exception from the engine or the store becomes (:func:`status_of`) with paths and tracebacks left out
(:func:`scrub`). The shape an error leaves in belongs to each API's translator (:mod:`localllm.server.apis`)."""

from __future__ import annotations

import logging
import re

from localllm.errors import InvalidNameError, LocalLLMError

log = logging.getLogger("localllm.server")


class APIError(Exception):
    """An error with an HTTP status and one sentence; it leaves in the shape of the API whose route raised it."""

    def __init__(self, status: int, message: str, *, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def bad_request(message: str, param: str | None = None) -> APIError:
    """A 400 naming what is wrong (``param``: the field, for the APIs whose errors carry it)."""
    return APIError(400, message, param=param)


_PATH_RE = re.compile(r"(?<![\w.:/~-])(?:[A-Za-z]:\\|~?/)(?:[^\s'\"():,;<>]+[/\\])+([^\s'\"():,;<>]*)")


def scrub(message: str) -> str:
    """Drop directories from any filesystem path in ``message`` (the file name stays), and keep it
    to one line: error bodies never reveal the layout of the machine.

    >>> scrub("cannot open /home/me/.local/share/localllm/models/blobs/sha256-ab: no such file")
    'cannot open sha256-ab: no such file'
    >>> scrub("see hf.co/user/repo and https://example.com/a/b")
    'see hf.co/user/repo and https://example.com/a/b'
    """
    text = _PATH_RE.sub(lambda m: m.group(1) or "<path>", str(message))
    return " ".join(text.split())[:2000]


def status_of(e: BaseException) -> tuple[int, str]:
    """An exception from the engine / store → (HTTP status, safe one-line message)."""
    from localllm.api import BackendError, ContextOverflowError, InputTooLargeError, RequestCancelled, UnsupportedError
    from localllm.errors import InvalidModelFileError, ModelNotFoundError, PlanError, PullError
    from localllm.residency import ServerBusyError

    if isinstance(e, APIError):
        return e.status, scrub(e.message)
    if isinstance(e, ServerBusyError):
        return 503, str(e)
    if isinstance(e, InputTooLargeError):  # embedding / rerank inputs over a cap: one request too large
        return 413, scrub(str(e))
    if isinstance(e, RequestCancelled):  # the client went away: nobody reads this (nginx's "client closed request")
        return 499, scrub(str(e))
    if isinstance(e, ModelNotFoundError):
        return 404, scrub(str(e))
    if isinstance(e, InvalidNameError | UnsupportedError | ContextOverflowError | PlanError):
        return 400, scrub(str(e))  # a PlanError: the load asked for cannot be made here (a context too big, ...)
    if isinstance(e, InvalidModelFileError | PullError | BackendError):
        return 500, scrub(str(e))
    if isinstance(e, LocalLLMError):
        return 400, scrub(str(e))
    log.exception("internal error", exc_info=e)
    return 500, "internal server error"
