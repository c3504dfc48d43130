"""What a face opens: a :class:`Session` of :class:`~localllm.api.Models` and :class:`~localllm.api.Runner`
(and, in-process, an :class:`~localllm.api.Advisor`), in this process or on a server.

    session = open_session(host)      # host: --host URL, or None (LOCALLLM_HOST is tried, else in-process)
    try:
        for event in session.runner.generate(name, request):
            ...
    finally:
        session.close()

:func:`open_models` is the light form for commands that only list, show, pull or remove (no engine).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from localllm.api import Advisor, Models, Runner
from localllm.client import connect
from localllm.local import LocalAdvisor, LocalModels, LocalRunner

if TYPE_CHECKING:
    from localllm.engine import Engine
    from localllm.mlxmodels import ConversionProgress


@dataclass
class Session:
    """The models, the runner and (in-process) the advisor a face works with."""

    models: Models
    runner: Runner
    advisor: Advisor | None = None  # None for a server: it decides how models load

    @property
    def label(self) -> str:
        """``"in-process"`` or ``"server http://host:port"``."""
        return self.runner.label

    @property
    def remote(self) -> bool:
        return self.runner.remote

    def close(self) -> None:
        self.runner.close()
        if self.models is not self.runner:
            self.models.close()


def open_models(host: str | None = None) -> Models:
    """A server's models (``--host``, or ``LOCALLLM_HOST`` answering), else this machine's store."""
    client = connect(host)
    return client if client is not None else LocalModels()


def open_session(host: str | None = None, *, engine: Engine | None = None, keep_alive: float | None = None,
                 on_convert: Callable[[ConversionProgress], None] | None = None) -> Session:
    """A server's session (``--host``, or ``LOCALLLM_HOST`` answering), else an in-process one over ``engine``
    (default: a new :class:`~localllm.engine.Engine` with ``keep_alive`` and ``on_convert``)."""
    if engine is None:
        client = connect(host)
        if client is not None:
            return Session(client, client)
        from localllm.engine import Engine

        engine = Engine(keep_alive=keep_alive, on_convert=on_convert)
    return Session(LocalModels(engine.store), LocalRunner(engine), LocalAdvisor(engine))
