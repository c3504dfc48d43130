"""Step 4 of a plan: the choice — backend, device, context, slots, verdict — and its reasons, one line each."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from backends import descriptor
from backends.descriptor import GGUF, Backend, BackendStatus
from localllm.errors import PlanError
from localllm.formats import PlanWeights
from localllm.ggufinfo import GGUFInfo
from localllm.hardware import HardwareInfo, MiB
from localllm.planner.advice import _device, _registry_device, answer
from localllm.planner.estimation import (
    BACKENDS,
    DEFAULT_CTX,
    DEFAULT_PARALLEL,
    GPU_MARGIN,
    KV_TYPES,
    MAX_PARALLEL,
    MIN_AUTO_CTX,
    MemoryEstimate,
    _gb,
    memory_layout_reason,
    mtp_reason,
    rollback_reason,
)
from localllm.planner.layout import DevicePlan, _Layout, _Planner


@dataclass
class Plan:
    backend: str  # a registered backend's name (backends.descriptor)
    device: Literal["cuda", "metal", "gpu", "cpu"]  # gpu: llama.cpp's other devices (RPC workers, ROCm, Vulkan...)
    n_gpu_layers: int  # llama.cpp's meaning: n_layers + 1 = all layers and the output layer
    n_layers: int
    n_ctx: int
    kv_cache_type: str
    flash_attn: bool
    n_threads: int
    verdict: Literal["gpu", "partial", "cpu", "too_big"]
    verdict_text: str  # "fits on GPU" / "partial offload 20/32 layers" / "CPU" / "does not fit"
    memory: MemoryEstimate
    reasons: list[str] = field(default_factory=list)  # one line per decision
    advice: str | None = None  # how to get a better setup (e.g. a CUDA build of llama.cpp)
    draft_n_gpu_layers: int = 0
    draft_device: str | None = None  # several llama.cpp devices: the one a draft model's layers go to
    max_ctx: int | None = None  # the largest context that would fit the same way (None: not computed)
    mlx_convert: bool = False  # backend MLX from the GGUF: convert it (once, offline) before loading
    slots: int = 1  # parallel slots: sequences decoding together over one KV pool of n_ctx × slots cells
    # where the offloaded layers go, device by device in llama.cpp's order (empty: one GPU, or none)
    devices: list[DevicePlan] = field(default_factory=list)
    shares: list[float] | None = None  # --tensor-split as given (None: by usable memory)
    # a mixture of experts: the first N layers' expert tensors stay in RAM though their layers are offloaded
    # (llama.cpp's --n-cpu-moe N; n_layers: all of them, --cpu-moe); 0 = none
    n_cpu_moe: int = 0
    # llama.cpp on the CPU with flash attention off: long prompt chunks in a second context with it on (its memory in
    # ``memory.prefill``; planner.layout ``prefill_flash``)
    prefill_flash_attn: bool = False

    @property
    def tensor_split(self) -> list[float]:
        """llama.cpp's ``tensor_split`` for :attr:`devices` (``--tensor-split``, else each device's usable
        memory), [] for none."""
        if self.shares and len(self.shares) == len(self.devices):
            return list(self.shares)
        return [float(d.usable_bytes) for d in self.devices]

    @property
    def fits(self) -> bool:
        return self.verdict != "too_big"

    @property
    def summary(self) -> str:
        """One line: ``"llama.cpp on CUDA, fits on GPU, 4,096-token context, 5.9 GiB"``."""
        name = descriptor.get(self.backend).label if self.backend in descriptor.names() else self.backend
        where = {"cuda": "CUDA", "metal": "Metal", "cpu": "CPU", "gpu": "GPU"}[self.device]
        if self.devices and self.device == "gpu":
            where = " + ".join(d.name for d in self.devices)
        slots = f", {self.slots} slots" if self.slots > 1 else ""
        return (f"{name} on {where}, {self.verdict_text}, {self.n_ctx:,}-token context{slots}, "
                f"{_gb(self.memory.total)}")

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["summary"] = self.summary
        return d



@dataclass(frozen=True)
class PlanRequest:
    """What the caller asks of a load (every field optional: the planner decides what is left open).

    ``num_ctx``: a context size to honour (refused with numbers if the model or memory cannot take
    it); None = min(training context, 4096), shrunk to fit. ``num_gpu``: layers to offload (Ollama's
    meaning; 0 = CPU, negative or None = decide). ``weights``: what each weights format other than the GGUF has for
    this model, by format name (:func:`localllm.formats.for_plan`: installed, converts on first use, or why not); each
    backend is judged by its own format's answer, and a format not named has nothing.
    ``draft``: a draft model for speculative decoding, planned beside it. ``num_parallel``: sequences
    decoding at once (slots; one KV pool holds ``n_ctx`` tokens for each); None = 4 where that fits,
    fewer where it does not (the context is kept first). ``projector_bytes``: the size of the model's vision
    or audio projector (an automatic choice then takes a backend that runs it; its memory is counted with the
    weights, on the GPU where layers go there); ``projector_kind`` names it in the reasons ("vision", "audio").
    ``device_memory``: caps per llama.cpp device name ("*" for all; ``LOCALLLM_DEVICE_MEMORY``). ``devices``: only
    these of llama.cpp's devices take layers (``--device``); where the probe lists devices that offload, the
    layers are split over them as llama.cpp splits them (:func:`~localllm.planner.layout.split_layers`,
    ``Plan.devices`` and ``Plan.tensor_split``); ``tensor_split``: the devices' shares instead of their usable
    memory (``--tensor-split 3,1``; one number per device, in that order). ``swa_full``: cache windowed layers
    whole; ``kv_unified``: one KV pool for all slots instead of a stream each (the compute estimate without flash
    attention then spans the pool); ``flash_attn``: "auto" (off on the CPU but for pooling models, on where the GPU
    kernels cover the head size), "on" or "off". ``cpu_moe``: keep every expert tensor of a mixture of experts in RAM;
    ``num_cpu_moe``: those of the first N layers (llama.cpp's ``--cpu-moe`` / ``--n-cpu-moe N``); neither: the
    planner keeps as few in RAM as the device needs. ``mtp_draft``: the load drafts that many tokens a step from the
    model's own MTP layers where llama.cpp runs it (its MTP context and hidden rows are counted; 0: it does not draft
    so). ``num_draft``: the tokens a step any draft proposes (a draft model,
    n-gram, MTP; 0: no drafting, or ``mtp_draft`` where the model drafts from its MTP layers), ``draft_kind`` which
    ("model", "ngram", "mtp"): on recurrent/hybrid memory llama.cpp keeps that many rollback states of each sequence
    (:func:`~localllm.planner.estimation.rollback_bytes`).
    """

    num_ctx: int | None = None
    kv_cache_type: str = "f16"
    backend: str = "auto"
    num_gpu: int | None = None
    draft: GGUFInfo | None = None
    weights: dict[str, PlanWeights] | None = None
    num_parallel: int | None = None
    projector_bytes: int = 0
    projector_kind: str = "vision"
    device_memory: dict[str, int] | None = None
    devices: list[str] | None = None
    tensor_split: list[float] | None = None
    swa_full: bool = False
    kv_unified: bool = False  # LOCALLLM_KV_UNIFIED: one KV pool for all slots (else a stream per slot)
    flash_attn: str = "auto"  # LOCALLLM_FLASH_ATTENTION: auto, on, off
    cpu_moe: bool = False
    num_cpu_moe: int | None = None
    mtp_draft: int = 0
    num_draft: int = 0
    draft_kind: str = ""


def plan(info: GGUFInfo, hw: HardwareInfo, request: PlanRequest | None = None, *, num_ctx: int | None = None,
         kv_cache_type: str = "f16", backend: str = "auto", num_gpu: int | None = None,
         draft: GGUFInfo | None = None, weights: dict[str, PlanWeights] | None = None, num_parallel: int | None = None,
         projector_bytes: int = 0, projector_kind: str = "vision", device_memory: dict[str, int] | None = None,
         devices: list[str] | None = None, tensor_split: list[float] | None = None, swa_full: bool = False,
         kv_unified: bool = False, flash_attn: str = "auto", cpu_moe: bool = False, num_cpu_moe: int | None = None,
         mtp_draft: int = 0, num_draft: int = 0, draft_kind: str = "") -> Plan:
    """Decide how to load ``info`` on ``hw``: ``plan(info, hw, PlanRequest(num_ctx=8192))``, or the same fields
    as keywords (``plan(info, hw, num_ctx=8192)``; :class:`PlanRequest` says what each means). Raises
    :class:`PlanError` for what cannot be done as asked; a model that is simply too big gets
    ``verdict="too_big"``.

    The steps, in order: the request checked (:func:`_checked`), the backend and its device chosen
    (:func:`_choose`), the context and slots fitted (:func:`_fit`), the verdict and the reasons
    (:func:`_verdict`, :func:`_explain`).
    """
    asked = PlanRequest(num_ctx=num_ctx, kv_cache_type=kv_cache_type, backend=backend, num_gpu=num_gpu,
                        draft=draft, weights=weights, num_parallel=num_parallel,
                        projector_bytes=projector_bytes, projector_kind=projector_kind, device_memory=device_memory,
                        devices=devices, tensor_split=tensor_split, swa_full=swa_full, kv_unified=kv_unified,
                        flash_attn=flash_attn, cpu_moe=cpu_moe, num_cpu_moe=num_cpu_moe, mtp_draft=mtp_draft,
                        num_draft=num_draft, draft_kind=draft_kind)
    if request is not None and asked != PlanRequest():
        raise TypeError("plan() takes a PlanRequest or keywords, not both")
    req = request if request is not None else asked
    kv, backend_asked = _checked(info, req)
    choice = _choose(info, hw, req, kv, backend_asked)
    fit = _fit(info, hw, req, choice)
    verdict, verdict_text = _verdict(info, fit)
    mem = _explain(info, hw, req, fit, verdict)
    L = info.n_layers
    lay, pl = fit.lay, fit.pl
    max_ctx = None
    if verdict != "too_big":
        try:
            max_ctx = pl.max_ctx(fit.chosen, fit.device, fit.fa, min(lay.ngl, L + 1), fit.slots, lay.n_cpu_moe)
        except Exception:
            max_ctx = None
    ts = req.tensor_split
    return Plan(backend=fit.chosen.name, device=fit.device, n_gpu_layers=lay.ngl, n_layers=L,  # type: ignore[arg-type]
                n_ctx=fit.n_ctx, kv_cache_type=pl.kv, flash_attn=fit.fa, n_threads=fit.threads,
                verdict=verdict, verdict_text=verdict_text, memory=mem, reasons=fit.reasons,  # type: ignore[arg-type]
                advice="\n".join(fit.advice) or None, draft_n_gpu_layers=lay.draft_ngl, draft_device=lay.draft_device,
                max_ctx=max_ctx,
                slots=fit.slots, devices=lay.devices, shares=ts if ts and len(ts) == len(lay.devices) else None,
                mlx_convert=fit.chosen.weights != GGUF and not choice.answer(fit.chosen).installed,
                n_cpu_moe=lay.n_cpu_moe if fit.chosen.memory == "layers" else 0,
                prefill_flash_attn=fit.chosen.memory == "layers" and bool(lay.mem.prefill))


# ------------------------------------------------------------------------------- 1. the request checked


def _name(info: GGUFInfo) -> str:
    return info.name or os.path.basename(info.path) or "the model"


def _checked(info: GGUFInfo, req: PlanRequest) -> tuple[str, str]:
    """The KV type and backend asked for, normalised; :class:`PlanError` for a request that cannot be met."""
    kv = (req.kv_cache_type or "f16").lower()
    if kv not in KV_TYPES:
        raise PlanError(f"KV cache type {req.kv_cache_type!r} is not one of {', '.join(KV_TYPES)}.")
    backend = (req.backend or "auto").lower()
    if backend not in BACKENDS:
        raise PlanError(f"Backend {backend!r} is not one of {', '.join(BACKENDS)}.")
    if info.n_layers <= 0:
        raise PlanError(f"{os.path.basename(info.path) or info.name} has no layer count in its metadata.")
    ctx_train = info.context_length or 0
    if req.num_ctx is not None:
        if req.num_ctx < 1:
            raise PlanError(f"num_ctx must be a positive number of tokens, got {req.num_ctx}.")
        if ctx_train and req.num_ctx > ctx_train:
            raise PlanError(f"A {req.num_ctx:,}-token context is more than {_name(info)} was trained for "
                            f"({ctx_train:,} tokens).")
    if req.num_cpu_moe is not None and req.num_cpu_moe < 0:
        raise PlanError(f"num_cpu_moe must be 0 or more layers, got {req.num_cpu_moe}.")
    if req.num_parallel is not None and not 1 <= req.num_parallel <= MAX_PARALLEL:
        raise PlanError(f"num_parallel must be between 1 and {MAX_PARALLEL}, got {req.num_parallel}.")
    return kv, backend


# ----------------------------------------------------------------------------------- 2. backend and device


@dataclass
class _Choice:
    """The backend chosen and why: the lines so far, the backends tried before it, the KV type it takes."""

    chosen: Backend
    backend: str  # as asked ("auto" or a name)
    kv: str
    kv_reason: str | None
    weights: dict[str, PlanWeights]  # what each format other than the GGUF has for the model (PlanRequest.weights)
    order: list[Backend]
    status: dict[str, BackendStatus]
    passed: list[Backend]
    reasons: list[str]

    def ready(self, b: Backend) -> bool:
        """Its weights are installed or can be prepared (a GGUF always is)."""
        return b.weights == GGUF or self.answer(b).usable

    def answer(self, b: Backend) -> PlanWeights:
        """What ``b``'s own format has for the model (nothing said: none installed, none converts)."""
        return answer(self.weights, b)


def _choose(info: GGUFInfo, hw: HardwareInfo, req: PlanRequest, kv: str, backend: str) -> _Choice:
    """The backend asked for, else the first of the priority list that runs here and has weights; the KV type it
    can take for this model."""
    name = _name(info)
    reasons: list[str] = []
    weights = dict(req.weights or {})
    order = descriptor.ranked(hw.apple_silicon)  # the priority list for "auto"
    status = {b.name: hw.backend(b.name) for b in order}

    def ready(b: Backend) -> bool:
        return b.weights == GGUF or answer(weights, b).usable

    chosen: Backend
    if backend != "auto":
        chosen = descriptor.get(backend)
        st = status[chosen.name]
        if not st.available:
            raise PlanError(f"--backend {chosen.name} cannot be used here: {st.reason}.")
        if not ready(chosen):
            why_not = answer(weights, chosen).why_not
            if why_not:
                raise PlanError(f"--backend {chosen.name} cannot run {name}: no {chosen.label} weights are installed "
                                f"for it and {why_not[0].lower() + why_not[1:]}.")
            raise PlanError(f"--backend {chosen.name} needs {chosen.label} weights of {name}, and none are installed "
                            f"for it.")
        passed: list[Backend] = []
    else:
        if req.projector_bytes:  # a vision model: the backends that run its projector (MLX: mlx-lm has no vision)
            blind = [b for b in order if not b.vision and status[b.name].available and ready(b)]
            order = [b for b in order if b.vision] or order
            article = "an" if req.projector_kind.startswith("a") else "a"
            for b in blind:
                reasons.append(f"{b.label} not used: it has no vision, and {name} has {article} {req.projector_kind} "
                               "projector")
        chosen = next((b for b in order if status[b.name].available and ready(b)),
                      next((b for b in order if b.weights == GGUF), order[0]))
        passed = order[:order.index(chosen)]  # tried first, and why not is said below

    kv_reason = None
    if kv not in chosen.kv_cache_types:
        raise PlanError(f"{chosen.label} has no {kv} KV cache (it has {', '.join(chosen.kv_cache_types)}).")
    if chosen.kv_problem is not None and kv != "f16":
        why = chosen.kv_problem(kv, info.head_dim_k, info.sliding_window)
        if why:
            if backend != "auto":
                raise PlanError(f"{chosen.label} cannot quantize this model's KV cache to {kv}: {why}.")
            kv_reason = f"KV cache f16: {chosen.label} cannot use {kv} for this model ({why})"
            kv = "f16"
        else:
            kv_reason = f"KV cache {kv}: {chosen.label} kv_bits={8 if kv == 'q8_0' else 4}"
    return _Choice(chosen, backend, kv, kv_reason, weights, order, status, passed, reasons)


# ------------------------------------------------------------------------------- 3. context and slots


@dataclass
class _Fit:
    """The layout chosen: backend, device, context, slots, and the planner that computed it."""

    chosen: Backend
    device: str
    pl: _Planner
    fa: bool
    fa_reason: str | None
    kv_reason: str | None
    n_ctx: int
    slots: int
    lay: _Layout
    candidates: list[int]
    reasons: list[str]
    advice: list[str]
    threads: int = 1


def _fit(info: GGUFInfo, hw: HardwareInfo, req: PlanRequest, c: _Choice) -> _Fit:
    """The device the chosen backend runs on, the first context that fits (shrinking an automatic one), and at it
    the most slots; an automatic MLX choice that does not fit falls back to llama.cpp."""
    name, chosen, backend, num_gpu = _name(info), c.chosen, c.backend, req.num_gpu
    reasons = c.reasons
    advice: list[str] = []
    if req.devices:  # --device: only these of llama.cpp's devices take layers
        hw = replace(hw, devices=[d for d in hw.devices if not d.offloads or d.name in req.devices])
    mtp = _mtp_draft(info, req)
    pl = _Planner(info, hw, c.kv, num_gpu, req.draft, c.answer(chosen).weights_bytes, req.device_memory,
                  swa_full=req.swa_full, kv_unified=req.kv_unified, fa=req.flash_attn, cpu_moe=req.cpu_moe,
                  num_cpu_moe=req.num_cpu_moe, mtp_draft=mtp, num_draft=_num_draft(info, req))
    pl.shares = req.tensor_split
    device = _device(chosen, hw, reasons, advice, name, c.weights, c.passed, c.status, asked=backend != "auto")
    device = _registry_device(chosen, hw, device, reasons)
    if num_gpu == 0 and chosen.memory == "layers" and device != "cpu":
        device = "cpu"
        reasons.append("all layers on the CPU: asked for with num_gpu 0")
    elif num_gpu and num_gpu > 0 and device == "cpu":
        reasons.append(f"num_gpu {num_gpu} ignored: there is no GPU this build can use")

    fa, fa_reason = (False, None) if chosen.memory == "unified" else pl.flash_attn(device)
    ctx_train = info.context_length or 0
    if req.num_ctx is not None:
        candidates = [req.num_ctx]
    else:
        start = min(ctx_train, DEFAULT_CTX) if ctx_train else DEFAULT_CTX
        candidates = [start] + [c_ for c_ in (2048, 1024, MIN_AUTO_CTX) if c_ < start]
    slot_choices = ([req.num_parallel] if req.num_parallel
                    else [s for s in (DEFAULT_PARALLEL, 2, 1) if s <= DEFAULT_PARALLEL])

    def pick(pl_: _Planner, backend_: Backend, device_: str, fa_: bool,
             shrink: bool = True) -> tuple[int, int, _Layout]:
        """The first context that fits, and at it the most slots that fit without moving a layer off the
        GPU (more slots never cost GPU placement: a second request is worth less than speed for the first)."""
        for ctx in candidates if shrink else candidates[:1]:
            base = pl_.layout(backend_, device_, ctx * slot_choices[-1], fa_, slot_choices[-1])
            if not base.fits:
                continue
            for s_ in slot_choices[:-1]:
                lay_ = pl_.layout(backend_, device_, ctx * s_, fa_, s_)
                if lay_.fits and lay_.ngl >= base.ngl and lay_.n_cpu_moe <= base.n_cpu_moe:
                    return ctx, s_, lay_
            return ctx, slot_choices[-1], base
        n = slot_choices[-1]  # nothing fits: describe the smallest setup at the first context
        return candidates[0], n, pl_.layout(backend_, device_, candidates[0] * n, fa_, n)

    # an automatic choice of a unified-memory backend (MLX on Metal) that does not fit goes to the next backend
    # of the priority list that runs here (llama.cpp) rather than to a smaller context
    order = c.order
    later = [b for b in order[order.index(chosen) + 1:] if c.status[b.name].available and c.ready(b)]
    fallback = later[0] if backend == "auto" and chosen.memory == "unified" and device != "cpu" and later else None
    kv_reason = c.kv_reason
    n_ctx, slots, lay = pick(pl, chosen, device, fa, shrink=fallback is None)
    if fallback is not None and not lay.fits:
        reasons.append(f"{chosen.label} not used: {lay.why}; falling back to {fallback.label}"
                       + (", which can keep part of the model on the CPU" if fallback.memory == "layers" else ""))
        chosen, kv_reason = fallback, None
        pl = _Planner(info, hw, (req.kv_cache_type or "f16").lower(), num_gpu, req.draft, caps=req.device_memory,
                      swa_full=req.swa_full, kv_unified=req.kv_unified, fa=req.flash_attn, cpu_moe=req.cpu_moe,
                      num_cpu_moe=req.num_cpu_moe, mtp_draft=mtp, num_draft=_num_draft(info, req))
        device = _device(chosen, hw, reasons, advice, name, c.weights, [], c.status, asked=False)
        device = _registry_device(chosen, hw, device, reasons)
        fa, fa_reason = (False, None) if chosen.memory == "unified" else pl.flash_attn(device)
        n_ctx, slots, lay = pick(pl, chosen, device, fa)
    if lay.mem.prefill:  # the prefill context speeds long prompts up: never at the price of the fit, context or a slot
        pl.prefill_off = True
        ctx2, slots2, lay2 = pick(pl, chosen, device, fa)
        if lay2.fits and (not lay.fits or (ctx2, slots2) > (n_ctx, slots)):
            cost = ("the fit" if not lay.fits else f"context ({n_ctx:,} tokens instead of {ctx2:,})" if ctx2 > n_ctx
                    else f"slots ({slots} instead of {slots2})")
            reasons.append(f"long prompts evaluated without flash attention: its prefill context "
                           f"(+{_gb(lay.mem.prefill)}) would cost {cost}")
            n_ctx, slots, lay = ctx2, slots2, lay2
        else:
            pl.prefill_off = False

    if not lay.fits and req.num_ctx is not None:
        smallest = pl.layout(chosen, device, min(MIN_AUTO_CTX, req.num_ctx), fa)
        if smallest.fits:  # the context is the problem, not the model
            best = pl.max_ctx(chosen, device, fa, 0)
            raise PlanError(f"A {req.num_ctx:,}-token context does not fit: with its "
                            f"{_gb(lay.mem.kv_cache)} KV cache ({pl.kv}) the model {lay.why}; "
                            f"at most about {best or MIN_AUTO_CTX:,} tokens fit.")
    ts = req.tensor_split
    if ts and lay.devices and len(ts) != len(lay.devices):
        raise PlanError(f"--tensor-split has {len(ts)} value{'s' if len(ts) != 1 else ''} for "
                        f"{len(lay.devices)} devices ({', '.join(d.name for d in lay.devices)}): give one each.")
    if ts and any(x < 0 for x in ts) or ts and sum(ts) <= 0:
        raise PlanError("--tensor-split takes shares of 0 or more, at least one above 0 (e.g. 3,1).")
    threads = max(hw.physical_cores or hw.logical_cores or 1, 1)
    return _Fit(chosen, device, pl, fa, fa_reason, kv_reason, n_ctx, slots, lay, candidates, reasons, advice,
                threads)


def _mtp_draft(info: GGUFInfo, req: PlanRequest) -> int:
    """Tokens a step the load drafts from ``info``'s MTP layers (counted in the llama.cpp layout only: no other
    backend drafts from them); 0 when it does not."""
    return max(req.mtp_draft, 0) if info.mtp_layers else 0


def _num_draft(info: GGUFInfo, req: PlanRequest) -> int:
    """Tokens a step the load drafts, whatever drafts them (``num_draft``, else MTP's): the rollback states of
    recurrent memory (counted in the llama.cpp layout only)."""
    return max(req.num_draft, 0) or _mtp_draft(info, req)


# ---------------------------------------------------------------------------------- 4. verdict and reasons


def _on_gpu(n_layers: int, ngl: int) -> str:
    """What llama.cpp's ``-ngl ngl`` puts on the device, in words.

    >>> _on_gpu(32, 10), _on_gpu(32, 1), _on_gpu(32, 0)
    ('9 of 32 layers and the output layer (-ngl 10)', 'the output layer (-ngl 1)', '0 of 32 layers (-ngl 0)')
    """
    off = offloaded_layers(n_layers, ngl)
    if ngl <= 0:
        return f"0 of {n_layers} layers (-ngl 0)"
    return (f"{off} of {n_layers} layers and the output layer" if off else "the output layer") + f" (-ngl {ngl})"


def offloaded_layers(n_layers: int, ngl: int) -> int:
    """Repeating layers llama.cpp offloads with ``n_gpu_layers`` = ``ngl`` (the output layer counts first: ``ngl``
    of ``n_layers`` or fewer puts the last ``ngl - 1`` layers and the output layer on the device).

    >>> offloaded_layers(4, 5), offloaded_layers(4, 3), offloaded_layers(4, 1), offloaded_layers(4, 0)
    (4, 2, 0, 0)
    """
    return max(min(ngl, n_layers + 1) - 1, 0)


def experts_reason(info: GGUFInfo, req: PlanRequest, ngl: int, n_cpu_moe: int, budget_desc: str) -> str:
    """One line on where a mixture of experts' expert tensors are (``probe``, ``run --verbose``)."""
    L, eb = info.n_layers, info.expert_bytes
    ram = sum(eb[:n_cpu_moe])
    of = f"{info.n_experts} experts a layer, {info.n_experts_used} used per token" if info.n_experts else "experts"
    if ngl <= 0:
        return f"experts ({of}) on the CPU with their layers"
    off = offloaded_layers(L, ngl)
    start = L - off  # the first offloaded layer
    in_ram = max(min(n_cpu_moe, L) - start, 0)  # offloaded layers whose experts stay in RAM
    if ngl < L + 1 and in_ram:  # -ngl N with --n-cpu-moe: fewer layers offloaded, their experts in RAM
        where = (f"{off} of {L} layers and the output layer offloaded"
                 + (", their experts in RAM" if in_ram == off else f", the experts of the first {in_ram} in RAM")
                 + f" ({_gb(sum(eb[start:start + in_ram]))} of {_gb(sum(eb[start:]))})")
    else:
        where = (f"experts of the first {n_cpu_moe} of {L} layers in RAM ({_gb(ram)} of {_gb(sum(eb))})"
                 if n_cpu_moe < L else f"experts of all {L} layers in RAM ({_gb(ram)})")
    if req.cpu_moe:
        return f"{where}: asked for with cpu_moe ({of})"
    if req.num_cpu_moe is not None:
        return (f"{where}: asked for with num_cpu_moe {req.num_cpu_moe} ({of})" if n_cpu_moe
                else f"experts on the device with their layers: asked for with num_cpu_moe 0 ({of})")
    if req.num_gpu is not None and req.num_gpu >= 0:
        return f"experts ({of}) with their layers: num_gpu places whole layers"
    if not n_cpu_moe:
        return (f"experts ({of}) on the device with their layers: {_gb(sum(eb))} in all"
                if ngl >= L + 1 else
                f"experts ({of}) with their layers: even with their experts in RAM no more layers fit on the device "
                f"({budget_desc}), so whole layers are split")
    if ngl < L + 1:
        return (f"{where}: even with every expert in RAM the device ({budget_desc}) cannot hold every layer's "
                f"attention, router and shared tensors, so only the last layers go there, without their experts, "
                f"and the CPU runs the rest (llama.cpp's -ngl {ngl} --n-cpu-moe {n_cpu_moe}; {of})")
    return (f"{where}: every layer's attention, router and shared tensors fit on the device ({budget_desc}) but "
            f"not every expert; the rest stay on the CPU, which runs them for each token ({of})")


def _verdict(info: GGUFInfo, fit: _Fit) -> tuple[str, str]:
    L, lay = info.n_layers, fit.lay
    if not lay.fits:
        return "too_big", "does not fit"
    if fit.chosen.memory == "unified":
        return ("gpu", "fits on GPU") if fit.device != "cpu" else ("cpu", "CPU")
    if lay.ngl >= L + 1 and lay.n_cpu_moe:
        return "partial", f"experts of {lay.n_cpu_moe}/{L} layers in RAM"
    if lay.ngl >= L + 1:
        return "gpu", "fits on GPU"
    if lay.ngl > 0:
        return "partial", f"partial offload {lay.ngl}/{L + 1} layers" + (
            ", experts in RAM" if lay.n_cpu_moe > L - offloaded_layers(L, lay.ngl) else "")
    return "cpu", "CPU"


def _explain(info: GGUFInfo, hw: HardwareInfo, req: PlanRequest, fit: _Fit, verdict: str) -> MemoryEstimate:
    """Appends the reason lines of the memory, placement, context, KV cache and threads to ``fit.reasons``;
    returns the memory estimate with the projector counted."""
    name, chosen, device, lay, pl = _name(info), fit.chosen, fit.device, fit.lay, fit.pl
    n_ctx, slots = fit.n_ctx, fit.slots
    reasons, L, mem = fit.reasons, info.n_layers, fit.lay.mem
    ctx_train = info.context_length or 0
    projector_bytes, projector_kind, num_gpu = req.projector_bytes, req.projector_kind, req.num_gpu
    if projector_bytes:
        on_gpu = device != "cpu" and (chosen.memory == "unified" or lay.ngl > 0)
        mem = replace(mem, weights=mem.weights + projector_bytes, total=mem.total + projector_bytes,
                      gpu=mem.gpu + (projector_bytes if on_gpu else 0),
                      cpu=mem.cpu + (0 if on_gpu else projector_bytes))
        reasons.append(f"{projector_kind} projector {_gb(projector_bytes)} " + (
            "on the GPU with the model" if on_gpu else "on the CPU") if chosen.vision else
            f"{projector_kind} projector {_gb(projector_bytes)} not used: {chosen.label} has no vision ("
            + {"audio": "audio is refused", "vision+audio": "images and audio are refused"}.get(
                projector_kind, "images are refused") + ")")
    reasons.append(f"memory {mem.describe(n_ctx * slots, pl.kv)}")
    if chosen.memory == "layers" and (info.swa_layers or info.recurrent_layers):
        reasons.append(memory_layout_reason(info, n_ctx * slots, pl.kv, slots, req.swa_full))
    if mem.mtp and chosen.memory == "layers":
        reasons.append(mtp_reason(info, n_ctx * slots, pl.kv, slots, pl.mtp_draft, fit.fa))
    if mem.rollback and chosen.memory == "layers":
        kind = req.draft_kind or ("model" if req.draft is not None else "mtp" if pl.mtp_draft else "")
        reasons.append(rollback_reason(info, slots, pl.num_draft, kind))
    if req.num_parallel:
        reasons.append(f"{slots} parallel slot{'s' if slots > 1 else ''}: asked for with num_parallel")
    elif slots == DEFAULT_PARALLEL:
        reasons.append(f"{slots} parallel slots: requests decode together, one KV pool of {n_ctx:,} tokens each")
    elif verdict != "too_big":
        reasons.append(f"{slots} parallel slot{'s' if slots > 1 else ''}: fewer than {DEFAULT_PARALLEL} so the "
                       f"{n_ctx:,}-token context fits")
    mw = answer(req.weights or {}, chosen)
    if chosen.weights != GGUF and mw.weights_bytes:
        reasons.append(f"{chosen.label} weights {_gb(mw.weights_bytes)}: " + (
            f"the installed {chosen.label} directory" if mw.installed
            else "the conversion's size (requantized tensors counted)") + f"; the GGUF is {_gb(info.file_size)}")
    budget, _, budget_desc = pl.gpu_budget(device)
    if verdict == "too_big":
        reasons.append(f"does not fit: {name} {lay.why}")
    elif chosen.memory == "layers" and device != "cpu":
        if num_gpu is not None and num_gpu >= 0:
            over = mem.gpu > budget
            reasons.append(f"{_on_gpu(L, lay.ngl)} on the GPU: asked for with num_gpu {num_gpu}"
                           + (f"; the estimate ({_gb(mem.gpu)}) exceeds {budget_desc}, loading may fail"
                              if over else ""))
        elif lay.ngl >= L + 1:
            reasons.append(f"all {L} layers and the output layer on the GPU: {_gb(mem.gpu)} of {budget_desc}"
                           + (", the experts of some in RAM (below)" if lay.n_cpu_moe else ""))
        elif verdict == "partial":
            reasons.append(f"{_on_gpu(L, lay.ngl)} on the GPU: as many as fit in {budget_desc} "
                           f"(keeping {GPU_MARGIN // MiB} MiB spare); the rest run on the CPU, slower")
        else:
            reasons.append(f"no layer fits on the GPU ({budget_desc}): CPU only")
        if info.expert_bytes:
            reasons.append(experts_reason(info, req, lay.ngl, lay.n_cpu_moe, budget_desc))
        for d in lay.devices:  # several llama.cpp devices: what each takes
            if d.layers or d.output:
                reasons.append(f"{d.name} ({d.description}): {d.layers} layers"
                               + (" and the output layer" if d.output else "")
                               + f", {_gb(d.total)} of {_gb(d.usable_bytes)} usable")
    elif chosen.memory == "unified" and device == "metal":
        reasons.append(f"{chosen.label} keeps the model in unified memory: {_gb(mem.gpu)} of {budget_desc}")
    if verdict != "too_big" and hw.ram_available and (mem.total if device == "metal" else mem.cpu) > hw.ram_available:
        reasons.append(f"RAM is tight: the CPU side needs {_gb(mem.total if device == 'metal' else mem.cpu)} and "
                       f"{_gb(hw.ram_available)} is free now; other programs may be paged out")

    if not hw.ram_total:
        reasons.append("RAM size unknown: the model was not checked against system memory")
    if req.num_ctx is not None:
        reasons.append(f"context {n_ctx:,} tokens: as asked" + (f" (trained for {ctx_train:,})" if ctx_train else ""))
    elif n_ctx < fit.candidates[0] and verdict != "too_big":
        reasons.append(f"context {n_ctx:,} tokens: reduced from {fit.candidates[0]:,} so the model fits")
    else:
        reasons.append(f"context {n_ctx:,} tokens: the default, min(model's {ctx_train:,}, {DEFAULT_CTX:,})"
                       if ctx_train else f"context {n_ctx:,} tokens: the default (the model states none)")
    if info.sliding_window:
        reasons.append(f"sliding-window attention (window {info.sliding_window:,}): {chosen.label} keeps a "
                       f"full-size cache by default (swa_full), so the KV figure counts every layer at full context"
                       if chosen.memory == "layers" else
                       f"sliding-window attention (window {info.sliding_window:,}): the KV figure is an upper bound")
    per_tok = info.kv_bytes_per_token(pl.kv)
    # the pool's; the prefill context's cells (one slot's) are in its own line
    pool_kv = mem.kv_cache - (info.memory_bytes(n_ctx, pl.kv, slots=1, swa_full=req.swa_full) if mem.prefill else 0)
    reasons.append(fit.kv_reason or f"KV cache {pl.kv}: {per_tok / 1024:,.1f} KiB per token"
                   + (f", {_gb(pool_kv)} for {n_ctx * slots:,} tokens"
                      + (f" ({slots} slots × {n_ctx:,})" if slots > 1 else "") if mem.kv_cache else ""))
    if fit.fa_reason:
        reasons.append(fit.fa_reason)
    if mem.prefill:
        reasons.append(pl.prefill_reason(mem))
    reasons.append(f"threads {fit.threads}: the physical cores this process may run on (hyper-threads do not speed "
                   "up generation)")
    draft = req.draft
    if draft is not None:
        where = (f"on {lay.draft_device}, all {lay.draft_ngl} layers" if lay.draft_device else
                 f"{lay.draft_ngl}/{draft.n_layers + 1} layers on the GPU" if lay.draft_ngl else "on the CPU")
        reasons.append(f"draft model {draft.name or os.path.basename(draft.path)}: +{_gb(mem.draft)} {where} (its "
                       f"weights, a {n_ctx:,}-token KV cache and its compute buffer); --draft none: without it")
    if info.is_recurrent or info.is_hybrid:
        reasons.append(f"{info.architecture} is a recurrent/hybrid architecture: the KV estimate is approximate")
    return mem
