"""The engine owns loaded models: it budgets memory and starts and stops loads (checkout/checkin, keep-alive,
eviction, the queue bound) and cancels requests, the shape of Ollama's ``server/sched.go``. A load is prepared by
the loader (:meth:`localllm.loader.Loader.prepare`: installed model, merged options, plan and estimate), which
then loads what was prepared (spec → weights → decode loop). What it keeps of a loaded model and which idle
models make room are :mod:`localllm.residency`'s; checking models out and in, the memory they take and the queue,
:mod:`localllm.scheduler`'s (:class:`Engine` is its :class:`~localllm.scheduler.ModelScheduler` with the entry points);
a prompt that outgrows the context, :mod:`localllm.growth`'s.
Faces (CLI, server, TUI) talk to the engine and never to a backend. Residency and the entry points that hold
references on it (``generate``, ``agenerate``, ``embed``) share one lock, here. With the default model
installed::

    from localllm.api import GenerateRequest, Sampling, TextChunk
    from localllm.engine import Engine
    with Engine() as engine:
        req = GenerateRequest(messages=[{"role": "user", "content": "Hi"}], sampling=Sampling(seed=1))
        for event in engine.generate("smollm2:135m", req):
            if isinstance(event, TextChunk):
                print(event.text, end="")

Concurrency: each loaded model runs on its own decode loop (:class:`backends.core.loop.LoadedModel`): one
thread owns the model, and up to ``num_parallel`` requests decode together in one batch per step
(continuous batching; ``LOCALLLM_NUM_PARALLEL``, default: 4 slots where the planner's memory estimate
for one KV pool of 4 contexts fits). Only one model loads at a time, but no lock is held while anything
waits for a stream: a load that needs the memory of busy models waits for them outside it, and a model
unloaded while it streams closes when its last request ends. Closing a generator, or setting ``cancel``,
ends that request at the next step and frees its slot and KV cells. Generation and embeddings share one
loaded model (llama.cpp makes its embedding context on the same weights when first asked).

Scheduling (Ollama's, ``server/sched.go``):

* several models stay loaded at once while the planner's memory estimates fit the memory that was
  free when the first one loaded (``memory_budget=`` overrides it); past that, or past
  ``LOCALLLM_MAX_LOADED_MODELS`` (0 = as memory allows), the idle models used least recently are
  unloaded first, as many as make room; while busy models stand in the way nothing is unloaded and the
  load waits for them, holding up no other load (a model being unloaded counts until it has closed);
* each model keeps its keep-alive (``LOCALLLM_KEEP_ALIVE``, 5m; the last request's ``keep_alive``
  wins; 0 = unload as soon as it is idle; negative = forever);
* at most ``LOCALLLM_MAX_QUEUE`` (512) requests wait for a load or a slot; one more raises
  :class:`ServerBusyError` (HTTP 503);
* :meth:`Engine.agenerate` is :meth:`Engine.generate` for asyncio callers: the load runs in a worker thread, the
  events come from the decode loop through the event loop, and it cancels at once when the consumer goes away (a
  client disconnect frees the model).

Lifecycle: :meth:`Engine.close` (or leaving ``with Engine()``) stops the generations still running,
waits for a load in progress, closes every model on its own thread and joins that thread and the
keep-alive thread, so no thread that ran native code is still ending when the interpreter shuts down
(an MLX thread ending during ``Py_FinalizeEx`` aborts the process). An engine still open at exit is
closed by an ``atexit`` hook. A closed engine loads nothing more.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Callable, Generator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from backends.contract.errors import (
    ContextOverflowError,
    InputTooLargeError,
)
from backends.contract.events import Done, Event, Stats
from backends.contract.source import TokenSource
from backends.contract.specs import GenerateRequest
from backends.core.channel import Channel
from backends.core.loop import LoadedModel
from backends.core.pooling import Pooled
from localllm import config
from localllm.errors import PlanError
from localllm.growth import growable, grown
from localllm.loader import Loader, LoadOptions, Prepared
from localllm.residency import DEFAULT_MAX_QUEUE, Resident, parse_keep_alive
from localllm.scheduler import ModelScheduler

if TYPE_CHECKING:
    from localllm.hardware import HardwareInfo
    from localllm.mlxmodels import ConversionProgress
    from localllm.store import InstalledModel, Store

log = logging.getLogger("localllm.engine")


class Engine(ModelScheduler):
    """Loaded models, keep-alive, memory-aware residency, a bounded queue and serialised loads.
    Thread-safe."""

    def __init__(self, store: Store | None = None, *, keep_alive: float | None = None,
                 hardware: HardwareInfo | None = None,
                 max_loaded: int | None = None, max_queue: int | None = None,
                 memory_budget: int | None = None,
                 backend_class: Callable[[str], type[TokenSource]] | None = None,
                 on_convert: Callable[[ConversionProgress], None] | None = None, backend: str | None = None):
        if store is None:
            from localllm.store import Store

            store = Store()
        self.store = store
        self.loader = Loader(store, hardware=hardware, backend=backend, backend_class=backend_class,
                             on_convert=on_convert)
        self.keep_alive = parse_keep_alive(None) if keep_alive is None else keep_alive
        self.max_loaded = config.env_int("LOCALLLM_MAX_LOADED_MODELS", 0) if max_loaded is None else max_loaded
        self.max_queue = config.env_int("LOCALLLM_MAX_QUEUE", DEFAULT_MAX_QUEUE) if max_queue is None else max_queue
        self.memory_budget = memory_budget  # bytes for all loaded models; None = free RAM (+VRAM) at first load
        # one embedding / rerank request's work (0: no cap)
        self.max_embed_inputs = config.env_int("LOCALLLM_MAX_EMBED_INPUTS", DEFAULT_MAX_EMBED_INPUTS)
        self.max_rerank_documents = config.env_int("LOCALLLM_MAX_RERANK_DOCUMENTS", DEFAULT_MAX_RERANK_DOCUMENTS)
        self.max_pooled_tokens = config.env_int("LOCALLLM_MAX_POOLED_TOKENS", DEFAULT_MAX_POOLED_TOKENS)
        self._baseline: tuple[int, int] | None = None  # (free RAM, free VRAM) with nothing loaded
        self.observers: list[Callable[[str, Stats], None]] = []  # called with (model, stats) as each generation ends
        self._models: dict[str, Resident] = {}  # in service, by the store's canonical name
        self._leaving: set[Resident] = set()  # unloaded, not closed yet (their memory still counts)
        self._aliases: dict[str, str] = {}  # requested name -> loaded key (the store's canonical name)
        self._lock = threading.RLock()  # guards _models, _leaving, _aliases, refs, _pending
        self._idle = threading.Condition(self._lock)  # notified when a model's refs drop or it closes
        self._load_lock = threading.Lock()  # one load at a time (held while loading, never while waiting)
        self._pending = 0  # requests waiting for a load or a slot
        self._stops: set[threading.Event] = set()  # the cancel events of running generations
        self._closed = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="localllm-keepalive", daemon=True)
        self._reaper.start()
        _open_engines.add(self)

    # ------------------------------------------------------------------ services

    @property
    def hardware(self) -> HardwareInfo:
        return self.loader.hardware

    @property
    def backend(self) -> str:
        """The backend for requests that leave it to the planner (``Engine(backend=)`` / ``LOCALLLM_BACKEND``)."""
        return self.loader.backend

    @property
    def on_convert(self) -> Callable[[ConversionProgress], None] | None:
        """Receives first-use MLX conversion progress, for the face to show."""
        return self.loader.on_convert

    @on_convert.setter
    def on_convert(self, notify: Callable[[ConversionProgress], None] | None) -> None:
        self.loader.on_convert = notify

    def prepare(self, name: str, options: LoadOptions | None = None) -> Prepared:
        """What loading ``name`` would be (installed model, merged options, plan), nothing loaded: the loader's
        :meth:`~localllm.loader.Loader.prepare`, the one the engine loads from."""
        return self.loader.prepare(name, options)

    # ------------------------------------------------------------------ checkout / checkin

    def load(self, name: str, options: LoadOptions | None = None, *, keep_alive: float | None = None) -> Resident:
        """Load ``name`` (or return it if already loaded with compatible options)."""
        running = self._checkout(name, options or LoadOptions(), keep_alive, None)
        self._checkin(running, keep_alive)
        return running



    # ------------------------------------------------------------------ work

    def _start(self, name: str, request: GenerateRequest, options: LoadOptions, cancel: threading.Event,
               keep_alive: float | None, t_start: int, installed: InstalledModel | None,
               ) -> tuple[Resident, bool, Channel[Event]]:
        """Load (or find) ``name`` and queue ``request`` on its decode loop: (model, was it loaded, events).
        The caller owns one reference on the model (``_checkin`` when the stream ends)."""
        self._enter_queue()
        try:
            while True:
                was_loaded = self._lookup(name) is not None
                running = self._checkout(name, options, keep_alive, cancel, installed)
                if running.closed:  # unloaded between the lookup and now: load again
                    self._checkin(running, keep_alive)
                    continue
                if running.installed is not None and running.installed.derived is not None:
                    from localllm.modelfile import apply_to_request

                    request = apply_to_request(running.installed.derived, request)  # its SYSTEM, MESSAGEs, ...
                return running, was_loaded, running.model.submit(request, cancel, t_start)
        finally:
            self._leave_queue()

    def _finish(self, running: Resident, event: Event, was_loaded: bool, t_start: int) -> None:
        if isinstance(event, Done):
            with self._lock:
                running.count(event.stats.context_used)
            event.stats.load_duration = 0 if was_loaded else running.load_duration_ns
            event.stats.total_duration = time.perf_counter_ns() - t_start
            for observe in self.observers:
                try:
                    observe(running.name, event.stats)
                except Exception:  # noqa: BLE001 - a metrics hook never breaks a stream
                    pass

    def generate(
        self,
        name: str,
        request: GenerateRequest,
        options: LoadOptions | None = None,
        *,
        cancel: threading.Event | None = None,
        keep_alive: float | None = None,
        installed: InstalledModel | None = None,
    ) -> Generator[Event, None, None]:
        """Stream events for ``request`` on ``name`` (loaded on demand). The last event is :class:`Done`;
        its ``stats.load_duration`` includes the load if this call loaded the model. A prompt that does not fit
        the loaded context reloads the model with one that fits when the request leaves the context to the
        planner (:func:`~localllm.growth.grown`). ``installed``: ``name`` as the caller read it from the store
        already (the server does, to answer 404 first): a load does not read it again. A ``cancel`` already set
        ends the stream at once with ``Done(finish_reason="cancelled")``, nothing loaded.

        Raises :class:`ServerBusyError` on the first ``next()`` when the queue is full. Closing the
        generator early cancels the request at the next step. :meth:`_generation` is the request's course,
        this its sync driver (blocking calls made here, events read from the decode loop's channel)."""
        core = self._generation(name, request, options, cancel, keep_alive, installed)
        try:
            step = next(core)
            while True:
                if isinstance(step, _Call | _Read):
                    try:
                        result = step.fn(*step.args) if isinstance(step, _Call) else next(step.items(iter), _END)
                    except BaseException as e:  # noqa: BLE001 - the call's or the producer's error (an overflow),
                        step = core.throw(e)  # into the course, which releases and re-raises
                        continue
                else:
                    yield step
                    result = None
                step = core.send(result)
        except StopIteration:
            return
        finally:
            core.close()

    async def agenerate(
        self,
        name: str,
        request: GenerateRequest,
        options: LoadOptions | None = None,
        *,
        cancel: threading.Event | None = None,
        keep_alive: float | None = None,
        installed: InstalledModel | None = None,
    ) -> AsyncGenerator[Event, None]:
        """:meth:`generate` for asyncio callers, the same course (:meth:`_generation`) with its blocking calls (the
        load, the planner's answer for a larger context) in a worker thread and the events from the model's decode
        loop through the event loop. Leaving the ``async for`` early (or the task being cancelled, as when an HTTP
        client disconnects) cancels the request at the next step and frees its slot; so does setting ``cancel``
        (the stream then ends with ``Done(finish_reason="cancelled")``)::

            async def first_words(engine, req):
                async for ev in engine.agenerate("smollm2:135m", req):
                    if isinstance(ev, TextChunk):
                        return ev.text
        """
        core = self._generation(name, request, options, cancel, keep_alive, installed)
        try:
            step = next(core)
            while True:
                if isinstance(step, _Call):
                    call = asyncio.ensure_future(asyncio.to_thread(step.fn, *step.args))
                    try:
                        result = await asyncio.shield(call)
                    except asyncio.CancelledError as e:  # the caller left: the thread goes on, and what it
                        late = step.late  # returns is handed back once it is done

                        def hand_back(f: asyncio.Future[Any], late: Callable[[Any], None] | None = late) -> None:
                            if late is not None and not f.cancelled() and f.exception() is None:
                                late(f.result())

                        call.add_done_callback(hand_back)
                        step = core.throw(e)
                        continue
                    except BaseException as e:  # noqa: BLE001 - into the course, which releases and re-raises
                        step = core.throw(e)
                        continue
                elif isinstance(step, _Read):
                    try:
                        result = await anext(step.items(aiter), _END)
                    except BaseException as e:  # noqa: BLE001 - the producer's error, or the caller leaving
                        step = core.throw(e)
                        continue
                else:
                    yield step
                    result = None
                step = core.send(result)
        except StopIteration:
            return
        finally:
            core.close()

    def _generation(self, name: str, request: GenerateRequest, options: LoadOptions | None,
                    cancel: threading.Event | None, keep_alive: float | None, installed: InstalledModel | None,
                    ) -> Generator[Event | _Call | _Read, Any, None]:
        """One request's course, written once for both faces: an already set ``cancel`` ends it at once; else the
        model is checked out and the request queued on it (:meth:`_start`), its events pass on, a prompt that
        outgrows the context is retried with what :meth:`_grown` answers, and the model is given back (a request
        left before its end cancelled). It yields the events for the consumer, a :class:`_Call` for each blocking
        call and a :class:`_Read` for each next event of the decode loop's channel, and is sent their results
        (:data:`_END` at the end of the channel) or thrown their errors: :meth:`generate` and :meth:`agenerate`
        drive it, each the way its caller waits."""
        t_start = time.perf_counter_ns()
        cancel = cancel if cancel is not None else threading.Event()
        if cancel.is_set():
            yield Done(Stats(), finish_reason="cancelled")
            return
        self._track(cancel)
        request, options = growable(request, options or LoadOptions())
        try:
            while True:
                try:
                    running, was_loaded, events = yield _Call(
                        self._start, (name, request, options, cancel, keep_alive, t_start, installed),
                        late=lambda started: self._checkin(started[0], keep_alive))
                except asyncio.CancelledError:  # the caller left during the load: the request it queues is
                    cancel.set()  # cancelled (and the model's reference handed back by ``late``)
                    raise
                reader = _Read(events)
                retry = None
                sent = False
                try:
                    while (event := (yield reader)) is not _END:
                        self._finish(running, event, was_loaded, t_start)
                        sent = True
                        yield event
                except ContextOverflowError as e:
                    retry = None if sent else (yield _Call(self._grown, (running, request, options, e)))
                    if retry is None:
                        raise
                finally:
                    if retry is None:
                        self._release(running, events, cancel, keep_alive)
                    else:  # the request ended with the error (nothing to cancel): only the reference goes back
                        self._checkin(running, keep_alive)
                if retry is None:
                    return
                request, options = retry
        finally:
            self._untrack(cancel)

    def _grown(self, running: Resident, request: GenerateRequest, options: LoadOptions,
               e: ContextOverflowError) -> tuple[GenerateRequest, LoadOptions] | None:
        """:func:`~localllm.growth.grown`, asking the loader whether each larger context fits."""
        def fits(want: int) -> bool:  # memory holds it, and no layer leaves the GPU for it
            try:
                p = self.loader.prepare(running.name, replace(options, num_ctx=want)).plan
            except PlanError:  # "a N-token context does not fit": not grown (the overflow's 400 says why)
                return False
            return p.fits and p.n_gpu_layers >= running.plan.n_gpu_layers

        return grown(running, request, options, e, fits)

    def _release(self, running: Resident, events: Channel[Event], cancel: threading.Event,
                 keep_alive: float | None) -> None:
        """A stream's consumer is done: a request it left before its end is cancelled, the reference returned."""
        if not events.closed:
            cancel.set()
        self._checkin(running, keep_alive)

    def _track(self, cancel: threading.Event) -> None:
        with self._lock:
            self._stops.add(cancel)
            if self._closed.is_set():
                cancel.set()

    def _untrack(self, cancel: threading.Event) -> None:
        with self._lock:
            self._stops.discard(cancel)

    def embed(self, name: str, texts: list[str], options: LoadOptions | None = None,
              *, keep_alive: float | None = None) -> list[list[float]]:
        """One vector per text. A model already loaded for generation serves it as it is; a model loaded here
        makes its embedding context at load (and serves generation too)."""
        return self.embed_many(name, texts, options, keep_alive=keep_alive).vectors

    def embed_many(self, name: str, texts: list[str], options: LoadOptions | None = None, *,
                   keep_alive: float | None = None, truncate: bool = True,
                   cancel: threading.Event | None = None) -> Pooled:
        """Embeddings of ``texts`` with the tokens they took and which were cut to fit (``truncate=False``: an
        input over the context raises instead), evaluated in batches beside the model's chat requests. At most
        ``max_embed_inputs`` texts and ``max_pooled_tokens`` tokens (:class:`InputTooLargeError`, before anything is
        evaluated); ``cancel`` stops the work between two batches (:class:`RequestCancelled`)."""
        _cap(len(texts), self.max_embed_inputs, "An embedding request", "inputs", "LOCALLLM_MAX_EMBED_INPUTS")
        return self._pooled(name, options, keep_alive, lambda m: m.embed_many(
            texts, truncate=truncate, cancel=cancel, max_tokens=self.max_pooled_tokens))

    def rerank(self, name: str, query: str, documents: list[str], options: LoadOptions | None = None, *,
               keep_alive: float | None = None, truncate: bool = True,
               cancel: threading.Event | None = None) -> Pooled:
        """Relevance scores of ``documents`` to ``query`` (a model with a rank head), in document order; at most
        ``max_rerank_documents`` documents and ``max_pooled_tokens`` tokens, ``cancel``: as :meth:`embed_many`'s."""
        _cap(len(documents), self.max_rerank_documents, "A rerank", "documents", "LOCALLLM_MAX_RERANK_DOCUMENTS")
        return self._pooled(name, options, keep_alive, lambda m: m.rerank(
            query, documents, truncate=truncate, cancel=cancel, max_tokens=self.max_pooled_tokens))

    def _pooled(self, name: str, options: LoadOptions | None, keep_alive: float | None,
                fn: Callable[[LoadedModel], Pooled]) -> Pooled:
        options = replace(options or LoadOptions(), embedding=True)
        self._enter_queue()
        queued = True
        try:
            running = self._checkout(name, options, keep_alive, None, context=False)
            self._leave_queue()
            queued = False
            try:
                return fn(running.model)
            finally:
                self._checkin(running, keep_alive)
        finally:
            if queued:
                self._leave_queue()

    def tokenize(self, name: str, text: str, images: list[bytes] | None = None) -> list[int]:
        """``text``'s token ids; with ``images`` (a vision model), those first, as placeholder ids of the positions
        each takes (what a request with them counts in its prompt)."""
        running = self._checkout(name, LoadOptions(), None, None, context=False)
        try:
            if images:
                from backends.contract.media import IMAGE_MARKER

                marked = IMAGE_MARKER * len(images) + ("\n" + text if text else "")
                return running.model.tokenize(marked, images=list(images))
            return running.model.tokenize(text)
        finally:
            self._checkin(running, None)

    # ------------------------------------------------------------------ lifecycle

    def ps(self) -> list[Resident]:
        """Loaded models, the one that expires last first (as ``/api/ps``)."""
        with self._lock:
            return sorted(self._models.values(), key=lambda m: -m.expires_in)

    def is_loaded(self, name: str) -> bool:
        running = self._lookup(name)
        return running is not None and not running.closed

    def unload(self, name: str) -> bool:
        """Unload ``name``: no new request gets it, and it closes once its running generations finish (this
        call waits for that, holding no lock: other models load meanwhile). True if it was loaded."""
        with self._lock:
            running = self._lookup(name)
            if running is None:
                running = next((m for m in self._models.values() if m.name == name), None)
            if running is None:
                return False
        self._unload(running)
        with self._idle:
            while running in self._leaving:
                self._idle.wait(0.1)
        return True

    def cancel_all(self) -> None:
        """Stop every running generation at its next step (each ends with ``finish_reason="cancelled"``);
        returns at once (a server's shutdown calls it from its event loop). Loading stays possible."""
        with self._lock:
            for stop in self._stops:
                stop.set()

    def close(self, timeout: float | None = None) -> None:
        """Stop running generations (at their next step), wait for a load in progress, close every model
        on its thread and join that thread and the keep-alive thread. Idempotent; a closed engine loads
        nothing more. Faces call it before exit (``with Engine()``, ``finally``); an ``atexit`` hook closes
        what they did not. ``timeout``: seconds to wait at most for a load that does not stop."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._closed.set()
            for stop in self._stops:
                stop.set()
        self.loader.stop()
        _open_engines.discard(self)
        # a load in progress finishes (a conversion stops) before the models close
        locked = self._load_lock.acquire(timeout=-1 if timeout is None else timeout)
        try:
            with self._lock:
                for m in list(self._models.values()):
                    self._retire(m)
                models = list(self._leaving)
            for m in models:  # held ones too: their requests were cancelled above
                self._close(m)
        finally:
            if locked:
                self._load_lock.release()
        if threading.current_thread() is not self._reaper:
            self._reaper.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Call:
    """A blocking call :meth:`Engine._generation` asks its driver to make (in the caller's thread, or a worker
    thread for asyncio callers) and to send back the result of; ``late``: what to do with that result if the caller
    left while it ran (a thread cannot be stopped: what the load checked out is handed back then)."""

    __slots__ = ("args", "fn", "late")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...],
                 late: Callable[[Any], None] | None = None) -> None:
        self.fn, self.args, self.late = fn, args, late


class _Read:
    """:meth:`Engine._generation` asks its driver for the next event of ``events`` (iterated with ``start``,
    ``iter`` or ``aiter``, once), to be sent :data:`_END` when the stream ends."""

    __slots__ = ("_items", "events")

    def __init__(self, events: Channel[Event]) -> None:
        self.events = events
        self._items: Any = None

    def items(self, start: Callable[[Channel[Event]], Any]) -> Any:
        if self._items is None:
            self._items = start(self.events)
        return self._items


_END = object()  # sent for a _Read when the decode loop's stream has ended


DEFAULT_MAX_EMBED_INPUTS = 2048  # inputs one embedding request takes (OpenAI's limit)
DEFAULT_MAX_RERANK_DOCUMENTS = 1000  # documents one rerank takes (Cohere's and Voyage's)
DEFAULT_MAX_POOLED_TOKENS = 300_000  # tokens one embedding / rerank request evaluates (OpenAI's per request)


def _cap(count: int, limit: int, what: str, items: str, setting: str) -> None:
    """:class:`InputTooLargeError` when ``count`` ``items`` are over ``limit`` (0: no cap).

    >>> try:
    ...     _cap(3, 2, "A rerank", "documents", "LOCALLLM_MAX_RERANK_DOCUMENTS")
    ... except InputTooLargeError as e:
    ...     print(e)
    A rerank takes at most 2 documents (LOCALLLM_MAX_RERANK_DOCUMENTS), not 3; send them in smaller requests.
    """
    if limit > 0 and count > limit:
        raise InputTooLargeError(f"{what} takes at most {limit:,} {items} ({setting}), not {count:,}; send them in "
                                 "smaller requests.", tokens=0, limit=limit)


_open_engines: weakref.WeakSet[Engine] = weakref.WeakSet()
EXIT_TIMEOUT = 15.0  # seconds the exit hook waits for an engine's work that does not stop


@atexit.register
def _close_open_engines() -> None:
    """At interpreter exit, close the engines nobody closed: their model threads must end (and free what
    the backends keep per thread) while Python can still run them."""
    for engine in list(_open_engines):
        engine.close(timeout=EXIT_TIMEOUT)
