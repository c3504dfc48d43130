"""What an API's translator is: its routes and the shape of its errors. Each API's module (``ollama_routes``,
``openai_routes``, ``responses_routes``, ``anthropic_routes``) makes one :class:`Translator`; the table of them is
:data:`localllm.server.apis.APIS`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter

ErrorBody = Callable[[int, str, "str | None"], dict[str, Any]]  # (status, message, param) -> the JSON body


@dataclass(frozen=True)
class Translator:
    """One API in front of the generation path."""

    name: str
    router: APIRouter
    error_body: ErrorBody  # the API's error shape; its routes' errors (and its streams' last frames) use it
    prefix: str  # the paths it owns: a path that no route matches gets the shape of the longest prefix it is under

    def owns(self, path: str) -> bool:
        """Whether ``path`` is under :attr:`prefix`.

        >>> t = Translator("x", APIRouter(), lambda status, message, param: {}, "/v1")
        >>> t.owns("/v1/nope"), t.owns("/v1"), t.owns("/v10")
        (True, True, False)
        """
        return not self.prefix or path == self.prefix or path.startswith(self.prefix + "/")
