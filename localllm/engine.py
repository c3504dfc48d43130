"""The engine owns loaded models: load on demand through the planner, keep-alive, serialised access,
cancellation. Faces (CLI, server, TUI) talk to it and never to a backend.

    >>> from localllm.engine import Engine, GenerateRequest, Sampling, TextChunk
    >>> with Engine() as engine:
    ...     req = GenerateRequest(messages=[{"role": "user", "content": "Hi"}], sampling=Sampling(seed=1))
    ...     for event in engine.generate("smollm2:135m", req):
    ...         if isinstance(event, TextChunk):
    ...             print(event.text, end="")

Concurrency: each loaded model runs on its own decode loop (:class:`backends.loop.LoadedModel`): one
thread owns the model, and up to ``num_parallel`` requests decode together in one batch per step
(continuous batching; ``LOCALLLM_NUM_PARALLEL``, default: 4 slots where the planner's memory estimate
for one KV pool of 4 contexts fits). Only one model loads at a time. Closing a generator, or setting
``cancel``, ends that request at the next step and frees its slot and KV cells.

Scheduling (Ollama's, ``server/sched.go``):

* several models stay loaded at once while the planner's memory estimates fit the memory that was
  free when the first one loaded (``memory_budget=`` overrides it); past that, or past
  ``LOCALLLM_MAX_LOADED_MODELS`` (0 = as memory allows), the idle model used least recently is
  unloaded first; if every model is busy the load waits for one to go idle;
* each model keeps its keep-alive (``LOCALLLM_KEEP_ALIVE``, 5m; the last request's ``keep_alive``
  wins; 0 = unload as soon as it is idle; negative = forever);
* at most ``LOCALLLM_MAX_QUEUE`` (512) requests wait for a load or a slot; one more raises
  :class:`ServerBusyError` (HTTP 503);
* :meth:`Engine.agenerate` runs :meth:`Engine.generate` in a worker thread for asyncio callers and
  cancels it at once when the consumer goes away (a client disconnect frees the model).

Lifecycle: :meth:`Engine.close` (or leaving ``with Engine()``) stops the generations still running,
waits for a load in progress, closes every model on its own thread and joins that thread and the
keep-alive thread, so no thread that ran native code is still ending when the interpreter shuts down
(an MLX thread ending during ``Py_FinalizeEx`` aborts the process). An engine still open at exit is
closed by an ``atexit`` hook. A closed engine loads nothing more.

``--backend mlx`` on a model with no MLX weights converts its GGUF on first use (once, offline; see
:mod:`localllm.mlxmodels`), on the model's decode thread before it loads; ``Engine(on_convert=...)``
receives the :class:`~localllm.mlxmodels.ConversionProgress` events a face shows.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Callable, Generator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

# The request/event types faces use: re-exported so no face imports ``backends``.
from backends.base import (  # noqa: F401
    KV_CACHE_TYPES,
    BackendError,
    ContextOverflowError,
    Done,
    DraftSpec,
    Event,
    GenerateRequest,
    LoadSpec,
    ModelInfo,
    ModelLoadError,
    Sampling,
    Stats,
    TextChunk,
    TokenLogprob,
    TokenSource,
    ToolCalls,
    UnsupportedError,
)
from backends.channel import Channel
from backends.loop import LoadedModel, LoopMetrics
from backends.prompt_cache import PromptCacheSpec
from backends.registry import source_class
from localllm import config
from localllm.errors import LocalLLMError, ModelNotFoundError

if TYPE_CHECKING:
    from localllm.hardware import HardwareInfo
    from localllm.mlxmodels import ConversionProgress
    from localllm.planner import Plan
    from localllm.store import InstalledModel, Store

DEFAULT_KEEP_ALIVE = 300.0  # seconds (Ollama: 5m)
MIN_CTX = 256  # llama.cpp pads contexts to 256 tokens; below that a chat template alone may not fit
DEFAULT_MAX_QUEUE = 512
BUSY_MESSAGE = "server busy, please try again.  maximum pending requests exceeded"


class ServerBusyError(LocalLLMError):
    """More requests are waiting than ``LOCALLLM_MAX_QUEUE`` allows (HTTP 503)."""

    def __init__(self, message: str = BUSY_MESSAGE):
        super().__init__(message)


def parse_keep_alive(value: Any, default: float | None = None) -> float:
    """Ollama's keep_alive: ``"5m"``, ``"1h30m"``, ``"10s"``, a number of seconds, negative = forever (inf).

    >>> parse_keep_alive("5m"), parse_keep_alive(0), parse_keep_alive(-1)
    (300.0, 0.0, inf)
    """
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


def _env_parallel() -> int | None:
    """``LOCALLLM_NUM_PARALLEL`` (slots per model); unset or 0 = let the planner decide."""
    n = config.env_int("LOCALLLM_NUM_PARALLEL", 0)
    return n if n > 0 else None


@dataclass(frozen=True)
class LoadOptions:
    """How to load a model. ``None`` means "let the planner decide"."""

    num_ctx: int | None = None
    num_gpu: int | None = None  # layers to offload; None = planner, 0 = CPU
    kv_cache_type: str | None = None  # f16 | q8_0 | q4_0; None = LOCALLLM_KV_CACHE_TYPE
    backend: str = "auto"  # auto | llamacpp | mlx
    draft: str = "auto"  # auto (catalog pairing if installed) | none | ngram | NAME | PATH
    num_draft: int = 4
    num_thread: int | None = None
    embedding: bool = False
    num_parallel: int | None = None  # slots; None = LOCALLLM_NUM_PARALLEL, else the planner (4 where it fits)


@dataclass
class RunningModel:
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
    closed: bool = False
    installed: InstalledModel | None = None  # details for ps

    @property
    def backend(self) -> str:
        """The inference backend's name (``llamacpp``, ``mlx``)."""
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

    @property
    def stopping(self) -> bool:
        """Asked to unload (keep-alive 0 or expired) while a request still holds it."""
        return self.refs > 0 and self.keep_alive == 0


class Engine:
    """Loaded models, keep-alive, memory-aware residency, a bounded queue and serialised access.
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
        self._hardware = hardware
        self.keep_alive = parse_keep_alive(None) if keep_alive is None else keep_alive
        self.max_loaded = config.env_int("LOCALLLM_MAX_LOADED_MODELS", 0) if max_loaded is None else max_loaded
        self.max_queue = config.env_int("LOCALLLM_MAX_QUEUE", DEFAULT_MAX_QUEUE) if max_queue is None else max_queue
        self._backend_class = backend_class or source_class  # backend name -> TokenSource class (tests swap it)
        self.memory_budget = memory_budget  # bytes for all loaded models; None = free RAM (+VRAM) at first load
        self._baseline: tuple[int, int] | None = None  # (free RAM, free VRAM) with nothing loaded
        self.observers: list[Callable[[str, Stats], None]] = []  # called with (model, stats) as each generation ends
        self._models: dict[str, RunningModel] = {}
        self._aliases: dict[str, str] = {}  # requested name -> loaded key (the store's canonical name)
        self._lock = threading.RLock()  # guards _models, refs, _pending
        self._idle = threading.Condition(self._lock)  # notified when a model's refs drop or it unloads
        self._load_lock = threading.Lock()  # one load at a time
        self._pending = 0  # requests waiting for a load or a slot
        self.on_convert = on_convert  # first-use MLX conversion progress, for the face to show
        # the backend for requests that leave it to the planner (``LoadOptions.backend == "auto"``)
        self.backend = (backend or config.env_str("LOCALLLM_BACKEND", "auto")).lower()
        if self.backend not in ("auto", "llamacpp", "mlx"):
            raise LocalLLMError(f"LOCALLLM_BACKEND must be auto, llamacpp or mlx, got {self.backend!r}.")
        self._stops: set[threading.Event] = set()  # the cancel events of running generations
        self._closed = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="localllm-keepalive", daemon=True)
        self._reaper.start()
        _open_engines.add(self)

    # ------------------------------------------------------------------ services

    @property
    def hardware(self) -> HardwareInfo:
        if self._hardware is None:
            from localllm.hardware import probe

            self._hardware = probe()
        return self._hardware

    def plan_for(self, name: str, options: LoadOptions | None = None) -> tuple[InstalledModel, Plan]:
        """(installed model, plan) without loading anything."""
        from localllm.ggufinfo import GGUFInfo
        from localllm.mlxmodels import mlx_for_plan
        from localllm.planner import plan

        options = self._default_backend(options or LoadOptions())
        if options.num_ctx is not None and options.num_ctx < MIN_CTX:
            raise LocalLLMError(f"num_ctx must be at least {MIN_CTX} tokens, got {options.num_ctx}.")
        model = self.store.get(name)
        info = GGUFInfo(**model.info)
        kv = options.kv_cache_type or config.kv_cache_type()
        p = plan(
            info,
            self.hardware,
            num_ctx=options.num_ctx,
            kv_cache_type=kv,
            backend=options.backend,
            num_gpu=options.num_gpu,
            mlx_model=model.mlx_path is not None,
            # MLX weights installed / the GGUF converts on first use (Plan.mlx_convert) / why not
            mlx=mlx_for_plan(model, self.hardware, options.backend),
            num_parallel=options.num_parallel or _env_parallel(),
        )
        return model, p

    def _default_backend(self, options: LoadOptions) -> LoadOptions:
        """``options`` with the engine's backend (``Engine(backend=)`` / ``LOCALLLM_BACKEND``) where it says auto."""
        if options.backend == "auto" and self.backend != "auto":
            return replace(options, backend=self.backend)
        return options

    def _convert(self, model: InstalledModel, cancel: threading.Event | None, dtype: str) -> None:
        """Build the MLX weights of ``model`` from its GGUF (first use of ``--backend mlx``), record them in
        the store and set ``model.mlx_path``. Runs on the model's decode thread before it loads; reports to
        ``on_convert``; ``cancel`` or closing the engine stops it at the next progress report (nothing
        half-written is kept)."""
        from localllm.mlxmodels import ConversionProgress, convert_installed

        notify = self.on_convert
        t0 = time.monotonic()

        def progress(done: int, total: int) -> None:
            if self._closed.is_set():
                raise LocalLLMError(f"The conversion of {model.name} to MLX was stopped: localllm is shutting down.")
            if cancel is not None and cancel.is_set():
                raise LocalLLMError(f"The conversion of {model.name} to MLX was cancelled.")
            if notify is not None:
                notify(ConversionProgress(model.name, "progress", done, total, time.monotonic() - t0))

        if notify is not None:
            notify(ConversionProgress(model.name, "start"))
        try:
            path = convert_installed(model, dtype=dtype, progress=progress)
        except BaseException as e:
            if notify is not None:
                notify(ConversionProgress(model.name, "failed", seconds=time.monotonic() - t0, error=str(e)))
            raise
        if not model.local:  # a local .gguf path has no manifest: its MLX dir is found by digest
            self.store.set_mlx_path(model.name, path)
        model.mlx_path = path
        if notify is not None:
            notify(ConversionProgress(model.name, "done", seconds=time.monotonic() - t0))

    def _prompt_cache_spec(self, model: InstalledModel, backend: str) -> PromptCacheSpec | None:
        """Where this model's saved prompt prefixes live (``LOCALLLM_PROMPT_CACHE_SIZE``; 0 = none)."""
        size = config.prompt_cache_size()
        if size <= 0 or not model.digest:
            return None
        root = config.paths().prompt_cache
        return PromptCacheSpec(str(root / model.digest.removeprefix("sha256:")), f"{model.digest} {backend}",
                               max_bytes=size, budget_root=str(root))

    def _draft_spec(self, model: InstalledModel, options: LoadOptions, backend: str) -> DraftSpec | None:
        choice = (options.draft or "auto").strip()
        if choice == "none":
            return None
        if choice == "ngram":
            return DraftSpec(kind="ngram", num_draft=options.num_draft)
        if choice == "auto":
            draft_name = model.catalog.draft if model.catalog is not None else None
            if not draft_name:
                return None
            try:
                draft = self.store.get(draft_name)
            except ModelNotFoundError:
                return None  # suggested draft not installed: plain decoding
        else:
            draft = self.store.get(choice)
        path = draft.mlx_path if backend == "mlx" else draft.path
        if path is None and choice == "auto":
            return None  # the suggested draft has no build for this backend: plain decoding
        if path is None:
            raise LocalLLMError(f"Draft model {draft.name} has no {backend} weights installed.")
        return DraftSpec(kind="model", path=str(path), num_draft=options.num_draft)

    # ------------------------------------------------------------------ loading

    def load(self, name: str, options: LoadOptions | None = None, *, keep_alive: float | None = None) -> RunningModel:
        """Load ``name`` (or return it if already loaded with compatible options)."""
        running = self._checkout(name, options or LoadOptions(), keep_alive, None)
        self._checkin(running, keep_alive)
        return running

    def _lookup(self, name: str) -> RunningModel | None:
        with self._lock:
            return self._models.get(self._aliases.get(name, name))

    def _checkout(self, name: str, options: LoadOptions, keep_alive: float | None,
                  cancel: threading.Event | None) -> RunningModel:
        """The loaded model for ``name`` with one more reference (so nothing evicts it); loads it if
        needed, one load at a time. Pair with :meth:`_checkin`."""
        ka = self.keep_alive if keep_alive is None else keep_alive
        options = self._default_backend(options)
        with self._lock:  # fast path: loaded and compatible, no need to queue behind a load
            running = self._lookup(name)
            if running is not None and not running.closed and self._compatible(running, options):
                running.refs += 1
                self._touch(running, ka)
                return running
        _acquire(self._load_lock, cancel)
        try:
            if self._closed.is_set():
                raise LocalLLMError("localllm is shutting down; no model is loaded any more.")
            with self._lock:
                running = self._lookup(name)
                if running is not None and not running.closed and self._compatible(running, options):
                    running.refs += 1
                    self._touch(running, ka)
                    return running
            model, p = self.plan_for(name, options)
            with self._lock:
                key = model.name
                running = self._models.get(key)
                if running is not None and not running.closed and self._compatible(running, options):
                    self._aliases[name] = key
                    running.refs += 1
                    self._touch(running, ka)
                    return running
            if running is not None:  # reload with other options once it is idle
                self._unload_key(key)
            if p.verdict == "too_big":
                from localllm.errors import PlanError

                why = next((r for r in p.reasons if r.startswith("does not fit")), None)
                if why:
                    raise PlanError(why.removeprefix("does not fit: ").rstrip(".") + "; it does not fit this machine.")
                raise PlanError(f"{model.name} does not fit this machine: {'; '.join(p.reasons)}")
            need = self._estimate(p)
            self._make_room(need, cancel)
            path = model.mlx_path if p.backend == "mlx" else model.path
            before_load = None
            if p.mlx_convert:  # on the thread that will run it (MLX keeps per-thread state)
                from localllm.planner import mlx_dtype

                def before_load() -> None:
                    self._convert(model, cancel, mlx_dtype(p.device))
                    spec.model_path = str(model.mlx_path)

            spec = LoadSpec(
                model_path=str(path),
                n_ctx=p.n_ctx,
                n_seq=p.n_seq,
                n_gpu_layers=p.n_gpu_layers,
                n_threads=options.num_thread or p.n_threads,
                kv_cache_type=p.kv_cache_type,  # type: ignore[arg-type]
                flash_attn=None if p.kv_cache_type == "f16" else True,  # llama.cpp decides (auto)
                draft=self._draft_spec(model, options, p.backend),
                embedding=options.embedding,
                verbose=os.environ.get("LOCALLLM_DEBUG", "") not in ("", "0"),
                extra={"head_dims": (model.info.get("head_dim_k", 0), model.info.get("head_dim_v", 0))},
            )
            cls = self._backend_class(p.backend)
            t0 = time.perf_counter_ns()
            loaded = LoadedModel(cls, spec, name=model.name, prompt_cache=self._prompt_cache_spec(model, p.backend),
                                 before_load=before_load)
            load_ns = time.perf_counter_ns() - t0
            now = time.monotonic()
            running = RunningModel(
                name=model.name,
                digest=model.digest,
                model=loaded,
                options=options,
                plan=p,
                loaded_at=time.time(),
                load_duration_ns=load_ns,
                keep_alive=ka,
                expires_at=now + ka,
                refs=1,
                estimate=need,
                installed=model,
            )
            with self._lock:
                self._models[key] = running
                self._aliases[name] = key
            return running
        finally:
            self._load_lock.release()

    def _checkin(self, running: RunningModel, keep_alive: float | None) -> None:
        """Drop a reference; keep-alive starts counting when the last one goes (0 = unload now)."""
        with self._lock:
            running.refs -= 1
            if keep_alive is not None:
                running.keep_alive = keep_alive
            self._touch(running, running.keep_alive)
            unload_now = running.refs == 0 and running.keep_alive == 0 and not running.closed
            self._idle.notify_all()
        if unload_now:
            self._unload_key(running.name, only=running)

    @staticmethod
    def _estimate(p: Plan) -> int:
        """Bytes the planner expects this load to take (weights + KV + compute + overhead, draft included),
        RAM and VRAM together: ``Plan.memory.total``."""
        return int(p.memory.total)

    def _budget(self) -> int:
        """Memory all loaded models may take together: ``memory_budget``, else what was free (RAM +
        GPU memory) before the first model loaded (re-measured whenever nothing is loaded)."""
        if self.memory_budget is not None:
            return self.memory_budget
        with self._lock:
            empty = not self._models
        if self._baseline is None or empty:
            from localllm.hardware import probe

            hw = probe(refresh=True)
            self._hardware = hw
            # unified memory (Apple Silicon): the GPU's budget is already part of RAM
            vram = 0 if hw.apple_silicon else sum(g.free_bytes for g in hw.nvidia_gpus)
            self._baseline = (hw.ram_available, vram)
        ram, vram = self._baseline
        return int(ram * 0.9) + int(vram * 0.9)

    def _make_room(self, need: int, cancel: threading.Event | None) -> None:
        """Unload idle models, least recently used first, until ``need`` fits the budget and the
        count is under ``max_loaded``. Waits while every loaded model is busy. The first model
        always loads (the planner already said whether it fits)."""
        budget = self._budget()
        with self._lock:
            while True:
                live = [m for m in self._models.values() if not m.closed]
                used = sum(m.estimate or m.size for m in live)
                too_many = self.max_loaded > 0 and len(live) >= self.max_loaded
                too_big = bool(live) and used + need > budget
                if not live or not (too_many or too_big):
                    return
                idle = sorted((m for m in live if m.refs == 0), key=lambda m: m.last_used)
                if idle:
                    victim = idle[0]
                    self._lock.release()
                    try:
                        self._unload_key(victim.name, only=victim)
                    finally:
                        self._lock.acquire()
                    continue
                if cancel is not None and cancel.is_set():
                    raise LocalLLMError("The request was cancelled while waiting for memory.")
                self._idle.wait(0.1)

    @staticmethod
    def _compatible(running: RunningModel, options: LoadOptions) -> bool:
        want, have = options, running.options
        if want.embedding and not have.embedding:
            return False
        if want.num_ctx is not None and want.num_ctx != running.info.n_ctx:
            return False
        for f in ("num_gpu", "kv_cache_type", "num_thread", "num_parallel"):
            if getattr(want, f) is not None and getattr(want, f) != getattr(have, f):
                return False
        if want.backend != "auto" and want.backend != running.plan.backend:
            return False
        if want.draft != "auto" and (want.draft, want.num_draft) != (have.draft, have.num_draft):
            return False
        return True

    def _touch(self, running: RunningModel, keep_alive: float) -> None:
        running.keep_alive = keep_alive
        running.last_used = time.monotonic()
        running.expires_at = running.last_used + keep_alive

    # ------------------------------------------------------------------ queue

    def _enter_queue(self) -> None:
        with self._lock:
            waiting = self._pending + sum(m.model.metrics().waiting for m in self._models.values() if not m.closed)
            if self.max_queue > 0 and waiting >= self.max_queue:
                raise ServerBusyError()
            self._pending += 1

    def _leave_queue(self) -> None:
        with self._lock:
            self._pending -= 1

    @property
    def pending(self) -> int:
        """Requests waiting for a load or a slot now."""
        with self._lock:
            return self._pending + sum(m.model.metrics().waiting for m in self._models.values() if not m.closed)

    # ------------------------------------------------------------------ work

    def _start(self, name: str, request: GenerateRequest, options: LoadOptions, cancel: threading.Event,
               keep_alive: float | None, t_start: int) -> tuple[RunningModel, bool, Channel[Event]]:
        """Load (or find) ``name`` and queue ``request`` on its decode loop: (model, was it loaded, events).
        The caller owns one reference on the model (``_checkin`` when the stream ends)."""
        self._enter_queue()
        try:
            while True:
                was_loaded = self._lookup(name) is not None
                running = self._checkout(name, options, keep_alive, cancel)
                if running.closed:  # unloaded between the lookup and now: load again
                    self._checkin(running, keep_alive)
                    continue
                return running, was_loaded, running.model.submit(request, cancel, t_start)
        finally:
            self._leave_queue()

    def _finish(self, running: RunningModel, event: Event, was_loaded: bool, t_start: int) -> None:
        if isinstance(event, Done):
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
    ) -> Generator[Event, None, None]:
        """Stream events for ``request`` on ``name`` (loaded on demand). The last event is :class:`Done`;
        its ``stats.load_duration`` includes the load if this call loaded the model.

        Raises :class:`ServerBusyError` on the first ``next()`` when the queue is full. Closing the
        generator early cancels the request at the next step."""
        t_start = time.perf_counter_ns()
        cancel = cancel if cancel is not None else threading.Event()
        if cancel.is_set():
            yield Done(Stats(), finish_reason="cancelled")
            return
        self._track(cancel)
        try:
            running, was_loaded, events = self._start(name, request, options or LoadOptions(), cancel,
                                                      keep_alive, t_start)
            try:
                for event in events:
                    self._finish(running, event, was_loaded, t_start)
                    yield event
            finally:
                if not events.closed:
                    cancel.set()
                self._checkin(running, keep_alive)
        finally:
            self._untrack(cancel)

    def _track(self, cancel: threading.Event) -> None:
        with self._lock:
            self._stops.add(cancel)
            if self._closed.is_set():
                cancel.set()

    def _untrack(self, cancel: threading.Event) -> None:
        with self._lock:
            self._stops.discard(cancel)

    async def agenerate(
        self,
        name: str,
        request: GenerateRequest,
        options: LoadOptions | None = None,
        *,
        cancel: threading.Event | None = None,
        keep_alive: float | None = None,
    ) -> AsyncGenerator[Event, None]:
        """:meth:`generate` for asyncio callers: the load runs in a worker thread, the events arrive
        from the model's decode loop through the event loop. Leaving the ``async for`` early (or the
        task being cancelled, as when an HTTP client disconnects) cancels the request at the next step
        and frees its slot; so does setting ``cancel`` (the stream then ends with
        ``Done(finish_reason="cancelled")``).

            >>> async def first_words(engine, req):  # doctest: +SKIP
            ...     async for ev in engine.agenerate("smollm2:135m", req):
            ...         if isinstance(ev, TextChunk):
            ...             return ev.text
        """
        t_start = time.perf_counter_ns()
        cancel = cancel if cancel is not None else threading.Event()
        self._track(cancel)
        try:
            started = asyncio.ensure_future(asyncio.to_thread(
                self._start, name, request, options or LoadOptions(), cancel, keep_alive, t_start))
            try:
                running, was_loaded, events = await asyncio.shield(started)
            except asyncio.CancelledError:  # the caller left during the load: the thread goes on, its
                cancel.set()  # request is cancelled, and the model's reference is returned once it is done

                def release(f: asyncio.Future[tuple[RunningModel, bool, Channel[Event]]]) -> None:
                    if not f.cancelled() and f.exception() is None:
                        self._checkin(f.result()[0], keep_alive)

                started.add_done_callback(release)
                raise
            try:
                async for event in events:
                    self._finish(running, event, was_loaded, t_start)
                    yield event
            finally:
                if not events.closed:
                    cancel.set()
                self._checkin(running, keep_alive)
        finally:
            self._untrack(cancel)

    def embed(self, name: str, texts: list[str], options: LoadOptions | None = None,
              *, keep_alive: float | None = None) -> list[list[float]]:
        options = replace(options or LoadOptions(), embedding=True)
        self._enter_queue()
        queued = True
        try:
            running = self._checkout(name, options, keep_alive, None)
            self._leave_queue()
            queued = False
            try:
                return running.model.embed(texts)
            finally:
                self._checkin(running, keep_alive)
        finally:
            if queued:
                self._leave_queue()

    def tokenize(self, name: str, text: str) -> list[int]:
        running = self._checkout(name, LoadOptions(), None, None)
        try:
            return running.model.tokenize(text)
        finally:
            self._checkin(running, None)

    # ------------------------------------------------------------------ lifecycle

    def ps(self) -> list[RunningModel]:
        """Loaded models, the one that expires last first (as ``/api/ps``)."""
        with self._lock:
            return sorted((m for m in self._models.values() if not m.closed), key=lambda m: -m.expires_in)

    def is_loaded(self, name: str) -> bool:
        running = self._lookup(name)
        return running is not None and not running.closed

    def unload(self, name: str) -> bool:
        """Unload ``name`` once its running generations finish. True if it was loaded."""
        with self._lock:
            key = self._aliases.get(name, name)
            if key not in self._models:
                for k, m in self._models.items():  # a name the store resolves differently
                    if m.name == name:
                        key = k
        return self._unload_key(key)

    def _unload_key(self, key: str, only: RunningModel | None = None, *, wait: bool = True,
                    deadline: float | None = None) -> bool:
        """Unload the model under ``key``; ``wait`` for its requests to finish first (else cancel them).
        With a ``deadline`` (monotonic) a model still busy then is cancelled and closed."""
        with self._lock:
            running = self._models.get(key)
            if running is None or (only is not None and running is not only):
                return False
            del self._models[key]
            for alias in [a for a, k in self._aliases.items() if k == key]:
                del self._aliases[alias]
            running.closed = True
        try:
            while wait and (running.refs > 0 or running.model.busy):  # let running generations finish
                if deadline is not None and time.monotonic() >= deadline:
                    break
                time.sleep(0.02)
            running.model.close()
        finally:
            with self._lock:
                self._idle.notify_all()  # waiters see ``closed`` and load again
        return True

    def _reap_loop(self) -> None:
        while not self._closed.wait(0.25):
            now = time.monotonic()
            with self._lock:
                expired = [(k, m) for k, m in self._models.items() if m.refs == 0 and m.expires_at <= now]
            for k, m in expired:
                self._unload_key(k, only=m)

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
        _open_engines.discard(self)
        # a load in progress finishes (a conversion stops) before the models close
        locked = self._load_lock.acquire(timeout=-1 if timeout is None else timeout)
        try:
            for key in list(self._models):
                self._unload_key(key, wait=False, deadline=deadline)
        finally:
            if locked:
                self._load_lock.release()
        if threading.current_thread() is not self._reaper:
            self._reaper.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _acquire(lock: Any, cancel: threading.Event | None, *, give_up: bool = False) -> bool:
    """Acquire ``lock`` (a Lock or Semaphore), polling ``cancel``. False if cancelled first
    (``give_up=True``), else a cancelled wait raises :class:`LocalLLMError`."""
    if cancel is None:
        lock.acquire()
        return True
    while not lock.acquire(timeout=0.05):
        if cancel.is_set():
            if give_up:
                return False
            raise LocalLLMError("The request was cancelled while waiting for another model to load.")
    return True


_open_engines: weakref.WeakSet[Engine] = weakref.WeakSet()
EXIT_TIMEOUT = 15.0  # seconds the exit hook waits for an engine's work that does not stop


@atexit.register
def _close_open_engines() -> None:
    """At interpreter exit, close the engines nobody closed: their model threads must end (and free what
    the backends keep per thread) while Python can still run them."""
    for engine in list(_open_engines):
        engine.close(timeout=EXIT_TIMEOUT)

