"""One interface for the screens, two implementations: the in-process engine and a remote server.

The screens call :class:`ChatBackend` and never care which one they got::

    backend = make_backend(host=None)          # in-process: Engine + Store + Catalog + planner
    backend = make_backend(host="127.0.0.1:11434")  # a localllm or Ollama server (Ollama API)
    for event in backend.chat("smollm2:135m", [{"role": "user", "content": "Hi"}], {"seed": 1}, cancel):
        ...  # TextChunk ... Done, the engine's own event types

Every method may block (disk, network, model loads): the app calls them from thread workers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

GiB = 1024**3


@dataclass
class ModelRow:
    """An installed model as the model manager shows it."""

    name: str
    size: int = 0
    quantization: str = ""
    backend: str = ""  # the backend the planner picks for it here
    verdict: str = ""  # "fits on GPU" | "partial offload 20/32 layers" | "CPU" | "too big"
    loaded: bool = False
    parameters: str = ""
    context: int = 0
    formats: str = "GGUF"  # the weight formats installed: "GGUF" or "GGUF+MLX"


@dataclass
class CatalogRow:
    """A catalog entry with the planner's verdict for this machine."""

    name: str
    size: int = 0
    description: str = ""
    draft: str | None = None
    verdict: str = ""
    installed: bool = False


@dataclass
class PullUpdate:
    """One progress report of a pull."""

    status: str
    completed: int = 0
    total: int = 0


@dataclass
class AnswerInfo:
    """What the status line says about the last answer (filled in while it streams)."""

    model: str = ""
    backend: str = ""
    ttft_s: float | None = None
    stats: Any = None  # the engine's Stats of the Done event
    finish_reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def verdict_text(plan: Any, n_layers: int | None = None) -> str:
    """The planner's verdict in the words the model manager shows.

    >>> from types import SimpleNamespace as NS
    >>> verdict_text(NS(verdict="partial", n_gpu_layers=20), 32)
    'partial offload 20/32 layers'
    >>> verdict_text(NS(verdict="too_big", n_gpu_layers=0))
    'too big'
    """
    if plan is None:
        return "?"
    if str(getattr(plan, "verdict", "")) == "too_big":
        return "too big"
    if getattr(plan, "verdict_text", None):
        return str(plan.verdict_text)
    verdict = str(getattr(plan, "verdict", "") or "").lower()
    ngl = getattr(plan, "n_gpu_layers", 0) or 0
    total = n_layers or getattr(plan, "n_layers", None) or getattr(plan, "total_layers", None)
    if "too" in verdict or "not_fit" in verdict or "no_fit" in verdict:
        return "too big"
    if "partial" in verdict:
        return f"partial offload {ngl}/{total} layers" if total else f"partial offload {ngl} layers"
    if "gpu" in verdict or "metal" in verdict or "mlx" in verdict or "full" in verdict:
        return "fits on GPU"
    if "cpu" in verdict:
        return "CPU"
    return verdict or "?"


def estimate_verdict(size: int, hw: Any) -> str:
    """A first-filter verdict from the file size alone (weights + ~20% for KV cache and buffers),
    for catalog entries whose GGUF metadata is not on this machine yet.

    >>> from types import SimpleNamespace as NS
    >>> estimate_verdict(5 * GiB, NS(gpus=[NS(free_bytes=24 * GiB)], ram_available=8 * GiB))
    '≈ fits on GPU'
    >>> estimate_verdict(5 * GiB, NS(gpus=[], ram_available=4 * GiB))
    '≈ too big'
    """
    if not size:
        return "?"
    need = size * 1.2
    gpu_free = sum(getattr(g, "free_bytes", 0) or 0 for g in getattr(hw, "gpus", []) or [])
    ram = getattr(hw, "ram_available", 0) or 0
    if gpu_free and need <= gpu_free:
        return "≈ fits on GPU"
    if gpu_free and need <= gpu_free + ram:
        return f"≈ partial offload {gpu_free / need:.0%}"
    if need <= ram:
        return "≈ CPU"
    return "≈ too big"


def human_size(n: int | float | None) -> str:
    """Decimal units, as ``ollama list`` shows them.

    >>> human_size(92_900_000)
    '92.9 MB'
    """
    if not n:
        return "-"
    n = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _progress(update: Any) -> PullUpdate:
    """Normalise whatever a pull reports (object, dict, tuple) to a PullUpdate."""
    if isinstance(update, PullUpdate):
        return update
    if isinstance(update, dict):
        get = update.get
    elif isinstance(update, tuple | list):
        vals = list(update) + [0, 0, 0]
        if isinstance(vals[0], str):
            return PullUpdate(vals[0], int(vals[1] or 0), int(vals[2] or 0))
        return PullUpdate("downloading", int(vals[0] or 0), int(vals[1] or 0))
    else:
        def get(key: str, default: Any = None) -> Any:
            return getattr(update, key, default)
    completed = get("completed", None)
    if completed is None:
        completed = get("downloaded", None)
    if completed is None:
        completed = get("done", 0)
    total = get("total", None)
    if total is None:
        total = get("size", 0)
    status = get("status", None) or get("phase", None) or "downloading"
    return PullUpdate(str(status), int(completed or 0), int(total or 0))


def sampling_from(params: dict[str, Any]) -> dict[str, Any]:
    """The sampling part of a conversation's parameters (only what is set)."""
    out: dict[str, Any] = {}
    for key in ("temperature", "top_p", "top_k", "seed", "max_tokens"):
        if params.get(key) not in (None, ""):
            out[key] = params[key]
    return out


def request_from(messages: list[dict[str, Any]], params: dict[str, Any]) -> tuple[Any, Any]:
    """A conversation's messages and parameters → (GenerateRequest, LoadOptions), for either backend."""
    from localllm.engine import GenerateRequest, LoadOptions, Sampling

    options: dict[str, Any] = {}
    if params.get("num_ctx"):
        options["num_ctx"] = int(params["num_ctx"])
    if params.get("draft"):
        options["draft"] = str(params["draft"])
    return GenerateRequest(messages=messages, sampling=Sampling(**sampling_from(params))), LoadOptions(**options)


class ChatBackend:
    """What the screens need. Subclasses: :class:`LocalBackend`, :class:`RemoteBackend`."""

    kind = "?"
    label = "?"

    def models(self) -> list[ModelRow]:
        raise NotImplementedError

    def catalog(self) -> list[CatalogRow]:
        return []

    def model_names(self) -> list[str]:
        """Installed names only (cheap: no fit verdicts)."""
        return [m.name for m in self.models()]

    def loaded(self) -> set[str]:
        return set()

    def chat(self, model: str, messages: list[dict[str, Any]], params: dict[str, Any],
             cancel: threading.Event, info: AnswerInfo | None = None) -> Iterator[Any]:
        raise NotImplementedError

    def pull(self, name: str, progress: Callable[[PullUpdate], None], cancel: threading.Event) -> None:
        raise NotImplementedError

    def delete(self, name: str) -> None:
        raise NotImplementedError

    def hardware(self) -> dict[str, Any]:
        """{"probe": dict, "plan": {"model", "backend", "verdict", "reasons": [...]} or None, "notes": [...]}"""
        return {}

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------- local


class LocalBackend(ChatBackend):
    """The in-process engine: no daemon needed."""

    kind = "local"
    label = "in-process"

    def __init__(self, engine: Any = None):
        from localllm.engine import Engine

        self.engine = engine or Engine()
        self.store = self.engine.store

    # -- services
    def _installed(self) -> list[Any]:
        for attr in ("list", "installed", "models"):
            fn = getattr(self.store, attr, None)
            if callable(fn):
                return list(fn())
        return []

    def model_names(self) -> list[str]:
        return [m.name for m in self._installed()]

    def _verdict(self, name: str, n_layers: int | None) -> tuple[str, str]:
        try:
            _, plan = self.engine.plan_for(name)
        except Exception as e:  # noqa: BLE001 - a verdict that cannot be computed is shown, not raised
            return "", f"? ({e})"
        return str(getattr(plan, "backend", "")), verdict_text(plan, n_layers)

    def models(self) -> list[ModelRow]:
        loaded = self.loaded()
        rows = []
        for m in self._installed():
            info = getattr(m, "info", None) or {}
            if not isinstance(info, dict):
                info = getattr(info, "__dict__", {})
            n_layers = info.get("n_layers")
            backend, verdict = self._verdict(m.name, n_layers)
            quant = getattr(m, "quant", None) or getattr(m, "quantization", None) or info.get("file_type_name") \
                or str(info.get("file_type", "") or "")
            rows.append(ModelRow(
                name=m.name, size=int(getattr(m, "size", 0) or 0), quantization=str(quant), backend=backend,
                verdict=verdict, loaded=m.name in loaded, parameters=str(info.get("parameters", "") or ""),
                context=int(info.get("context_length", 0) or 0),
                formats="+".join(getattr(m, "formats", None) or ["GGUF"]),
            ))
        return rows

    def catalog(self) -> list[CatalogRow]:
        cat = getattr(self.store, "catalog", None)
        if cat is None:
            from localllm.catalog import Catalog

            cat = Catalog.load()
        entries = cat.entries()
        installed = {m.name for m in self._installed()}
        hw = self.engine.hardware
        rows = []
        for e in entries or []:
            size = getattr(e, "approx_size", None) or sum(m.download_size for m in getattr(e, "mirrors", [])[:1])
            rows.append(CatalogRow(
                name=e.name, size=int(size or 0), description=getattr(e, "description", "") or "",
                draft=getattr(e, "draft", None), verdict=self._catalog_verdict(e, hw), installed=e.name in installed,
            ))
        return rows

    def _catalog_verdict(self, entry: Any, hw: Any) -> str:
        """The planner's verdict for a catalog entry: exact when the model is installed (its GGUF
        metadata is known), else estimated from the download size (marked with ``≈``)."""
        from localllm import planner

        for fn_name in ("plan_catalog", "plan_entry", "estimate_entry"):  # a planner that can do it itself
            fn = getattr(planner, fn_name, None)
            if callable(fn):
                try:
                    result = fn(entry, hw)
                except Exception:  # noqa: BLE001
                    break
                return result if isinstance(result, str) else verdict_text(result)
        try:
            _, plan = self.engine.plan_for(entry.name)
            return verdict_text(plan)
        except Exception:  # noqa: BLE001 - not installed: estimate below
            pass
        return estimate_verdict(getattr(entry, "approx_size", 0) or 0, hw)

    def loaded(self) -> set[str]:
        return {m.name for m in self.engine.ps()}

    def describe_loaded(self, name: str) -> str:
        for m in self.engine.ps():
            if m.name == name:
                plan = m.plan
                backend = getattr(plan, "backend", "?")
                ngl = m.info.n_gpu_layers
                where = f"GPU {ngl}/{m.info.n_layers}" if ngl else "CPU"
                return f"{backend} {where}"
        return ""

    # -- work
    def chat(self, model: str, messages: list[dict[str, Any]], params: dict[str, Any],
             cancel: threading.Event, info: AnswerInfo | None = None) -> Iterator[Any]:
        from localllm.engine import Done, TextChunk

        request, load_options = request_from(messages, params)
        t0 = time.perf_counter()
        for event in self.engine.generate(model, request, load_options, cancel=cancel):
            if info is not None:
                if isinstance(event, TextChunk) and info.ttft_s is None:
                    info.ttft_s = time.perf_counter() - t0
                    info.backend = self.describe_loaded(model)
                elif isinstance(event, Done):
                    info.stats, info.finish_reason = event.stats, event.finish_reason
                    info.backend = info.backend or self.describe_loaded(model)
                    load_s = (event.stats.load_duration or 0) / 1e9
                    if load_s:  # TTFT is the answer's: the model load is shown on its own
                        info.extra["load_s"] = load_s
                        if info.ttft_s is not None:
                            info.ttft_s = max(0.0, info.ttft_s - load_s)
            yield event

    def pull(self, name: str, progress: Callable[[PullUpdate], None], cancel: threading.Event) -> None:
        self.store.pull(name, progress=lambda u: progress(_progress(u)), cancel=cancel)

    def delete(self, name: str) -> None:
        self.engine.unload(name)
        for attr in ("remove", "rm", "delete"):
            fn = getattr(self.store, attr, None)
            if callable(fn):
                fn(name)
                return

    def hardware(self) -> dict[str, Any]:
        hw = self.engine.hardware
        out: dict[str, Any] = {"probe": hw.as_dict() if hasattr(hw, "as_dict") else dict(vars(hw)), "plan": None}
        from localllm.config import DEFAULT_MODEL

        from .settings import default_model

        name = default_model() or DEFAULT_MODEL
        try:
            model, plan = self.engine.plan_for(name)
            out["plan"] = {
                "model": model.name, "backend": getattr(plan, "backend", "?"),
                "verdict": verdict_text(plan, (model.info or {}).get("n_layers")),
                "n_gpu_layers": getattr(plan, "n_gpu_layers", 0), "n_ctx": getattr(plan, "n_ctx", 0),
                "kv_cache_type": getattr(plan, "kv_cache_type", ""),
                "reasons": list(getattr(plan, "reasons", []) or []),
            }
        except Exception as e:  # noqa: BLE001 - shown in the view
            out["plan_error"] = f"No plan for {name}: {e}"
        return out

    def close(self) -> None:
        self.engine.close()


# --------------------------------------------------------------------------------------------- remote


class RemoteBackend(ChatBackend):
    """A localllm or Ollama server, over the Ollama API (:class:`localllm.client.Client`)."""

    kind = "remote"

    def __init__(self, host: str | None = None, client: Any = None):
        if client is None:
            from localllm.client import Client

            client = Client(host)
        self.client = client
        self.host = getattr(client, "url", None) or host or "?"
        self.label = f"server {self.host}"

    def models(self) -> list[ModelRow]:
        loaded = self.loaded()
        rows = []
        for m in self.client.list():
            details = _field(m, "details") or {}
            name = _field(m, "name") or _field(m, "model") or ""
            rows.append(ModelRow(
                name=name, size=int(_field(m, "size") or 0),
                quantization=str(_field(details, "quantization_level") or ""),
                backend="server", verdict="(server decides)", loaded=name in loaded,
                parameters=str(_field(details, "parameter_size") or ""),
            ))
        return rows

    def model_names(self) -> list[str]:
        return [_field(m, "name") or "" for m in self.client.list()]

    def loaded(self) -> set[str]:
        try:
            running = self.client.ps()
        except Exception:  # noqa: BLE001 - an Ollama without /api/ps still chats
            return set()
        return {_field(m, "name") or _field(m, "model") or "" for m in running}

    def describe_loaded(self, name: str) -> str:
        try:
            running = self.client.ps()
        except Exception:  # noqa: BLE001
            return self.label
        for m in running:
            if _field(m, "name") == name:
                processor = getattr(m, "processor", "")
                return f"{self.label} {processor}".strip()
        return self.label

    def chat(self, model: str, messages: list[dict[str, Any]], params: dict[str, Any],
             cancel: threading.Event, info: AnswerInfo | None = None) -> Iterator[Any]:
        from localllm.engine import Done, TextChunk

        request, load_options = request_from(messages, params)
        t0 = time.perf_counter()
        stream = self.client.generate(model, request, load_options, cancel=cancel)
        try:
            for event in stream:
                if info is not None:
                    if isinstance(event, TextChunk) and info.ttft_s is None:
                        info.ttft_s = time.perf_counter() - t0
                    elif isinstance(event, Done):
                        info.stats, info.finish_reason = event.stats, event.finish_reason
                        info.backend = self.describe_loaded(model)
                        load_s = (event.stats.load_duration or 0) / 1e9
                        if load_s:
                            info.extra["load_s"] = load_s
                            if info.ttft_s is not None:
                                info.ttft_s = max(0.0, info.ttft_s - load_s)
                yield event
        finally:
            close = getattr(stream, "close", None)
            if close:
                close()

    def pull(self, name: str, progress: Callable[[PullUpdate], None], cancel: threading.Event) -> None:
        self.client.pull(name, progress=lambda u: progress(_progress(u)), cancel=cancel)

    def delete(self, name: str) -> None:
        self.client.remove(name)

    def hardware(self) -> dict[str, Any]:
        from localllm.hardware import probe

        return {"probe": probe().as_dict(), "plan": None,
                "plan_error": f"Models run on the server at {self.host}; this is the probe of this machine."}

    def close(self) -> None:
        close = getattr(self.client, "close", None)
        if close:
            close()


def _field(obj: Any, key: str, default: Any = None) -> Any:
    """``obj[key]`` for a dict, ``obj.key`` otherwise."""
    return obj.get(key, default) if isinstance(obj, dict) else getattr(obj, key, default)


def make_backend(host: str | None = None) -> ChatBackend:
    """A server when ``host`` is given (or ``LOCALLLM_HOST`` is set and a server answers there, as for
    the other faces); else the in-process engine."""
    from localllm.client import connect

    client = connect(host)
    return RemoteBackend(client=client) if client is not None else LocalBackend()
