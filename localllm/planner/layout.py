"""Step 2 of a plan: where the bytes go — layers offloaded to a GPU (or split over llama.cpp's devices as
llama.cpp splits them), or one unified pool (MLX), and the largest context that keeps that placement.

Layers are offloaded like Ollama's ``EstimateGPULayers``: all of them (plus the output layer) when they fit in
free VRAM minus a 512 MiB margin, else as many as fit. ``n_gpu_layers`` follows llama.cpp: ``n_layers + 1``
means every layer and the output layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from backends.descriptor import Backend
from localllm.ggufinfo import GGUFInfo
from localllm.hardware import GiB, HardwareInfo, MiB, metal_budget_rule
from localllm.planner.estimation import (
    CUDA_OVERHEAD,
    FA_HEAD_DIMS,
    GPU_MARGIN,
    HOST_OVERHEAD,
    MIN_AUTO_CTX,
    N_UBATCH,
    MemoryEstimate,
    _gb,
    _mlx_estimate,
    _weights,
    by_stream,
    estimate,
    mtp_bytes,
    rollback_bytes,
)


@dataclass
class DevicePlan:
    """One llama.cpp device the plan puts layers on, with the planner's estimate of what it allocates there."""

    name: str  # "RPC0", "CUDA0", "ROCm0"...
    description: str  # "127.0.0.1:50052", "NVIDIA GeForce RTX 4090"
    usable_bytes: int  # free memory minus the margin, capped by LOCALLLM_DEVICE_MEMORY (its share of the split)
    layers: int = 0  # repeating layers placed here
    output: bool = False  # the output layer is here
    weights: int = 0
    kv_cache: int = 0
    compute: int = 0
    draft: int = 0  # a draft model placed here whole (its weights, KV cache and compute buffer)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.compute + self.draft



# -------------------------------------------------------------------------------------------- plan


def _ram_limit(hw: HardwareInfo) -> int:
    """RAM the model may take: all of it but a share the OS keeps (1 GiB or 10 %, the larger)."""
    return hw.ram_total - max(GiB, hw.ram_total // 10) if hw.ram_total else 1 << 62


@dataclass
class _Layout:
    mem: MemoryEstimate
    ngl: int
    draft_ngl: int
    fits: bool
    why: str  # the limiting resource when it does not fit, with numbers
    devices: list[DevicePlan] = field(default_factory=list)
    n_cpu_moe: int = 0  # the first N layers' expert tensors stay in RAM (llama.cpp's --n-cpu-moe)
    draft_device: str | None = None  # the llama.cpp device a draft model goes to whole (several devices)


def _targets(hw: HardwareInfo, device: str, caps: dict[str, int]) -> list[DevicePlan]:
    """The llama.cpp devices layers may go to for ``device``, with what each can take: free memory minus
    GPU_MARGIN, capped by ``caps`` (LOCALLLM_DEVICE_MEMORY: a device's name, or "*" for all). [] where the probe
    has no device list (a simulated probe, MLX): the single-budget path then counts the memory."""
    if device == "gpu":
        devs = hw.offload_devices
    elif device == "cuda":
        devs = [d for d in hw.offload_devices if d.backend in ("CUDA", "RPC")]
        if not any(d.remote for d in devs):
            return []  # NVML's view, as before (its free memory and per-GPU CUDA overhead)
    else:
        return []
    out = []
    for d in devs:
        usable = max(d.free_bytes - GPU_MARGIN, 0)
        cap = caps.get(d.name, caps.get("*"))
        if cap is not None:
            usable = min(usable, cap)
        out.append(DevicePlan(d.name, d.description, usable))
    return out


def split_layers(info: GGUFInfo, ngl: int, n_ctx: int, kv_cache_type: str, flash_attn: bool,
                 targets: list[DevicePlan], shares: list[float] | None = None, *, slots: int = 1,
                 swa_full: bool = False, n_cpu_moe: int = 0, mtp_draft: int = 0,
                 num_draft: int = 0) -> list[DevicePlan]:
    """Place ``ngl`` offloaded layers on ``targets`` as llama.cpp does (``llama_model::load_tensors``: split
    points from the devices' shares, the last layers offloaded first, the output layer last) and estimate
    each device's weights, KV cache and compute buffer; the experts of the first ``n_cpu_moe`` layers stay in RAM
    (their layer's device does not hold them). ``mtp_draft``: drafting from the MTP layers (:func:`mtp_bytes`): the
    MTP context's cache goes with the last layer (the MTP layers are the last), its compute buffer with the output
    layer. ``num_draft``: any draft's tokens a step (``mtp_draft`` where 0): the rollback states of recurrent memory
    (:func:`rollback_bytes`) go with the layers, as the KV cache."""
    from bisect import bisect_right

    n = len(targets)
    if not n:
        return []
    L = max(info.n_layers, 1)
    # each device's share: --tensor-split's, else its usable memory (llama.cpp's own default is free memory)
    shares = list(shares) if shares and len(shares) == n else [float(t.usable_bytes) for t in targets]
    if sum(shares) <= 0:
        shares = [1.0] * n
    cum, acc = [], 0.0
    for x in shares:
        acc += x
        cum.append(acc / sum(shares))
    w = _weights(info)
    start = max(L + 1 - ngl, 0)
    act = max(min(ngl, L + 1), 1)
    m = mtp_bytes(info, n_ctx, kv_cache_type, slots, mtp_draft, flash_attn) if mtp_draft and info.mtp_layers else {}
    rollback = rollback_bytes(info, slots, num_draft or (mtp_draft if info.mtp_layers else 0))
    kv_layer = (info.memory_bytes(n_ctx, kv_cache_type, slots=slots, swa_full=swa_full) + rollback) / L
    out = [replace(t, layers=0, output=False, weights=0, kv_cache=0, compute=0) for t in targets]
    for il in range(start, L + 1):
        j = min(bisect_right(cum, (il - start) / act), n - 1)
        if il < L:
            out[j].layers += 1
            out[j].weights += (w.layers[il] - w.moved(il, il + 1, n_cpu_moe)) if il < len(w.layers) else 0
            out[j].kv_cache += int(kv_layer) + (m.get("cache", 0) if il == L - 1 else 0)
        else:
            out[j].output = True
            out[j].weights += w.output
            out[j].compute += m.get("compute", 0)  # the MTP context's: with the output head it ends in
    b = min(n_ctx, N_UBATCH)
    e, h, v = info.n_embd, max(info.n_head, 1), info.vocab_size
    # a device's compute buffer, per row of the batch: the layer's activations (~15 × n_embd floats), or on the
    # device with the output layer the logits, plus the attention over the pool (2 floats per cell with flash
    # attention; the whole score matrix without). Fitted to llama.cpp's allocations on the default model at 512 and
    # 2,048 cells (within 3 %, benchmarks/rpc.py); Ollama's GraphSize counts the single-GPU case.
    attn = 2 * n_ctx if flash_attn else n_ctx * (1 + h)
    for d in out:
        if d.layers or d.output:
            # the buffer is the largest node's, not a sum: the logits outweigh a layer where the output is
            d.compute += 4 * b * (attn + (e + v if d.output else 15 * e))
    return out


class _Planner:
    def __init__(self, info: GGUFInfo, hw: HardwareInfo, kv: str, num_gpu: int | None, draft: GGUFInfo | None,
                 mlx_bytes: int | None = None, caps: dict[str, int] | None = None, swa_full: bool = False,
                 kv_unified: bool = False, fa: str = "auto", cpu_moe: bool = False, num_cpu_moe: int | None = None,
                 mtp_draft: int = 0, num_draft: int = 0):
        self.info, self.hw, self.kv, self.num_gpu, self.draft = info, hw, kv, num_gpu, draft
        self.swa_full = swa_full
        self.kv_unified = kv_unified  # one KV pool for all slots (LOCALLLM_KV_UNIFIED), else a stream per slot
        self.fa = fa  # LOCALLLM_FLASH_ATTENTION: auto (off on the CPU, see flash_attn), on, off
        self.mtp_draft = mtp_draft  # tokens a step drafted from the model's MTP layers on llama.cpp (0: none)
        self.num_draft = num_draft  # tokens a step any draft proposes (0: none): rollback states on recurrent memory
        # the experts kept in RAM as asked: all layers' (cpu_moe), the first N layers' (num_cpu_moe), else decided
        self.moe_asked: int | None = (info.n_layers if cpu_moe else min(max(num_cpu_moe, 0), info.n_layers)
                                      if num_cpu_moe is not None else None)
        self.mlx_bytes = mlx_bytes
        self.caps = caps or {}
        self.prefill_off = False  # no flash-attention prefill context even where it would apply (it does not fit)
        self.shares: list[float] | None = None  # --tensor-split
        self.L = info.n_layers

    # device budget -------------------------------------------------------------------------
    def gpu_budget(self, device: str) -> tuple[int, int, str]:
        """(usable bytes, number of GPUs, description) for ``device``."""
        targets = _targets(self.hw, device, self.caps)
        if targets:
            names = " + ".join(f"{t.name} ({t.description})" if t.description else t.name for t in targets)
            return (sum(t.usable_bytes for t in targets), len(targets),
                    f"{_gb(sum(t.usable_bytes for t in targets))} usable on {names}")
        if device == "cuda":
            gpus = self.hw.nvidia_gpus
            usable = sum(max(g.free_bytes - GPU_MARGIN, 0) for g in gpus)
            names = " + ".join(g.name for g in gpus)
            return usable, len(gpus), f"{_gb(sum(g.free_bytes for g in gpus))} free VRAM on {names}"
        if device == "metal":
            budget = self.hw.metal_budget or metal_budget_rule(self.hw.ram_total)
            return max(budget - GPU_MARGIN, 0), 1, f"the {_gb(budget)} Metal working-set budget"
        return 0, 0, "no GPU"

    def flash_attn(self, device: str) -> tuple[bool, str]:
        if self.kv != "f16":
            return True, f"flash attention on: llama.cpp needs it for a quantized ({self.kv}) V cache"
        if self.fa == "on":
            return True, "flash attention on (LOCALLLM_FLASH_ATTENTION=on)"
        if self.fa == "off":  # the CPU kernel walks the cached keys one at a time: off is faster deep in a context
            return False, ("flash attention off (LOCALLLM_FLASH_ATTENTION=off): new tokens deep in a long context go "
                           "several times faster on the CPU; answers then depend on what else is in the batch")
        i = self.info
        if device in ("cuda", "metal") and i.head_dim_k == i.head_dim_v and i.head_dim_k in FA_HEAD_DIMS:
            return True, (f"flash attention on: the GPU kernels cover head size {i.head_dim_k}, and it saves "
                          f"the n_ctx × batch attention buffer")
        if device == "cpu" and i.pooling:  # the whole input in one batch: the kernel's tiled path
            return True, "flash attention: llama.cpp's auto setting (on) for a pooling model's whole-input batches"
        if device == "cpu":  # the kernel takes a short batch's cached keys one at a time (benchmarks/README.md)
            return False, ("flash attention off on the CPU: decoding a few thousand tokens into a context runs ~2x "
                           "as fast and a short next turn ~6x; a long cold prompt takes longer without it (3k "
                           "tokens: ~35%), which the prefill context wins back where each slot has a KV stream; "
                           "LOCALLLM_FLASH_ATTENTION=on turns it on")
        if device == "gpu":
            return True, "flash attention: llama.cpp's auto setting (on where the devices run it, as RPC workers do)"
        return False, "flash attention off: the GPU kernels do not cover this head size"

    def prefill_flash(self, device: str, fa: bool, slots: int) -> bool:
        """Whether llama.cpp evaluates long prompt chunks in a second context with flash attention on
        (``LoadSpec.prefill_flash_attn``, :mod:`backends.llamacpp._prefill`): where flash attention is off by this
        plan's own choice on the CPU (not asked off), the V cache is f16, each slot has a KV stream
        (:func:`by_stream`) and no MTP draft reads the hidden states."""
        return (device == "cpu" and not fa and self.fa == "auto" and self.kv == "f16" and not self.mtp_draft
                and not self.prefill_off and by_stream(self.info, slots, self.kv_unified))

    def prefill_reason(self, mem: MemoryEstimate) -> str:
        return (f"long prompts: chunks of 128 tokens or more evaluated with flash attention on, in a second one-slot "
                f"context (+{_gb(mem.prefill)}), their cells then moved to the slot's KV stream: a cold 3,000-token "
                f"prompt as fast as llama-server's (1.16x its time without it)")

    # llama.cpp layout ------------------------------------------------------------------------
    def llama_layout(self, device: str, n_ctx: int, fa: bool, slots: int = 1) -> _Layout:
        info, hw = self.info, self.hw
        budget, n_gpus, _ = self.gpu_budget(device)

        def est(ngl: int, n_moe: int = 0) -> MemoryEstimate:
            return estimate(info, n_ctx, self.kv, ngl, flash_attn=fa, device=device, n_gpus=n_gpus, slots=slots,
                            swa_full=self.swa_full, n_cpu_moe=n_moe, mtp_draft=self.mtp_draft,
                            num_draft=self.num_draft, kv_unified=self.kv_unified,
                            prefill_flash=self.prefill_flash(device, fa, slots))

        def draft_est(ngl: int) -> MemoryEstimate:
            assert self.draft is not None  # one slot of context, two sequence ids (backends.core.drafting.setup_draft)
            m = estimate(self.draft, n_ctx // max(slots, 1), self.kv, ngl, flash_attn=fa, device=device,
                         n_gpus=n_gpus, slots=1, swa_full=self.swa_full)
            m.overhead -= HOST_OVERHEAD  # one process
            m.cpu -= HOST_OVERHEAD
            m.total -= HOST_OVERHEAD
            if ngl:  # the CUDA context is shared too
                shared = CUDA_OVERHEAD * n_gpus if device == "cuda" else 0
                m.overhead, m.gpu, m.total = m.overhead - shared, m.gpu - shared, m.total - shared
            m.draft = m.total
            return m

        full = self.L + 1
        draft_ngl = 0
        targets = _targets(hw, device, self.caps)
        if targets and device != "cpu":
            lay = self._devices_layout(targets, device, n_ctx, fa, est, slots)
            if self.draft is None or not lay.fits:
                return lay
            # a draft model goes whole to the device with the most room left by the target's split where every
            # layer of the target is offloaded and it fits there (the target's split does not move), else the CPU
            dfull = self.draft.n_layers + 1
            dgpu = draft_est(dfull)
            dest = max(lay.devices, key=lambda d: d.usable_bytes - d.total, default=None)
            if lay.ngl == full and dest is not None and dest.total + dgpu.gpu <= dest.usable_bytes:
                dest.draft = dgpu.gpu
                lay.draft_ngl, lay.draft_device = dfull, dest.name
                lay.mem = lay.mem + dgpu
            else:
                lay.mem = lay.mem + draft_est(0)
            if lay.mem.cpu > _ram_limit(hw):
                lay.fits, lay.why = False, (f"needs {_gb(lay.mem.cpu)} of RAM for the CPU part and the draft model, "
                                            f"more than the {_gb(_ram_limit(hw))} this machine can give it")
            return lay
        ngl, n_moe = self._place(device, lambda ngl_, n_: est(ngl_, n_).gpu <= budget)
        mem = est(ngl, n_moe)
        if self.draft is not None:
            dfull = self.draft.n_layers + 1
            if ngl == full and device != "cpu" and mem.gpu + draft_est(dfull).gpu <= budget:
                draft_ngl = dfull
            mem = mem + draft_est(draft_ngl)
        ram_limit = _ram_limit(hw)
        ram_need = mem.total if device == "metal" else mem.cpu  # unified memory on Apple Silicon
        if ram_need > ram_limit:
            return _Layout(mem, ngl, draft_ngl, False,
                           f"needs {_gb(ram_need)} of RAM{' for the CPU part' if ngl else ''}, "
                           f"more than the {_gb(ram_limit)} this machine can give it "
                           f"({_gb(hw.ram_total)} total)", n_cpu_moe=n_moe)
        return _Layout(mem, ngl, draft_ngl, True, "", n_cpu_moe=n_moe)

    def _place(self, device: str, fits: Callable[[int, int], bool]) -> tuple[int, int]:
        """(layers offloaded, llama.cpp's meaning; the first N layers whose experts stay in RAM). ``fits(ngl, n)``:
        that placement fits the device(s). Every layer when it fits; else, for a mixture of experts, every layer
        with the experts of as few first layers as fit kept in RAM (llama.cpp's ``--n-cpu-moe N``: attention,
        router and shared tensors stay on the device, where they are used for every token); else, when even every
        expert in RAM leaves too little room, as many whole layers as fit *with their experts in RAM* (llama.cpp's
        ``-ngl N --cpu-moe``), the rest on the CPU, then the experts of the last offloaded layers back on the
        device while they fit; else (a dense model) as many whole layers as fit. ``num_gpu`` forces whole layers;
        ``cpu_moe``/``num_cpu_moe`` force the experts."""
        full, L = self.L + 1, self.L
        moe = bool(self.info.expert_bytes) and device != "cpu"
        n_moe = (self.moe_asked or 0) if moe else 0
        if device == "cpu":
            return 0, 0
        if self.num_gpu is not None and self.num_gpu >= 0:
            ngl = min(self.num_gpu, full)
            return ngl, n_moe if ngl else 0
        if fits(full, n_moe):
            return full, n_moe
        auto_moe = moe and self.moe_asked is None
        if auto_moe and fits(full, L):
            return full, self._fewest_in_ram(full, fits)
        if auto_moe:
            n_moe = L  # the offloaded layers' experts in RAM while fewer layers are offloaded
        lo, hi = 0, full  # whole layers: fits(lo) (0 layers take no device memory), not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid, n_moe) else (lo, mid)
        if not lo:
            return 0, 0
        if auto_moe:
            n_moe = self._fewest_in_ram(lo, fits)
            # the experts of layers that are not offloaded are on the CPU anyway: none of an offloaded one in RAM
            n_moe = 0 if n_moe <= max(L + 1 - lo, 0) else n_moe
        return lo, n_moe

    def _fewest_in_ram(self, ngl: int, fits: Callable[[int, int], bool]) -> int:
        """The fewest first layers whose experts stay in RAM with ``ngl`` layers offloaded; ``fits(ngl, L)``."""
        lo, hi = 0, self.L  # fits(ngl, hi); device memory falls with every layer's experts
        if fits(ngl, lo):
            return 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(ngl, mid) else (mid, hi)
        return hi

    def _devices_layout(self, targets: list[DevicePlan], device: str, n_ctx: int, fa: bool,
                        est: Callable[[int, int], MemoryEstimate], slots: int = 1) -> _Layout:
        """Several llama.cpp devices (RPC workers, ROCm/Vulkan GPUs): the most layers with every device's
        estimate inside its own usable memory."""

        def placed(ngl: int, n_moe: int) -> list[DevicePlan]:
            return split_layers(self.info, ngl, n_ctx, self.kv, fa, targets, self.shares, slots=slots,
                                swa_full=self.swa_full, n_cpu_moe=n_moe, mtp_draft=self.mtp_draft,
                                num_draft=self.num_draft)

        ngl, n_moe = self._place(device, lambda ngl_, n_: all(d.total <= d.usable_bytes for d in placed(ngl_, n_)))
        devs = placed(ngl, n_moe) if ngl else []
        mem = est(ngl, n_moe)
        gpu = sum(d.total for d in devs)
        mem = replace(mem, gpu=gpu, cpu=mem.total - gpu)
        ram_limit = _ram_limit(self.hw)
        if mem.cpu > ram_limit:
            return _Layout(mem, ngl, 0, False, f"needs {_gb(mem.cpu)} of RAM for the CPU part, more than the "
                                               f"{_gb(ram_limit)} this machine can give it", devs, n_moe)
        return _Layout(mem, ngl, 0, True, "", devs, n_moe)

    def mlx_layout(self, device: str, n_ctx: int) -> _Layout:
        mem = _mlx_estimate(self.info, n_ctx, self.kv, on_gpu=device != "cpu", weights_bytes=self.mlx_bytes)
        if self.draft is not None:
            d = _mlx_estimate(self.draft, n_ctx, self.kv, on_gpu=device != "cpu")
            d.overhead -= HOST_OVERHEAD
            d.total -= HOST_OVERHEAD
            if device == "cpu":
                d.cpu -= HOST_OVERHEAD
            d.draft = d.total
            mem = mem + d
        if device == "metal":
            budget, _, desc = self.gpu_budget("metal")
            if mem.gpu > budget:
                return _Layout(mem, 0, 0, False, f"MLX needs {_gb(mem.gpu)}, more than {desc} allows "
                                                 f"({_gb(budget)} after a {GPU_MARGIN // MiB} MiB margin)")
        limit = _ram_limit(self.hw)
        if mem.total > limit:
            return _Layout(mem, 0, 0, False, f"needs {_gb(mem.total)} of RAM, more than the {_gb(limit)} "
                                             f"this machine can give it ({_gb(self.hw.ram_total)} total)")
        return _Layout(mem, self.L + 1 if device != "cpu" else 0, (self.draft.n_layers + 1) if self.draft and
                       device != "cpu" else 0, True, "")

    def layout(self, backend: Backend, device: str, n_ctx: int, fa: bool, slots: int = 1) -> _Layout:
        """How ``backend`` places the model (``n_ctx`` cells for ``slots`` slots): one unified pool (MLX), or
        layers offloaded to a GPU (llama.cpp)."""
        return (self.mlx_layout(device, n_ctx) if backend.memory == "unified"
                else self.llama_layout(device, n_ctx, fa, slots))

    def max_ctx(self, backend: Backend, device: str, fa: bool, ngl: int, slots: int = 1,
                n_cpu_moe: int | None = None) -> int | None:
        """Largest context (a multiple of 256, ≤ the training context) that keeps the layout at
        least as good (same number of GPU layers, no more layers' experts in RAM), or None when even MIN_AUTO_CTX
        does not."""
        cap = self.info.context_length or 131072

        def ok(c: int) -> bool:
            lay = self.layout(backend, device, c * slots, fa, slots)
            return lay.fits and lay.ngl >= ngl and (n_cpu_moe is None or lay.n_cpu_moe <= n_cpu_moe)

        if not ok(min(MIN_AUTO_CTX, cap)):
            return None
        lo, hi = min(MIN_AUTO_CTX, cap), cap
        if ok(hi):
            return hi
        while hi - lo > 256:
            mid = (lo + hi) // 2 // 256 * 256 or lo
            if mid <= lo:
                break
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
        return lo

