"""The loader: plan → load. From an installed model and :class:`LoadOptions` it makes the planner's
:class:`~localllm.planner.Plan`, the :class:`LoadSpec` with its draft (:class:`DraftSpec`) and prompt cache
(:class:`PromptCacheSpec`), prepares the weights the backend takes (an MLX conversion on first use) and starts
the model's decode loop (:class:`backends.loop.LoadedModel`). Which models stay loaded, for how long and who
uses them is the engine's (:mod:`localllm.engine`); the loader keeps nothing of a model it has loaded.

``--backend mlx`` on a model with no MLX weights converts its GGUF on first use (once, offline; see
:mod:`localllm.mlxmodels`), on the model's decode thread before it loads; ``on_convert`` receives the
:class:`~localllm.mlxmodels.ConversionProgress` events a face shows.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from backends import descriptor
from backends.base import DraftSpec, LoadSpec, LoraAdapter, TokenSource
from backends.loop import LoadedModel
from backends.prompt_cache import PromptCacheSpec
from backends.registry import source_class
from localllm import config
from localllm.errors import LocalLLMError, ModelNotFoundError, PlanError
from localllm.hardware import BACKEND_CHOICES
from localllm.planner import MIN_CTX

log = logging.getLogger("localllm.loader")

if TYPE_CHECKING:
    from localllm.hardware import HardwareInfo
    from localllm.mlxmodels import ConversionProgress
    from localllm.planner import Plan
    from localllm.store import InstalledModel, Store



@dataclass(frozen=True)
class LoadOptions:
    """How to load a model. ``None`` means "let the planner decide"."""

    num_ctx: int | None = None
    num_gpu: int | None = None  # layers to offload; None = planner, 0 = CPU
    kv_cache_type: str | None = None  # f16 | q8_0 | q4_0; None = LOCALLLM_KV_CACHE_TYPE
    backend: str = "auto"  # auto (the planner's choice) or a registered backend's name
    draft: str = "auto"  # auto (catalog pairing if installed) | none | ngram | NAME | PATH
    num_draft: int = 4
    num_thread: int | None = None
    embedding: bool = False  # make the embedding context at load (any loaded model embeds on demand)
    num_parallel: int | None = None  # slots; None = LOCALLLM_NUM_PARALLEL, else the planner (4 where it fits)
    devices: tuple[str, ...] | None = None  # llama.cpp devices to offload to ("RPC0", "CUDA1"; "CPU" = none)
    tensor_split: tuple[float, ...] | None = None  # their shares of the layers (default: by usable memory)


def _env_parallel() -> int | None:
    """``LOCALLLM_NUM_PARALLEL`` (slots per model); unset or 0 = let the planner decide."""
    n = config.env_int("LOCALLLM_NUM_PARALLEL", 0)
    return n if n > 0 else None


def mtp_refusal(name: str, info: dict[str, Any]) -> str:
    """Why ``--draft mtp`` cannot run ``name`` (one sentence): drafting from MTP layers is not built yet, and a
    GGUF without them has nothing to draft from."""
    n = int(info.get("mtp_layers") or 0)
    if n:
        return (f"{name} has {n} multi-token-prediction (MTP) layer{'s' if n > 1 else ''}, but localllm does not "
                "draft from them yet; use --draft ngram, a draft model, or --draft none.")
    arch = info.get("architecture") or "its architecture"
    return (f"{name} has no multi-token-prediction (MTP) layers (no {arch}.nextn_predict_layers in its GGUF), so "
            "--draft mtp has nothing to draft from; MTP builds ship as separate *-MTP-GGUF files.")


class Loader:
    """Plans and loads models of ``store``; thread-safe (it holds no state per model)."""

    def __init__(self, store: Store, *, hardware: HardwareInfo | None = None, backend: str | None = None,
                 backend_class: Callable[[str], type[TokenSource]] | None = None,
                 on_convert: Callable[[ConversionProgress], None] | None = None):
        self.store = store
        self._hardware = hardware
        self._probed = False  # the hardware came from probe() (not given): it may be probed again
        self._backend_class = backend_class or source_class  # backend name -> TokenSource class (tests swap it)
        self.on_convert = on_convert  # first-use MLX conversion progress, for the face to show
        # the backend for requests that leave it to the planner (``LoadOptions.backend == "auto"``)
        self.backend = (backend or config.env_str("LOCALLLM_BACKEND", "auto")).lower()
        choices = BACKEND_CHOICES  # "auto" and every registered backend
        if self.backend not in choices:
            raise LocalLLMError(f"LOCALLLM_BACKEND must be {', '.join(choices[:-1])} or {choices[-1]}, "
                                f"got {self.backend!r}.")
        self._stopped = threading.Event()

    @property
    def hardware(self) -> HardwareInfo:
        """The machine the plans are made for (probed on first use)."""
        if self._hardware is None:
            from localllm.hardware import probe

            self._hardware = probe()
            self._probed = True
        return self._hardware

    @hardware.setter
    def hardware(self, hw: HardwareInfo) -> None:
        self._hardware = hw

    def refresh_hardware(self) -> None:
        """Probe again (a device went away: an RPC worker died), unless the hardware was given."""
        if self._probed:
            from localllm.hardware import probe

            self._hardware = probe(refresh=True)

    def stop(self) -> None:
        """Stop a conversion in progress (at its next progress report); used when the engine closes."""
        self._stopped.set()

    # ------------------------------------------------------------------ plan

    def options(self, options: LoadOptions) -> LoadOptions:
        """``options`` with the loader's backend (``Engine(backend=)`` / ``LOCALLLM_BACKEND``) where it says auto."""
        if options.backend == "auto" and self.backend != "auto":
            return replace(options, backend=self.backend)
        return options

    def plan(self, name: str, options: LoadOptions | None = None) -> tuple[InstalledModel, Plan]:
        """(installed model, plan) without loading anything."""
        from localllm.ggufinfo import info_of
        from localllm.mlxmodels import mlx_for_plan
        from localllm.planner import plan

        options = self.options(options or LoadOptions())
        if options.num_ctx is not None and options.num_ctx < MIN_CTX:
            raise LocalLLMError(f"num_ctx must be at least {MIN_CTX} tokens, got {options.num_ctx}.")
        model = self.store.get(name)
        options = self.model_options(model, options)
        info = info_of(model.info, model.path, model.digest)
        kv = options.kv_cache_type or config.kv_cache_type()
        if options.devices:
            known = [d.name for d in self.hardware.devices]
            unknown = [d for d in options.devices if d not in known]
            if unknown:
                raise LocalLLMError(f"No llama.cpp device {', '.join(unknown)} here (devices: "
                                    f"{', '.join(known) or 'none: llama.cpp is not installed'}).")
            if set(options.devices) == {"CPU"}:
                options = replace(options, num_gpu=0)
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
            projector_bytes=model.projector.size if model.projector is not None else 0,
            projector_kind="+".join(model.projector.kinds) if model.projector is not None else "vision",
            device_memory=config.device_memory(),
            devices=[d for d in options.devices if d != "CPU"] if options.devices else None,
            tensor_split=list(options.tensor_split) if options.tensor_split else None,
            swa_full=config.swa_full(),
        )
        return model, p

    @staticmethod
    def model_options(model: InstalledModel, options: LoadOptions) -> LoadOptions:
        """``options`` with what a model made by ``create`` sets for its load (its ``num_ctx``, ``num_gpu``,
        ``num_thread`` PARAMETERs and its DRAFT) where ``options`` leaves them to the planner."""
        if model.derived is None:
            return options
        p = model.derived.parameters
        changes: dict[str, object] = {}
        if options.num_ctx is None and p.get("num_ctx"):
            changes["num_ctx"] = int(p["num_ctx"])
        if options.num_gpu is None and p.get("num_gpu") is not None and int(p["num_gpu"]) >= 0:
            changes["num_gpu"] = int(p["num_gpu"])
        if options.num_thread is None and p.get("num_thread") and int(p["num_thread"]) > 0:
            changes["num_thread"] = int(p["num_thread"])
        if options.draft == "auto" and model.derived.draft:
            changes["draft"] = model.derived.draft
            if p.get("draft_num_predict"):
                changes["num_draft"] = max(1, min(int(p["draft_num_predict"]), 64))
        return replace(options, **changes) if changes else options  # type: ignore[arg-type]

    @staticmethod
    def check_fits(model: InstalledModel, p: Plan) -> None:
        """Raise :class:`PlanError` (the planner's reason) when ``p`` says the model does not fit this machine."""
        if p.verdict != "too_big":
            return
        why = next((r for r in p.reasons if r.startswith("does not fit")), None)
        if why:
            raise PlanError(why.removeprefix("does not fit: ").rstrip(".") + "; it does not fit this machine.")
        raise PlanError(f"{model.name} does not fit this machine: {'; '.join(p.reasons)}")

    # ------------------------------------------------------------------ load

    def load(self, model: InstalledModel, options: LoadOptions, p: Plan,
             cancel: threading.Event | None) -> tuple[LoadedModel, int]:
        """Load ``model`` as ``p`` says (converting its weights first where the plan asks): (its decode loop,
        load time in ns). ``cancel`` stops a conversion."""
        spec = self.spec(model, options, p)
        before_load = None
        if p.mlx_convert:  # on the thread that will run it (MLX keeps per-thread state)
            from localllm.mlxmodels import mlx_dtype

            def before_load() -> None:
                self._convert(model, cancel, mlx_dtype(p.device))
                spec.model_path = str(model.mlx_path)

        cls = self._backend_class(p.backend)
        t0 = time.perf_counter_ns()
        loaded = LoadedModel(cls, spec, name=model.name, prompt_cache=self.prompt_cache_spec(model, p.backend),
                             before_load=before_load)
        return loaded, time.perf_counter_ns() - t0

    def load_fitting(self, model: InstalledModel, options: LoadOptions, p: Plan,
                     cancel: threading.Event | None, say: Callable[[str], None] | None = None,
                     ) -> tuple[LoadedModel, int, Plan]:
        """:meth:`load`, and where the devices run out of memory at load (the estimate was short, another
        process took memory), fall back with one line each: half the GPU layers, then the CPU. Returns the plan
        that loaded. A load asked for with ``num_gpu`` is not second-guessed."""
        from backends.base import ModelLoadError

        tried_half = False
        while True:
            try:
                loaded, ns = self.load(model, options, p, cancel)
                return loaded, ns, p
            except ModelLoadError as e:
                if p.n_gpu_layers <= 0 or options.num_gpu is not None or p.backend != "llamacpp" \
                        or "memory" not in str(e).lower():
                    raise
                fewer = p.n_gpu_layers // 2 if p.n_gpu_layers > 1 and not tried_half else 0
                tried_half = True
                line = (f"{model.name}: out of device memory at load with {p.n_gpu_layers} layers offloaded; "
                        + (f"loading with {fewer}" if fewer else "loading on the CPU only"))
                (say or log.warning)(line)
                _, p = self.plan(model.name, replace(options, num_gpu=fewer))
                p.reasons.append(line)

    def spec(self, model: InstalledModel, options: LoadOptions, p: Plan) -> LoadSpec:
        """What the backend is given to load ``model`` as planned (``model_path`` set by the conversion when the
        plan converts first)."""
        path = model.weights_path(p.backend)
        template = model.derived.template if model.derived is not None else None  # a Modelfile's TEMPLATE
        several = bool(p.devices and p.n_gpu_layers)  # several llama.cpp devices: exactly these, split as planned
        adapters = model.derived is not None and model.derived.adapters
        return LoadSpec(
            model_path=str(path),
            n_ctx=p.n_ctx,
            n_seq=p.n_seq,
            n_gpu_layers=p.n_gpu_layers,
            n_threads=options.num_thread or p.n_threads,
            kv_cache_type=p.kv_cache_type,  # type: ignore[arg-type]
            flash_attn=None if p.kv_cache_type == "f16" else True,  # llama.cpp decides (auto)
            draft=self.draft_spec(model, options, p.backend),
            embedding=options.embedding,
            # the vision projector, for a backend that runs one (MLX does not: images are refused there)
            mmproj=str(model.projector.path) if model.projector is not None and descriptor.get(p.backend).vision
            else None,
            verbose=os.environ.get("LOCALLLM_DEBUG", "") not in ("", "0"),
            chat_template=template,
            lora=[LoraAdapter(str(path), scale) for path, scale in self.store.adapters_of(model)] if adapters else [],
            devices=[d.name for d in p.devices] if several else [],
            tensor_split=list(p.tensor_split) if several else [],
            # the head sizes read with the model's metadata: a quantized KV cache is checked without the header
            head_dims=(model.info.get("head_dim_k", 0), model.info.get("head_dim_v", 0)),
            swa_full=config.swa_full(),
        )

    def prompt_cache_spec(self, model: InstalledModel, backend: str) -> PromptCacheSpec | None:
        """Where this model's saved prompt prefixes live (``LOCALLLM_PROMPT_CACHE_SIZE``; 0 = none)."""
        size = config.prompt_cache_size()
        if size <= 0 or not model.digest:
            return None
        root = config.paths().prompt_cache
        adapters = model.derived.adapters if model.derived is not None else []
        if adapters:  # a LoRA changes every KV state: its prefixes are not the base weights' prefixes
            return None
        return PromptCacheSpec(str(root / model.digest.removeprefix("sha256:")), f"{model.digest} {backend}",
                               max_bytes=size, budget_root=str(root))

    def draft_spec(self, model: InstalledModel, options: LoadOptions, backend: str) -> DraftSpec | None:
        """The draft ``options.draft`` names (``auto``: the catalog's pairing where it is installed for this
        backend), or None for plain decoding."""
        choice = (options.draft or "auto").strip()
        if choice == "none":
            return None
        if choice == "ngram":
            return DraftSpec(kind="ngram", num_draft=options.num_draft)
        if choice == "mtp":  # self-speculation from the GGUF's own multi-token-prediction layers
            raise LocalLLMError(mtp_refusal(model.name, model.info))
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
        path = draft.weights_path(backend)
        if path is None and choice == "auto":
            return None  # the suggested draft has no build for this backend: plain decoding
        if path is None:
            raise LocalLLMError(f"Draft model {draft.name} has no {backend} weights installed.")
        return DraftSpec(kind="model", path=str(path), num_draft=options.num_draft)

    def _convert(self, model: InstalledModel, cancel: threading.Event | None, dtype: str) -> None:
        """Build the MLX weights of ``model`` from its GGUF (first use of ``--backend mlx``), record them in
        the store and set ``model.mlx_path``. Runs on the model's decode thread before it loads; reports to
        ``on_convert``; ``cancel`` or :meth:`stop` stops it at the next progress report (nothing half-written
        is kept)."""
        from localllm.mlxmodels import ConversionProgress, convert_installed

        notify = self.on_convert
        t0 = time.monotonic()

        def progress(done: int, total: int) -> None:
            if self._stopped.is_set():
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
