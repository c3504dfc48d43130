"""The loader: prepare → load. :meth:`Loader.prepare` is the one place a load is prepared: from a name and
:class:`LoadOptions` it reads the installed model, merges the options (the request's, a created model's
PARAMETERs and DRAFT, the defaults) and makes the planner's :class:`~localllm.planner.Plan` with its memory
estimate: a :class:`Prepared`, what ``probe`` prints, the advice judges and the engine loads. :meth:`Loader.load`
turns it into the :class:`LoadSpec` with its draft (:class:`DraftSpec`) and prompt cache
(:class:`PromptCacheSpec`), prepares the weights the backend takes (an MLX conversion on first use) and starts
the model's decode loop (:class:`backends.core.loop.LoadedModel`). Which models stay loaded, for how long and who
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
from backends.contract.source import TokenSource
from backends.contract.specs import DraftSpec, LoadSpec, LoraAdapter
from backends.core.loop import LoadedModel
from backends.core.prompt_cache import PromptCacheSpec
from backends.registry import source_class
from localllm import config
from localllm.errors import LocalLLMError, ModelNotFoundError, PlanError
from localllm.hardware import BACKEND_CHOICES
from localllm.planner import MIN_CTX

log = logging.getLogger("localllm.loader")

if TYPE_CHECKING:
    from localllm.hardware import HardwareInfo
    from localllm.mlxmodels import ConversionProgress
    from localllm.planner import DevicePlan, Plan
    from localllm.store import InstalledModel, Store



@dataclass(frozen=True)
class LoadOptions:
    """How to load a model. ``None`` means "let the planner decide"."""

    num_ctx: int | None = None
    num_gpu: int | None = None  # layers to offload; None = planner, 0 = CPU
    kv_cache_type: str | None = None  # f16 | q8_0 | q4_0; None = LOCALLLM_KV_CACHE_TYPE
    backend: str = "auto"  # auto (the planner's choice) or a registered backend's name
    draft: str = "auto"  # auto (MTP layers, else the catalog pairing if installed) | none | ngram | mtp | NAME | PATH
    num_draft: int = 4
    num_thread: int | None = None
    embedding: bool = False  # make the embedding context at load (any loaded model embeds on demand)
    num_parallel: int | None = None  # slots; None = LOCALLLM_NUM_PARALLEL, else the planner (4 where it fits)
    devices: tuple[str, ...] | None = None  # llama.cpp devices to offload to ("RPC0", "CUDA1"; "CPU" = none)
    tensor_split: tuple[float, ...] | None = None  # their shares of the layers (default: by usable memory)
    cpu_moe: bool = False  # a mixture of experts: every expert tensor in RAM (llama.cpp --cpu-moe)
    num_cpu_moe: int | None = None  # the first N layers' experts in RAM (--n-cpu-moe N); None = the planner
    grown_from: int = 0  # set by the engine, never a request: num_ctx grew from this context for a long prompt


# the load options a request may choose (each then counts for that load only: :meth:`Loader.chosen`)
REQUEST_LOAD_FIELDS = ("num_ctx", "num_gpu", "num_thread", "kv_cache_type", "num_parallel", "num_cpu_moe", "cpu_moe",
                       "draft")


@dataclass(frozen=True)
class Prepared:
    """A load made ready by :meth:`Loader.prepare`, nothing loaded yet: what ``probe`` prints, the advice judges,
    the engine budgets memory for and then loads (:meth:`Loader.load_fitting`)."""

    model: InstalledModel  # read from the store once
    options: LoadOptions  # the request's, with a created model's PARAMETERs/DRAFT and the loader's backend
    plan: Plan  # the planner's: backend, layers, context, slots, memory (Plan.memory), devices (Plan.devices)

    @property
    def name(self) -> str:
        """The store's canonical name (what the engine keys a loaded model by)."""
        return self.model.name

    @property
    def estimate(self) -> int:
        """Bytes the planner expects this load to take, RAM and device memory together: ``Plan.memory.total``."""
        return int(self.plan.memory.total)

    @property
    def devices(self) -> list[DevicePlan]:
        """The llama.cpp devices the layers go to, in llama.cpp's order, with each one's estimate ([]: one GPU or
        none)."""
        return self.plan.devices

    def check_fits(self) -> None:
        """Raise :class:`PlanError` (the planner's reason) when the plan says the model does not fit this machine."""
        p = self.plan
        if p.verdict != "too_big":
            return
        why = next((r for r in p.reasons if r.startswith("does not fit")), None)
        if why:
            raise PlanError(why.removeprefix("does not fit: ").rstrip(".") + "; it does not fit this machine.")
        raise PlanError(f"{self.model.name} does not fit this machine: {'; '.join(p.reasons)}")


def plan_line(p: Plan) -> str:
    """The plan in one line, as ``probe`` and ``run --verbose`` print it: the planner's summary and the layers
    offloaded, and what a draft adds (a draft model, where its layers go; the rollback states of recurrent memory).

    ``"llama.cpp on CPU, CPU, 4,096-token context, 4 slots, 412 MiB; 0/31 layers offloaded"``
    ``"...; 0/31 layers offloaded; draft model +212 MiB on the CPU"``
    """
    from localllm.hardware import MiB
    from localllm.planner.estimation import _gb

    line = f"{p.summary}; {p.n_gpu_layers}/{p.n_layers + 1} layers offloaded"
    if p.memory.draft:
        where = (f"on {p.draft_device}" if p.draft_device else
                 f"{p.draft_n_gpu_layers} layers offloaded" if p.draft_n_gpu_layers else "on the CPU")
        line += f"; draft model +{_gb(p.memory.draft)} {where}"
    if p.memory.rollback:
        line += f"; draft rollback states +{p.memory.rollback / MiB:.1f} MiB"
    return line


def _env_parallel() -> int | None:
    """``LOCALLLM_NUM_PARALLEL`` (slots per model); unset or 0 = let the planner decide."""
    n = config.env_int("LOCALLLM_NUM_PARALLEL", 0)
    return n if n > 0 else None


def _drafts_mtp(backend: str) -> bool:
    """``backend`` drafts from MTP layers (its descriptor says so); "auto" picks one that does for such a GGUF."""
    return backend == "auto" or backend in {b.name for b in descriptor.drafting_mtp()}


def mtp_refusal(name: str, info: dict[str, Any], backend: str) -> str | None:
    """Why ``--draft mtp`` cannot run ``name`` on ``backend`` (one sentence), or None when it can: drafting from
    multi-token-prediction (MTP) layers needs them in the GGUF and a backend that drafts from them (llama.cpp)."""
    if int(info.get("mtp_layers") or 0) and _drafts_mtp(backend):
        return None
    if int(info.get("mtp_layers") or 0):
        drafters = descriptor.drafting_mtp()
        return (f"{name} has multi-token-prediction (MTP) layers, but only the "
                f"{' or '.join(b.label for b in drafters)} backend drafts from them; "
                f"use {' or '.join(f'--backend {b.name}' for b in drafters)} or --draft none.")
    arch = info.get("architecture") or "its architecture"
    return (f"{name} has no multi-token-prediction (MTP) layers (no {arch}.nextn_predict_layers in its GGUF), so "
            "--draft mtp has nothing to draft from; MTP builds ship as separate *-MTP-GGUF files.")


def mtp_note(info: dict[str, Any], backend: str, draft: str = "auto") -> str | None:
    """What happens to a GGUF's MTP layers in a load (one line), or None when it has none."""
    n = int(info.get("mtp_layers") or 0)
    if not n:
        return None
    layers = f"{n} multi-token-prediction (MTP) layer{'s' if n > 1 else ''}"
    choice = (draft or "auto").strip()
    if not _drafts_mtp(backend):
        labels = " or ".join(b.label for b in descriptor.drafting_mtp())
        return f"the GGUF has {layers}: only the {labels} backend drafts from them (plain decoding here)"
    if choice == "none":
        return f"the GGUF has {layers}: not drafted from (--draft none)"
    if choice not in ("auto", "mtp"):
        return f"the GGUF has {layers}: not drafted from (--draft {choice} drafts instead)"
    return (f"the GGUF has {layers}: it drafts from them (speculative decoding with no second model; paused "
            "while it does not pay; --draft none: off)")


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

    # ------------------------------------------------------------------ prepare

    def options(self, options: LoadOptions) -> LoadOptions:
        """``options`` with the loader's backend (``Engine(backend=)`` / ``LOCALLLM_BACKEND``) where it says auto."""
        if options.backend == "auto" and self.backend != "auto":
            return replace(options, backend=self.backend)
        return options

    def prepare(self, name: str, options: LoadOptions | None = None, *,
                model: InstalledModel | None = None) -> Prepared:
        """Everything about loading ``name`` that is known before it loads, nothing loaded: the installed model
        (the store read once), the options merged (the request's, then a created model's PARAMETERs and DRAFT
        where the request leaves them, the loader's backend where it says auto) and the planner's plan with its
        memory estimate and devices. The one way a load is prepared: the engine loads what this returns; probe,
        the advice (fit verdicts, the TUI) and bench show it. A plan that does not fit is returned
        (``verdict="too_big"``; :meth:`Prepared.check_fits` raises); an impossible request raises. ``model``:
        ``name`` as the caller read it from the store already (then the store is not read).

            prepared = Loader(Store()).prepare("smollm2:135m", LoadOptions(num_ctx=2048))
            prepared.plan.n_ctx      # 2048
            prepared.estimate        # bytes, what the engine makes room for
        """
        options = self.options(options or LoadOptions())
        if options.num_ctx is not None and options.num_ctx < MIN_CTX:
            raise LocalLLMError(f"num_ctx must be at least {MIN_CTX} tokens, got {options.num_ctx}.")
        model = model if model is not None else self.store.get(name)
        options = self.model_options(model, options)
        cores = max(1, self.hardware.logical_cores)
        asked_threads = options.num_thread
        if asked_threads is not None and asked_threads > cores:  # more threads only take turns on the cores
            options = replace(options, num_thread=cores)
        p = self._plan(model, options)
        if asked_threads is not None and asked_threads > cores:
            p.reasons.append(f"threads {cores}: {asked_threads} were asked for, but this process may run on "
                             f"{cores} core{'s' if cores != 1 else ''}")
        if p.memory.draft and (options.draft or "auto").strip() == "auto":
            # the catalog's pairing was not asked for: it never costs the model its fit, context or GPU layers
            alone = self._plan(model, replace(options, draft="none"))
            if alone.fits and (not p.fits or (p.n_ctx, p.n_gpu_layers) < (alone.n_ctx, alone.n_gpu_layers)):
                cost = ("fits this machine only without it" if not p.fits else
                        f"would have {'a smaller context' if p.n_ctx < alone.n_ctx else 'fewer GPU layers'} with it")
                alone.reasons.append(f"draft model {model.catalog.draft if model.catalog else ''} not used: "
                                     f"{model.name} {cost} (--draft NAME: with it)")
                return Prepared(model, replace(options, draft="none"), alone)
        return Prepared(model, options, p)

    def chosen(self, prepared: Prepared, asked: LoadOptions) -> frozenset[str]:
        """The load options ``asked`` chose (a request's, before a created model's PARAMETERs) that make ``prepared``
        differ from the load a request asking for none of them gets (its threads, context, GPU layers, KV type,
        slots, experts, draft): the engine gives a later request that leaves them to the planner the default load
        again instead of this one. A context grown by the engine (``grown_from``) is not a request's choice."""

        fields = [f for f in REQUEST_LOAD_FIELDS if not left_to_planner(getattr(asked, f))
                  and not (f == "num_ctx" and asked.grown_from)]
        if not fields:
            return frozenset()
        plain = replace(asked, num_ctx=None, num_gpu=None, num_thread=None, kv_cache_type=None, num_parallel=None,
                        num_cpu_moe=None, cpu_moe=False, draft="auto", grown_from=0)
        try:
            default = self.prepare(prepared.name, plain, model=prepared.model)
        except LocalLLMError:
            return frozenset(fields)
        p, d = prepared.plan, default.plan
        same = {
            "num_ctx": p.n_ctx == d.n_ctx,
            "num_gpu": p.n_gpu_layers == d.n_gpu_layers,
            "num_thread": (prepared.options.num_thread or p.n_threads) == (default.options.num_thread or d.n_threads),
            "kv_cache_type": p.kv_cache_type == d.kv_cache_type,
            "num_parallel": p.slots == d.slots,
            "num_cpu_moe": p.n_cpu_moe == d.n_cpu_moe,
            "cpu_moe": p.n_cpu_moe == d.n_cpu_moe,
            "draft": (prepared.options.draft, prepared.options.num_draft) == (default.options.draft,
                                                                            default.options.num_draft),
        }
        return frozenset(f for f in fields if not same[f])

    def replan(self, prepared: Prepared, **changes: Any) -> Prepared:
        """``prepared`` planned again with ``changes`` to its options (``num_gpu=``, ``num_ctx=``), the store not
        read again; the options it keeps are the ones asked for (a fallback's ``num_gpu`` is the plan's)."""
        return replace(prepared, plan=self._plan(prepared.model, replace(prepared.options, **changes)))

    def plan(self, name: str, options: LoadOptions | None = None) -> tuple[InstalledModel, Plan]:
        """(installed model, plan): :meth:`prepare`'s two parts, for a caller that needs no more."""
        prepared = self.prepare(name, options)
        return prepared.model, prepared.plan

    def _plan(self, model: InstalledModel, options: LoadOptions) -> Plan:
        """The planner's plan for ``model`` with merged ``options`` on this machine."""
        from localllm import formats
        from localllm.ggufinfo import info_of
        from localllm.planner import plan

        info = info_of(model.info, model.path, model.weights_digest)
        kind, draft = self.draft_of(model, options)
        draft_info = info_of(draft.info, draft.path, draft.weights_digest) if draft is not None else None
        kv = options.kv_cache_type or config.kv_cache_type()
        if options.devices:
            known = [d.name for d in self.hardware.devices]
            unknown = [d for d in options.devices if d not in known]
            if unknown:
                raise LocalLLMError(f"No llama.cpp device {', '.join(unknown)} here (devices: "
                                    f"{', '.join(known) or 'none: llama.cpp is not installed'}).")
            if set(options.devices) == {"CPU"}:
                options = replace(options, num_gpu=0)
        return plan(
            info,
            self.hardware,
            num_ctx=options.num_ctx,
            kv_cache_type=kv,
            backend=options.backend,
            num_gpu=options.num_gpu,
            # each format other than the GGUF: its weights installed / converting on first use / why not
            weights={**{f: formats.PlanWeights(installed=True) for f in model.weights},
                     **formats.for_plan(model, self.hardware, options.backend)},
            num_parallel=options.num_parallel or _env_parallel(),
            projector_bytes=model.projector.size if model.projector is not None else 0,
            projector_kind="+".join(model.projector.kinds) if model.projector is not None else "vision",
            device_memory=config.device_memory(),
            devices=[d for d in options.devices if d != "CPU"] if options.devices else None,
            tensor_split=list(options.tensor_split) if options.tensor_split else None,
            swa_full=config.swa_full(),
            kv_unified=config.kv_unified(),
            flash_attn=config.flash_attention(),
            cpu_moe=options.cpu_moe or config.cpu_moe(),
            num_cpu_moe=options.num_cpu_moe,
            # drafting from the GGUF's own MTP layers (as draft_spec asks for where llama.cpp runs it) costs memory
            mtp_draft=options.num_draft if kind == "mtp" else 0,
            # any draft: its tokens a step are the rollback states recurrent memory keeps (llama.cpp's n_rs_seq)
            num_draft=options.num_draft if kind else 0,
            draft_kind=kind,
            draft=draft_info,  # a draft model, planned beside the target (Plan.draft_n_gpu_layers)
        )

    def draft_of(self, model: InstalledModel, options: LoadOptions) -> tuple[str, InstalledModel | None]:
        """(the kind of draft the load drafts with, "" for none; the draft model where it is one), as
        :meth:`draft_spec` picks it, for the plan: ``auto`` is the GGUF's MTP layers where it has them, else the
        catalog's pairing where it is installed. A draft named but not installed raises :class:`LocalLLMError`."""
        choice = (options.draft or "auto").strip()
        if choice in ("none", "ngram", "mtp"):
            return ("" if choice == "none" else choice), None
        if choice == "auto":
            if int(model.info.get("mtp_layers") or 0) and _drafts_mtp(options.backend):
                return "mtp", None  # (on another backend, draft_spec takes the pairing instead)
            draft_name = model.catalog.draft if model.catalog is not None else None
            if not draft_name:
                return "", None
            try:
                return "model", self.store.get(draft_name)
            except ModelNotFoundError:
                return "", None  # the suggested draft is not installed: plain decoding
        try:
            return "model", self.store.get(choice)
        except ModelNotFoundError as e:
            raise LocalLLMError(f"Draft model {choice} is not installed: {str(e).rstrip('.')}.") from None

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
        if not options.cpu_moe and p.get("cpu_moe") in (True, "true", "True", 1):
            changes["cpu_moe"] = True
        if options.num_cpu_moe is None and p.get("num_cpu_moe") is not None and int(p["num_cpu_moe"]) >= 0:
            changes["num_cpu_moe"] = int(p["num_cpu_moe"])
        if options.num_thread is None and p.get("num_thread") and int(p["num_thread"]) > 0:
            changes["num_thread"] = int(p["num_thread"])
        if options.draft == "auto" and model.derived.draft:
            changes["draft"] = model.derived.draft
            if p.get("draft_num_predict"):
                changes["num_draft"] = max(1, min(int(p["draft_num_predict"]), 64))
        return replace(options, **changes) if changes else options  # type: ignore[arg-type]

    # ------------------------------------------------------------------ load

    def load(self, prepared: Prepared, cancel: threading.Event | None) -> tuple[LoadedModel, int]:
        """Load ``prepared`` as its plan says (converting the weights first where the plan asks): (its decode
        loop, load time in ns). ``cancel`` stops a conversion."""
        model, p = prepared.model, prepared.plan
        spec = self.spec(model, prepared.options, p)
        before_load = None
        if p.mlx_convert:  # on the thread that will run it (MLX keeps per-thread state)
            def before_load() -> None:
                self._convert(model, cancel, p)
                spec.model_path = str(model.weights_path(p.backend))

        cls = self._backend_class(p.backend)
        t0 = time.perf_counter_ns()
        loaded = LoadedModel(cls, spec, name=model.name, prompt_cache=self.prompt_cache_spec(model, p.backend),
                             before_load=before_load)
        return loaded, time.perf_counter_ns() - t0

    def load_fitting(self, prepared: Prepared, cancel: threading.Event | None,
                     say: Callable[[str], None] | None = None) -> tuple[LoadedModel, int, Prepared]:
        """:meth:`load`, and where the devices run out of memory at load (the estimate was short, another
        process took memory), fall back with one line each: a mixture of experts first keeps every expert in RAM
        (``cpu_moe``: its attention stays offloaded), then half the GPU layers, then the CPU (each planned again
        with :meth:`replan`). Returns what loaded. A load asked for with ``num_gpu`` is not second-guessed."""
        from backends.contract.errors import ModelLoadError

        experts_out = False  # a mixture of experts' experts left the device (cpu_moe): the later fallbacks keep that
        tried_half = False
        while True:
            p = prepared.plan
            try:
                loaded, ns = self.load(prepared, cancel)
                return loaded, ns, prepared
            except ModelLoadError as e:
                if p.n_gpu_layers <= 0 or prepared.options.num_gpu is not None \
                        or descriptor.get(p.backend).memory != "layers" \
                        or "memory" not in str(e).lower():
                    raise
                was = f"{prepared.name}: out of device memory at load with {_offload(p)}; "
                first = not (experts_out or tried_half or prepared.options.cpu_moe)
                experts = self.replan(prepared, cpu_moe=True) if first else None
                if experts is not None and experts.plan.n_gpu_layers > 0 and \
                        (experts.plan.n_gpu_layers, experts.plan.n_cpu_moe) != (p.n_gpu_layers, p.n_cpu_moe):
                    experts_out = True  # a mixture of experts: its experts leave the device first
                    prepared, line = experts, was + f"loading with {_offload(experts.plan)}"
                else:
                    fewer = p.n_gpu_layers // 2 if p.n_gpu_layers > 1 and not tried_half else 0
                    tried_half = True
                    prepared = self.replan(prepared, num_gpu=fewer, cpu_moe=experts_out or prepared.options.cpu_moe)
                    line = was + (f"loading with {_offload(prepared.plan)}" if fewer else "loading on the CPU only")
                (say or log.warning)(line)
                prepared.plan.reasons.append(line)

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
            slots=p.slots,
            n_gpu_layers=p.n_gpu_layers,
            n_cpu_moe=p.n_cpu_moe,
            n_threads=options.num_thread or p.n_threads,
            kv_cache_type=p.kv_cache_type,  # type: ignore[arg-type]
            # f16: llama.cpp decides (auto), except where the plan turns it off (the CPU: see planner.layout)
            flash_attn=(True if p.kv_cache_type != "f16" or config.flash_attention() == "on"
                        else None if p.flash_attn else False),
            draft=self.draft_spec(model, options, p.backend, p.draft_n_gpu_layers, p.draft_device),
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
            kv_unified=config.kv_unified(),
            prefill_flash_attn=p.prefill_flash_attn,
        )

    def prompt_cache_spec(self, model: InstalledModel, backend: str) -> PromptCacheSpec | None:
        """Where this model's saved prompt prefixes live (``LOCALLLM_PROMPT_CACHE_SIZE``; 0 = none)."""
        size = config.prompt_cache_size()
        if size <= 0 or not model.weights_digest:
            return None
        root = config.paths().prompt_cache
        adapters = model.derived.adapters if model.derived is not None else []
        if adapters:  # a LoRA changes every KV state: its prefixes are not the base weights' prefixes
            return None
        digest = model.weights_digest
        return PromptCacheSpec(str(root / digest.removeprefix("sha256:")), f"{digest} {backend}",
                               max_bytes=size, budget_root=str(root))

    def draft_spec(self, model: InstalledModel, options: LoadOptions, backend: str,
                   n_gpu_layers: int = 0, device: str | None = None) -> DraftSpec | None:
        """The draft ``options.draft`` names (``auto``: the catalog's pairing where it is installed for this
        backend), or None for plain decoding; a draft model with ``n_gpu_layers`` offloaded (the plan's
        ``draft_n_gpu_layers``), on the llama.cpp ``device`` the plan puts it on (``draft_device``)."""
        choice = (options.draft or "auto").strip()
        if choice == "none":
            return None
        if choice == "ngram":
            return DraftSpec(kind="ngram", num_draft=options.num_draft)
        if choice == "mtp":  # self-speculation from the GGUF's own multi-token-prediction layers
            why = mtp_refusal(model.name, model.info, backend)
            if why:
                raise LocalLLMError(why)
            return DraftSpec(kind="mtp", num_draft=options.num_draft)
        if choice == "auto" and mtp_refusal(model.name, model.info, backend) is None:
            return DraftSpec(kind="mtp", num_draft=options.num_draft, auto=True)  # the GGUF's own MTP layers
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
        return DraftSpec(kind="model", path=str(path), num_draft=options.num_draft, n_gpu_layers=n_gpu_layers,
                         devices=[device] if device else [])

    def _convert(self, model: InstalledModel, cancel: threading.Event | None, p: Plan) -> None:
        """Build the weights ``p.backend`` loads from the model's GGUF (first use of ``--backend mlx``: its format's
        ``convert``), record them in the store and in ``model.weights``. Runs on the model's decode thread before it
        loads; reports to ``on_convert``; ``cancel`` or :meth:`stop` stops it at the next progress report (nothing
        half-written is kept)."""
        from localllm import formats
        from localllm.mlxmodels import ConversionProgress

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
            fmt = formats.of_backend(p.backend)
            weights = formats.Weights(fmt.name, fmt.convert(model, p.device, progress))
        except BaseException as e:
            if notify is not None:
                notify(ConversionProgress(model.name, "failed", seconds=time.monotonic() - t0, error=str(e)))
            raise
        if not model.local:  # a local .gguf path has no manifest: its MLX dir is found by digest
            self.store.set_weights(model.name, fmt.name, weights)
        model.weights[fmt.name] = weights
        if notify is not None:
            notify(ConversionProgress(model.name, "done", seconds=time.monotonic() - t0))


def _offload(p: Plan) -> str:
    """``"31 layers offloaded"``, or ``"5 layers offloaded, every expert in RAM"`` / ``"..., the experts of the
    first 2 layers in RAM"`` for a mixture of experts whose experts stay in RAM (an OOM fallback's line)."""
    text = f"{p.n_gpu_layers} layers offloaded"
    if p.n_cpu_moe >= p.n_layers:
        return text + ", every expert in RAM"
    return text + (f", the experts of the first {p.n_cpu_moe} layers in RAM" if p.n_cpu_moe else "")


def left_to_planner(value: Any) -> bool:
    """Whether a load option's value leaves the choice to the planner (None, False, "auto"; not 0).

    >>> [left_to_planner(v) for v in (None, False, "auto", 0, 8, "none")]
    [True, True, True, False, False, False]
    """
    return value is None or value is False or value == "auto"
