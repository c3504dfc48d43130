"""The in-process side of :mod:`localllm.api`: :class:`LocalModels` over the store, :class:`LocalRunner` over
the engine, :class:`LocalAdvisor` over the planner, the catalog and the hardware probe.

Kept light at import: the engine (and with it the backends) is imported only by whoever makes one, so
``localllm list`` reads the manifests and nothing more.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from localllm.api import CatalogItem, Fit, Installed, ProgressFn, Running

if TYPE_CHECKING:
    from localllm.api import AsyncEventStream, EventStream
    from localllm.catalog import CatalogEntry
    from localllm.engine import Engine, GenerateRequest, LoadOptions, RunningModel
    from localllm.hardware import HardwareInfo
    from localllm.planner import Plan
    from localllm.store import InstalledModel, Store

GiB = 1024**3


def capabilities(info: dict[str, object]) -> list[str]:
    """What a model can do, from its GGUF metadata (``/api/show``'s list): completion, tools, thinking.

    >>> capabilities({"chat_template": "{% if tools %}{% endif %}", "architecture": "llama"})
    ['completion', 'tools']
    """
    from localllm.thinking import thinks

    template = info.get("chat_template")
    caps = ["completion"]
    if isinstance(template, str) and "tools" in template:
        caps.append("tools")
    if thinks(info):
        caps.append("thinking")
    return caps


def installed(m: InstalledModel) -> Installed:
    """The store's record as the faces see it."""
    info = m.info
    return Installed(
        name=m.name, digest=m.digest, size=m.size, modified=m.modified, formats=list(m.formats),
        architecture=str(info.get("architecture") or ""), parameters=int(info.get("parameters") or 0),
        quantization=str(info.get("file_type") or m.quant or ""),
        context_length=int(info.get("context_length") or 0), embedding_length=int(info.get("n_embd") or 0),
        n_layers=int(info.get("n_layers") or 0), vocab_size=int(info.get("vocab_size") or 0),
        chat_template=info.get("chat_template"),
        license=info.get("license") or (m.catalog.license if m.catalog else None),
        capabilities=capabilities(info) + (["vision"] if m.projector is not None else []),
        path=str(m.path), source=m.source, local=m.local, quant=m.quant,
        catalog=m.catalog.name if m.catalog else None, draft=m.catalog.draft if m.catalog else None,
        template_note=m.catalog.template_note if m.catalog else None,
        mlx_path=str(m.mlx_path) if m.mlx_path else None, mlx_source=m.mlx_source, mlx_repo=m.mlx_repo,
        mlx_revision=m.mlx_revision,
        projector_path=str(m.projector.path) if m.projector else None,
        projector_digest=m.projector.digest if m.projector else None,
        projector_size=m.projector.size if m.projector else 0,
    )


class LocalModels:
    """:class:`~localllm.api.Models` over a :class:`~localllm.store.Store` (this machine's models directory)."""

    label = "in-process"
    remote = False

    def __init__(self, store: Store | None = None):
        if store is None:
            from localllm.store import Store

            store = Store()
        self.store = store

    def list(self) -> list[Installed]:
        return [installed(m) for m in self.store.list()]

    def show(self, name: str) -> Installed:
        return installed(self.store.get(name))

    def pull(self, name: str, *, progress: ProgressFn | None = None, cancel: threading.Event | None = None,
             mlx: bool | None = None, mmproj_file: str | None = None) -> Installed:
        return installed(self.store.pull(name, progress=progress, cancel=cancel, mlx=mlx, mmproj_file=mmproj_file))

    def set_projector(self, name: str, path: str) -> Installed:
        from pathlib import Path

        return installed(self.store.set_projector(name, Path(path)))

    def remove(self, name: str) -> str:
        return self.store.remove(name)

    def copy(self, src: str, dst: str) -> str:
        return self.store.copy(src, dst).name

    def close(self) -> None:
        pass


class LocalRunner:
    """:class:`~localllm.api.Runner` over an :class:`~localllm.engine.Engine` (models run in this process)."""

    label = "in-process"
    remote = False

    def __init__(self, engine: Engine):
        self.engine = engine

    def generate(self, name: str, request: GenerateRequest, options: LoadOptions | None = None, *,
                 cancel: threading.Event | None = None, keep_alive: float | None = None) -> EventStream:
        return self.engine.generate(name, request, options, cancel=cancel, keep_alive=keep_alive)

    def agenerate(self, name: str, request: GenerateRequest, options: LoadOptions | None = None, *,
                  cancel: threading.Event | None = None, keep_alive: float | None = None) -> AsyncEventStream:
        return self.engine.agenerate(name, request, options, cancel=cancel, keep_alive=keep_alive)

    def load(self, name: str, options: LoadOptions | None = None, *, keep_alive: float | None = None) -> Running:
        return running(self.engine.load(name, options, keep_alive=keep_alive))

    def unload(self, name: str) -> bool:
        return self.engine.unload(name)

    def ps(self) -> list[Running]:
        return [running(m) for m in self.engine.ps()]

    def tokenize(self, name: str, text: str) -> list[int]:
        """The model's tokens for ``text`` (``localllm bench`` sizes its prompts with it)."""
        return self.engine.tokenize(name, text)

    def close(self) -> None:
        self.engine.close()


def running(m: RunningModel) -> Running:
    info = m.info
    wall = m.expires_at_wall
    return Running(
        name=m.name, digest=m.digest, size=int(m.size), size_vram=int(m.size_vram), context_length=info.n_ctx,
        expires_at=None if wall is None else datetime.fromtimestamp(wall, UTC), backend=m.backend,
        kv_cache_type=info.kv_cache_type, n_gpu_layers=info.n_gpu_layers, n_layers=info.n_layers, draft=info.draft,
        n_threads=m.model.spec.n_threads, slots=info.n_seq, kv_cache_bytes=_kv_bytes(m),
        slots_busy=m.metrics.slots_busy, batched=m.batched, prompt_cache_entries=m.metrics.prompt_cache_entries,
        prompt_cache_bytes=m.metrics.prompt_cache_bytes,
    )


def _kv_bytes(m: RunningModel) -> int | None:
    """The KV cache of one sequence's context: as the backend reports it, else layers × KV heads × head size ×
    context for the type."""
    info = m.info
    reported = (info.extra or {}).get("kv_cache_bytes")
    if reported:
        return int(reported)
    if m.installed is None:
        return None
    from localllm.ggufinfo import GGUFInfo

    try:
        g = GGUFInfo(**m.installed.info)
        return int(g.kv_bytes_per_token(info.kv_cache_type) * info.n_ctx)
    except (TypeError, KeyError, ValueError):  # an estimate is a nicety
        return None


# ---------------------------------------------------------------------------------------------- advice


def fit_of(plan: Plan, model: str = "") -> Fit:
    """A plan in the words the faces show ("too big" where the planner says it does not fit)."""
    text = "too big" if plan.verdict == "too_big" else plan.verdict_text
    return Fit(model=model, backend=plan.backend, verdict=plan.verdict, text=text, n_gpu_layers=plan.n_gpu_layers,
               n_ctx=plan.n_ctx, kv_cache_type=plan.kv_cache_type, reasons=list(plan.reasons))


def estimate_fit(size: int, hw: HardwareInfo) -> Fit:
    """A first-filter verdict from the file size alone (weights + ~20% for KV cache and buffers), for catalog
    entries whose GGUF metadata is not on this machine yet; the text starts with ``≈``.

    >>> from localllm.hardware import GPU, HardwareInfo
    >>> hw = HardwareInfo("Linux", "x86_64", "cpu", 2, 2, [], 8 * GiB, 8 * GiB)
    >>> estimate_fit(5 * GiB, hw).text
    '≈ CPU'
    >>> hw.gpus = [GPU(0, "gpu", "nvidia", 24 * GiB, 24 * GiB)]
    >>> estimate_fit(5 * GiB, hw).text, estimate_fit(50 * GiB, hw).text
    ('≈ fits on GPU', '≈ too big')
    """
    if not size:
        return Fit(estimated=True)
    need = size * 1.2
    gpu_free = sum(g.free_bytes for g in hw.gpus)
    ram = hw.ram_available
    if gpu_free and need <= gpu_free:
        verdict, text = "gpu", "≈ fits on GPU"
    elif gpu_free and need <= gpu_free + ram:
        verdict, text = "partial", f"≈ partial offload {gpu_free / need:.0%}"
    elif need <= ram:
        verdict, text = "cpu", "≈ CPU"
    else:
        verdict, text = "too_big", "≈ too big"
    return Fit(verdict=verdict, text=text, estimated=True)


class LocalAdvisor:
    """:class:`~localllm.api.Advisor` over the engine's planner view (its store and its hardware probe)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def fit(self, name: str) -> Fit:
        model, plan = self.engine.plan_for(name)
        return fit_of(plan, model.name)

    def catalog(self) -> list[CatalogItem]:
        store = self.engine.store
        installed_names = {m.name for m in store.list()}
        hw = self.engine.hardware
        return [self._item(e, e.name in installed_names, hw) for e in store.catalog.entries()]

    def _item(self, entry: CatalogEntry, is_installed: bool, hw: HardwareInfo) -> CatalogItem:
        size = entry.approx_size or sum(m.download_size for m in entry.mirrors[:1])
        fit = None
        if is_installed:  # exact: its GGUF metadata is here
            from localllm.errors import LocalLLMError

            try:
                fit = self.fit(entry.name)
            except LocalLLMError:
                fit = None
        return CatalogItem(name=entry.name, size=int(size or 0), description=entry.description or "",
                           draft=entry.draft, installed=is_installed,
                           fit=fit or estimate_fit(entry.approx_size or 0, hw))

    def hardware(self) -> HardwareInfo:
        return self.engine.hardware
