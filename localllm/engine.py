"""The engine owns loaded models: load on demand through the planner, keep-alive, serialised access,
cancellation. Faces (CLI, server, TUI) talk to it and never to a backend.

    >>> from localllm.engine import Engine, GenerateRequest, Sampling, TextChunk
    >>> with Engine() as engine:
    ...     req = GenerateRequest(messages=[{"role": "user", "content": "Hi"}], sampling=Sampling(seed=1))
    ...     for event in engine.generate("smollm2:135m", req):
    ...         if isinstance(event, TextChunk):
    ...             print(event.text, end="")

Concurrency: each loaded model has a semaphore of ``backend.max_parallel`` slots (1 today: neither a
``llama_cpp.Llama`` nor an MLX model is safe for concurrent generation). Only one model loads at a
time. A generation holds its slot for the life of its generator; closing the generator or setting
``cancel`` stops it at the next token and frees the slot.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

# The request/event types faces use: re-exported so no face imports ``backends``.
from backends.base import (  # noqa: F401
    KV_CACHE_TYPES,
    Backend,
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
    ToolCalls,
    UnsupportedError,
    get_backend_class,
)
from localllm import config
from localllm.errors import LocalLLMError, ModelNotFoundError

DEFAULT_KEEP_ALIVE = 300.0  # seconds (Ollama: 5m)


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


@dataclass
class RunningModel:
    """A loaded model as ``ps`` shows it."""

    name: str
    digest: str
    backend: Backend
    options: LoadOptions
    plan: Any  # planner.Plan
    loaded_at: float
    load_duration_ns: int
    keep_alive: float
    expires_at: float  # monotonic deadline; inf = never
    slots: threading.Semaphore
    active: int = 0
    last_used: float = field(default_factory=time.monotonic)

    @property
    def info(self) -> ModelInfo:
        return self.backend.info

    @property
    def size(self) -> int:
        return self.info.size_bytes

    @property
    def size_vram(self) -> int:
        return self.info.vram_bytes

    @property
    def expires_in(self) -> float:
        return self.expires_at - time.monotonic()


class Engine:
    """Loaded models, keep-alive and serialised access. Thread-safe."""

    def __init__(self, store: Any = None, *, keep_alive: float | None = None, hardware: Any = None):
        if store is None:
            from localllm.store import Store

            store = Store()
        self.store = store
        self._hardware = hardware
        self.keep_alive = parse_keep_alive(None) if keep_alive is None else keep_alive
        self._models: dict[str, RunningModel] = {}
        self._lock = threading.RLock()  # guards _models
        self._load_lock = threading.Lock()  # one load at a time
        self._closed = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="localllm-keepalive", daemon=True)
        self._reaper.start()

    # ------------------------------------------------------------------ services

    @property
    def hardware(self) -> Any:
        if self._hardware is None:
            from localllm.hardware import probe

            self._hardware = probe()
        return self._hardware

    def plan_for(self, name: str, options: LoadOptions | None = None) -> tuple[Any, Any]:
        """(installed model, plan) without loading anything."""
        from localllm.ggufinfo import GGUFInfo
        from localllm.planner import plan

        options = options or LoadOptions()
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
            mlx_model=getattr(model, "mlx_path", None) is not None,
        )
        return model, p

    def _draft_spec(self, model: Any, options: LoadOptions, backend: str) -> DraftSpec | None:
        choice = (options.draft or "auto").strip()
        if choice == "none":
            return None
        if choice == "ngram":
            return DraftSpec(kind="ngram", num_draft=options.num_draft)
        if choice == "auto":
            entry = getattr(model, "catalog", None)
            draft_name = getattr(entry, "draft", None) if entry else None
            if not draft_name:
                return None
            try:
                draft = self.store.get(draft_name)
            except ModelNotFoundError:
                return None  # suggested draft not installed: plain decoding
        else:
            draft = self.store.get(choice)
        path = draft.mlx_path if backend == "mlx" else draft.path
        if path is None:
            raise LocalLLMError(f"Draft model {draft.name} has no {backend} weights installed.")
        return DraftSpec(kind="model", path=str(path), num_draft=options.num_draft)

    # ------------------------------------------------------------------ loading

    def load(self, name: str, options: LoadOptions | None = None, *, keep_alive: float | None = None) -> RunningModel:
        """Load ``name`` (or return it if already loaded with compatible options)."""
        options = options or LoadOptions()
        ka = self.keep_alive if keep_alive is None else keep_alive
        with self._load_lock:
            with self._lock:
                running = self._models.get(name)
                if running is not None and self._compatible(running, options):
                    self._touch(running, ka)
                    return running
            if running is not None:  # reload with other options once it is idle
                self.unload(name)
            model, p = self.plan_for(name, options)
            if p.verdict == "too_big":
                from localllm.errors import PlanError

                raise PlanError(f"{model.name} does not fit this machine: {'; '.join(p.reasons)}")
            path = model.mlx_path if p.backend == "mlx" else model.path
            spec = LoadSpec(
                model_path=str(path),
                n_ctx=p.n_ctx,
                n_gpu_layers=p.n_gpu_layers,
                n_threads=options.num_thread or p.n_threads,
                kv_cache_type=p.kv_cache_type,
                flash_attn=p.flash_attn,
                draft=self._draft_spec(model, options, p.backend),
                embedding=options.embedding,
                verbose=os.environ.get("LOCALLLM_DEBUG", "") not in ("", "0"),
            )
            cls = get_backend_class(p.backend)
            t0 = time.perf_counter_ns()
            backend = cls(spec)
            load_ns = time.perf_counter_ns() - t0
            now = time.monotonic()
            running = RunningModel(
                name=model.name,
                digest=model.digest,
                backend=backend,
                options=options,
                plan=p,
                loaded_at=time.time(),
                load_duration_ns=load_ns,
                keep_alive=ka,
                expires_at=now + ka,
                slots=threading.Semaphore(backend.max_parallel),
            )
            with self._lock:
                self._models[name] = running
            return running

    @staticmethod
    def _compatible(running: RunningModel, options: LoadOptions) -> bool:
        want, have = options, running.options
        if want.embedding and not have.embedding:
            return False
        if want.num_ctx is not None and want.num_ctx != running.info.n_ctx:
            return False
        for f in ("num_gpu", "kv_cache_type", "num_thread"):
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

    # ------------------------------------------------------------------ work

    def generate(
        self,
        name: str,
        request: GenerateRequest,
        options: LoadOptions | None = None,
        *,
        cancel: threading.Event | None = None,
        keep_alive: float | None = None,
    ) -> Iterator[Event]:
        """Stream events for ``request`` on ``name`` (loaded on demand). The last event is :class:`Done`;
        its ``stats.load_duration`` includes the load if this call loaded the model."""
        t_start = time.perf_counter_ns()
        was_loaded = name in self._models
        running = self.load(name, options, keep_alive=keep_alive)
        ka = running.keep_alive if keep_alive is None else keep_alive
        running.slots.acquire()
        running.active += 1
        try:
            for event in running.backend.generate(request, cancel):
                if isinstance(event, Done):
                    event.stats.load_duration = 0 if was_loaded else running.load_duration_ns
                    event.stats.total_duration = time.perf_counter_ns() - t_start
                yield event
        finally:
            running.active -= 1
            running.slots.release()
            self._touch(running, ka)
            if ka == 0:
                self.unload(name)

    def embed(self, name: str, texts: list[str], options: LoadOptions | None = None,
              *, keep_alive: float | None = None) -> list[list[float]]:
        options = replace(options or LoadOptions(), embedding=True)
        running = self.load(name, options, keep_alive=keep_alive)
        with running.slots:
            running.active += 1
            try:
                return running.backend.embed(texts)
            finally:
                running.active -= 1
                self._touch(running, running.keep_alive if keep_alive is None else keep_alive)

    def tokenize(self, name: str, text: str) -> list[int]:
        running = self.load(name)
        return running.backend.tokenize(text)

    # ------------------------------------------------------------------ lifecycle

    def ps(self) -> list[RunningModel]:
        with self._lock:
            return sorted(self._models.values(), key=lambda m: m.expires_at)

    def is_loaded(self, name: str) -> bool:
        return name in self._models

    def unload(self, name: str) -> bool:
        """Unload ``name`` once its running generations finish. True if it was loaded."""
        with self._lock:
            running = self._models.pop(name, None)
        if running is None:
            return False
        for _ in range(running.backend.max_parallel):  # wait for in-flight work to end
            running.slots.acquire()
        running.backend.close()
        return True

    def _reap_loop(self) -> None:
        while not self._closed.wait(0.25):
            now = time.monotonic()
            with self._lock:
                expired = [n for n, m in self._models.items() if m.active == 0 and m.expires_at <= now]
            for n in expired:
                self.unload(n)

    def close(self) -> None:
        self._closed.set()
        for name in list(self._models):
            self.unload(name)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

