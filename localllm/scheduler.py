"""Which models are loaded, the shape of Ollama's ``server/sched.go``: :class:`ModelScheduler` checks a model out for a
request (reusing a loaded one whose options suit it, else preparing and loading it one load at a time, after making
room: idle models unloaded least recently used first, or waiting for busy ones), checks it back in (keep-alive), bounds
the queue and retires expired and unloaded models. :class:`localllm.engine.Engine` is it with the entry points the
faces call (generate, embed, rerank, tokenize, ps, unload, close)."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from localllm.errors import LocalLLMError
from localllm.loader import Loader, LoadOptions, Prepared
from localllm.residency import Resident, ServerBusyError, in_the_way

if TYPE_CHECKING:
    from localllm.store import InstalledModel, Store

class ModelScheduler:
    """Loaded models, their references, memory and queue; :class:`~localllm.engine.Engine` sets the state up in its
    ``__init__`` (every attribute below) and starts the keep-alive thread (:meth:`_reap_loop`). Thread-safe."""

    store: Store
    loader: Loader
    keep_alive: float
    max_loaded: int
    max_queue: int
    memory_budget: int | None  # bytes for all loaded models; None = free RAM (+VRAM) at first load
    _baseline: tuple[int, int] | None  # (free RAM, free VRAM) with nothing loaded
    _models: dict[str, Resident]  # in service, by the store's canonical name
    _leaving: set[Resident]  # unloaded, not closed yet (their memory still counts)
    _aliases: dict[str, str]  # requested name -> loaded key (the store's canonical name)
    _lock: threading.RLock  # guards _models, _leaving, _aliases, refs, _pending
    _idle: threading.Condition  # notified when a model's refs drop or it closes
    _load_lock: threading.Lock  # one load at a time (held while loading, never while waiting)
    _pending: int  # requests waiting for a load or a slot
    _closed: threading.Event

    def _lookup(self, name: str) -> Resident | None:
        with self._lock:
            return self._models.get(self._aliases.get(name, name))

    def _reuse(self, name: str, options: LoadOptions, keep_alive: float, *,
               alias: str | None = None, context: bool = True) -> Resident | None:
        """The model loaded under ``name`` with one more reference, if its options suit ``options`` (``alias``:
        the name the request used, remembered for the next lookup; ``context=False``: a request that uses no
        context of its own, as embeddings, takes whatever context is loaded); else None."""
        with self._lock:
            running = self._lookup(name)
            if running is not None and running.model.closed and not running.closed:
                # its decode loop gave up (an RPC worker died under it): out of service, load it again
                close_now = self._retire(running) and running.refs == 0
                if close_now:
                    self._leaving.discard(running)
                self.loader.refresh_hardware()  # the dead worker's devices leave the device list
                return None
            if running is None or running.closed or not running.serves(self.loader.options(options), context=context):
                return None
            if alias is not None:
                self._aliases[alias] = running.name
            running.refs += 1
            running.touch(keep_alive)
            return running

    def _checkout(self, name: str, options: LoadOptions, keep_alive: float | None,
                  cancel: threading.Event | None, installed: InstalledModel | None = None, *,
                  context: bool = True) -> Resident:
        """The loaded model for ``name`` with one more reference (so nothing evicts it); prepares and loads it
        if needed (:meth:`Loader.prepare`, then memory made for its estimate, one load at a time). ``installed``:
        ``name`` as the caller read it from the store already; ``context=False``: the request uses no context of
        the model's (embeddings), so a loaded one serves it whatever its context. Pair with :meth:`_checkin`.

        Load options a request chose count for that request's load only (:meth:`Loader.chosen`): a later request
        that leaves them to the planner gets the default load again, as Ollama reloads when they differ."""
        ka = self.keep_alive if keep_alive is None else keep_alive
        while True:
            running = self._reuse(name, options, ka, context=context)  # loaded and compatible: no queueing
            if running is not None:
                return running
            prepared = self.loader.prepare(name, options, model=installed)
            running = self._reuse(prepared.name, prepared.options, ka, alias=name, context=context)
            if running is not None:
                return running
            prepared.check_fits()
            _acquire(self._load_lock, cancel)
            try:
                if self._closed.is_set():
                    raise LocalLLMError("localllm is shutting down; no model is loaded any more.")
                with self._lock:
                    running = self._reuse(prepared.name, prepared.options, ka, alias=name,  # loaded meanwhile
                                          context=context)
                    if running is not None:
                        return running
                    old = self._lookup(prepared.name)  # loaded with other options: it closes once its requests end
                    close_old = old is not None and self._retire(old) and old.refs == 0
                if old is not None and close_old:
                    self._close(old)
                if self._make_room(prepared.estimate):
                    return self._load(name, prepared, ka, cancel, self.loader.chosen(prepared, options))
            finally:
                self._load_lock.release()
            self._wait_for_room(prepared.estimate, cancel)  # the models in the way are busy: wait, holding no lock

    def _load(self, name: str, prepared: Prepared, keep_alive: float, cancel: threading.Event | None,
              chosen: frozenset[str] = frozenset()) -> Resident:
        """Load ``prepared`` through the loader and put it in service with one reference (``chosen``: the load
        options a request chose, :meth:`Loader.chosen`). Hold ``_load_lock``."""
        loaded, load_ns, done = self.loader.load_fitting(prepared, cancel)
        model = done.model
        now = time.monotonic()
        running = Resident(
            name=model.name,
            digest=model.model_digest,  # a created model's own, not its base's (ps)
            model=loaded,
            options=done.options,
            plan=done.plan,
            loaded_at=time.time(),
            load_duration_ns=load_ns,
            keep_alive=keep_alive,
            expires_at=now + keep_alive,
            refs=1,
            estimate=prepared.estimate,  # what was budgeted (a fallback's plan takes no more)
            installed=model,
            chosen=chosen,
            grown_from=prepared.options.grown_from,
        )
        with self._lock:
            self._models[model.name] = running
            self._aliases[name] = model.name
        return running

    def _checkin(self, running: Resident, keep_alive: float | None) -> None:
        """Drop a reference; keep-alive starts counting when the last one goes (0 = unload now). The last
        reference of an unloaded model closes it."""
        with self._lock:
            running.refs -= 1
            if keep_alive is not None:
                running.keep_alive = keep_alive
            running.touch(running.keep_alive)
            close_now = running.refs == 0 and (running.closed or running.keep_alive == 0)
            if close_now:
                self._retire(running)
            self._idle.notify_all()
        if close_now:
            self._close(running)

    # ------------------------------------------------------------------ memory

    def _budget(self) -> int:
        """Memory all loaded models may take together: ``memory_budget``, else what was free (RAM +
        GPU memory) before the first model loaded (re-measured whenever nothing is loaded)."""
        if self.memory_budget is not None:
            return self.memory_budget
        with self._lock:
            empty = not self._models and not self._leaving
        if self._baseline is None or empty:
            from localllm.hardware import probe

            hw = probe(refresh=True)
            self.loader.hardware = hw
            # unified memory (Apple Silicon): the GPU's budget is already part of RAM
            vram = 0 if hw.apple_silicon else sum(g.free_bytes for g in hw.nvidia_gpus)
            self._baseline = (hw.ram_available, vram)
        ram, vram = self._baseline
        return int(ram * 0.9) + int(vram * 0.9)

    def _in_the_way(self, need: int, budget: int) -> list[Resident] | None:
        """:func:`~localllm.residency.in_the_way` of the models resident now. Hold ``_lock``."""
        return in_the_way([*self._models.values(), *self._leaving], need, budget, self.max_loaded)

    def _make_room(self, need: int) -> bool:
        """Unload idle models, least recently used first, until ``need`` fits; False (nothing unloaded) when
        busy models are in the way (the caller waits for them with :meth:`_wait_for_room`, outside the load
        lock)."""
        budget = self._budget()
        while True:
            with self._lock:
                victims = self._in_the_way(need, budget)
                if victims is None:
                    return True
                if not victims:
                    return False
                for m in victims:
                    self._retire(m)
            for m in victims:
                self._close(m)

    def _wait_for_room(self, need: int, cancel: threading.Event | None) -> None:
        """Wait until room for ``need`` can be made (a model in the way went idle or closed), holding no lock."""
        budget = self._budget()
        with self._idle:
            while self._in_the_way(need, budget) == [] and not self._closed.is_set():
                if cancel is not None and cancel.is_set():
                    raise LocalLLMError("The request was cancelled while waiting for memory.")
                self._idle.wait(0.1)

    # ------------------------------------------------------------------ queue

    def _enter_queue(self) -> None:
        with self._lock:
            if self.max_queue > 0 and self.pending >= self.max_queue:
                raise ServerBusyError()
            self._pending += 1

    def _leave_queue(self) -> None:
        with self._lock:
            self._pending -= 1

    @property
    def pending(self) -> int:
        """Requests waiting for a load or a slot now."""
        with self._lock:
            return self._pending + sum(m.model.metrics().waiting for m in self._models.values())

    def _unload(self, running: Resident) -> None:
        """Take ``running`` out of service; it closes now if nothing holds it, else when its last request
        ends (:meth:`_checkin`). Returns at once."""
        with self._lock:
            close_now = self._retire(running) and running.refs == 0
        if close_now:
            self._close(running)

    def _retire(self, running: Resident) -> bool:
        """Out of service, into ``_leaving`` (its memory counts until :meth:`_close`). False if it was out
        already. Hold ``_lock``."""
        if running.closed:
            return False
        running.closed = True
        if self._models.get(running.name) is running:
            del self._models[running.name]
            for alias in [a for a, k in self._aliases.items() if k == running.name]:
                del self._aliases[alias]
        self._leaving.add(running)
        return True

    def _close(self, running: Resident) -> None:
        """Close a retired model's decode loop (cancelling what still runs on it) and forget it."""
        try:
            running.model.close()
        finally:
            with self._lock:
                self._leaving.discard(running)
                self._idle.notify_all()  # a load waiting for memory goes on; waiters see ``closed``

    def _reap_loop(self) -> None:
        while not self._closed.wait(0.25):
            now = time.monotonic()
            with self._lock:
                expired = [m for m in self._models.values() if m.refs == 0 and m.expires_at <= now]
                for m in expired:
                    self._retire(m)
            for m in expired:
                self._close(m)


def _acquire(lock: threading.Lock, cancel: threading.Event | None) -> None:
    """Acquire ``lock``, polling ``cancel``: a cancelled wait raises :class:`LocalLLMError`."""
    if cancel is None:
        lock.acquire()
        return
    while not lock.acquire(timeout=0.05):
        if cancel.is_set():
            raise LocalLLMError("The request was cancelled while waiting for another model to load.")


__all__ = ["ModelScheduler"]
