"""Residency: what the engine keeps of a loaded model (:class:`Resident`: references, keep-alive, the plan it
loaded with), Ollama's ``keep_alive`` durations, the queue bound's error, and which idle models make room for a
load (:func:`in_the_way`). The engine (:mod:`localllm.engine`) holds the lock these run under; nothing here
loads or closes anything.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from backends.contract.metrics import LoopMetrics
from backends.contract.source import ModelInfo
from backends.core.loop import LoadedModel
from localllm.errors import LocalLLMError
from localllm.loader import LoadOptions, left_to_planner

if TYPE_CHECKING:
    from localllm.planner import Plan
    from localllm.store import InstalledModel

DEFAULT_KEEP_ALIVE = 300.0  # seconds (Ollama: 5m)
DEFAULT_MAX_QUEUE = 512
SHRINK_AFTER = 3  # requests in a row that fit the default context before a grown context goes back to it
BUSY_MESSAGE = "server busy, please try again.  maximum pending requests exceeded"


class ServerBusyError(LocalLLMError):
    """More requests are waiting than ``LOCALLLM_MAX_QUEUE`` allows (HTTP 503)."""

    def __init__(self, message: str = BUSY_MESSAGE):
        super().__init__(message)


MAX_KEEP_ALIVE = 100 * 365.25 * 86400.0  # longer than this is forever (a date past year 9999 has no RFC 3339 form)


def parse_keep_alive(value: Any, default: float | None = None) -> float:
    """Ollama's keep_alive: ``"5m"``, ``"1h30m"``, ``"10s"``, a number of seconds, negative = forever (inf), as is
    anything over a century.

    >>> parse_keep_alive("5m"), parse_keep_alive(0), parse_keep_alive(-1), parse_keep_alive(1e18)
    (300.0, 0.0, inf, inf)
    """
    seconds = _keep_alive(value, default)
    return float("inf") if seconds > MAX_KEEP_ALIVE else seconds


def _keep_alive(value: Any, default: float | None) -> float:
    if value is None or value == "":
        if default is not None:
            return default
        return parse_keep_alive(os.environ.get("LOCALLLM_KEEP_ALIVE") or DEFAULT_KEEP_ALIVE, DEFAULT_KEEP_ALIVE)
    if isinstance(value, bool):
        raise LocalLLMError(f"keep_alive must be a duration like '5m' or a number of seconds, got {value!r}.")
    if isinstance(value, int | float):
        return float("inf") if value < 0 else float(value)
    text = str(value).strip().lower()
    try:
        seconds = float(text)
        return float("inf") if seconds < 0 else seconds
    except ValueError:
        pass
    import re

    if text.startswith("-"):
        return float("inf")
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise LocalLLMError(f"keep_alive must be a duration like '5m' or a number of seconds, got {value!r}.")
    unit = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    return sum(float(n) * unit[u] for n, u in parts)


@dataclass(eq=False)
class Resident:
    """A loaded model as ``ps`` shows it."""

    name: str
    digest: str
    model: LoadedModel
    options: LoadOptions
    plan: Plan
    loaded_at: float
    load_duration_ns: int
    keep_alive: float
    expires_at: float  # monotonic deadline; inf = never
    last_used: float = field(default_factory=time.monotonic)
    refs: int = 0  # requests holding or waiting for this model (never evicted while > 0)
    estimate: int = 0  # the planner's memory estimate (bytes) used for residency decisions
    closed: bool = False  # unloaded: no new request gets it (its model closes when the last one ends)
    installed: InstalledModel | None = None  # details for ps
    # the load options a request chose that made this load differ from the default one (``num_thread``, ``num_ctx``,
    # ...): a request that leaves them to the planner gets the default load again, not this one
    chosen: frozenset[str] = frozenset()
    grown_from: int = 0  # the context this load grew from for a long prompt (0: not grown)
    fitting: int = 0  # requests in a row since the last long one that fit ``grown_from``'s context

    def serves(self, options: LoadOptions, *, context: bool = True) -> bool:
        """Whether this load can serve a request that asks for ``options`` (the engine's backend applied: ``None``
        and ``auto`` take what is loaded, unless a request chose that option for this load (``chosen``: it goes
        back to the default), or the context grew for long prompts that have stopped (:attr:`shrinks`);
        ``embedding`` does not matter: every loaded model embeds; ``context=False``: the request uses no context of
        the model's, so the context loaded does not matter either)."""
        want, have = options, self.options
        for f in self.chosen:  # one request's odd load is not everyone's: a plain request gets the default
            if left_to_planner(getattr(want, f)) and (context or f != "num_ctx"):
                return False
        if want.num_ctx is None and context and self.shrinks:
            return False
        if want.num_ctx is not None and want.num_ctx != self.info.n_ctx:
            return False
        for f in ("num_gpu", "kv_cache_type", "num_thread", "num_parallel", "num_cpu_moe"):
            if getattr(want, f) is not None and getattr(want, f) != getattr(have, f):
                return False
        if want.backend != "auto" and want.backend != self.plan.backend:
            return False
        if want.cpu_moe and not have.cpu_moe:
            return False
        if want.draft != "auto" and (want.draft, want.num_draft) != (have.draft, have.num_draft):
            return False
        return True

    @property
    def shrinks(self) -> bool:
        """A context grown for long prompts goes back to the default once they stop: :data:`SHRINK_AFTER` requests
        in a row fit the default context, and nothing runs on it now."""
        return bool(self.grown_from) and self.fitting >= SHRINK_AFTER and self.refs == 0

    def count(self, context_used: int) -> None:
        """A request on this model ended having used ``context_used`` tokens (for :attr:`shrinks`)."""
        if self.grown_from and context_used > 0:
            self.fitting = self.fitting + 1 if context_used <= self.grown_from else 0

    def touch(self, keep_alive: float) -> None:
        """Used now: its keep-alive counts from now."""
        self.keep_alive = keep_alive
        self.last_used = time.monotonic()
        self.expires_at = self.last_used + keep_alive

    @property
    def backend(self) -> str:
        """The inference backend's name (a registered :class:`backends.descriptor.Backend`)."""
        return self.plan.backend

    @property
    def metrics(self) -> LoopMetrics:
        """Slots, KV cells, tokens and drafts of this model's decode loop now."""
        return self.model.metrics()

    @property
    def batched(self) -> bool:
        """Whether its slots decode in one batched pass per step (else they take turns, one pass each)."""
        return self.model.source.can_batch

    @property
    def active(self) -> int:
        """Requests decoding now."""
        return self.model.metrics().slots_busy

    @property
    def info(self) -> ModelInfo:
        return self.model.info

    @property
    def size(self) -> int:
        return self.info.size_bytes or self.estimate

    @property
    def size_vram(self) -> int:
        return self.info.vram_bytes

    @property
    def expires_in(self) -> float:
        """Seconds until keep-alive unloads it (inf = never; while busy, counted from now)."""
        if self.refs > 0:
            return self.keep_alive
        return self.expires_at - time.monotonic()

    @property
    def expires_at_wall(self) -> float | None:
        """Expiry as a Unix time (``None`` = never), for ``ps`` and ``/api/ps``."""
        left = self.expires_in
        return None if left == float("inf") else time.time() + max(0.0, left)


def in_the_way(resident: list[Resident], need: int, budget: int, max_loaded: int) -> list[Resident] | None:
    """None when ``need`` more bytes fit ``budget`` beside the ``resident`` models and their count stays under
    ``max_loaded`` (0 = any count); else the idle models to unload for it, least recently used first, or ``[]``
    when that would not do (busy models are in the way: unloading idle ones would not make room yet). The first
    model always fits (the planner already said whether it does). A model counts by its plan's estimate.

        >>> in_the_way([], 10 * 2**30, 2**30, 0) is None  # nothing loaded: the first model always loads
        True
    """
    used, count = sum(m.estimate or m.size for m in resident), len(resident)

    def fits() -> bool:
        return count == 0 or ((max_loaded <= 0 or count < max_loaded) and used + need <= budget)

    if fits():
        return None
    victims = []
    for m in sorted((m for m in resident if m.refs == 0 and not m.closed), key=lambda m: m.last_used):
        victims.append(m)
        used, count = used - (m.estimate or m.size), count - 1
        if fits():
            return victims
    return []
