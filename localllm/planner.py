"""Will this model fit, and how should it be loaded? A pure function of GGUF metadata and a probe.

One module on purpose: the fit is one computation — backend, layout, context and KV type feed
each other; split, each part would need the others' internals.

``plan(info, hw)`` picks the backend (CUDA llama.cpp, MLX, Metal llama.cpp, CPU llama.cpp), the
layers to offload, the context size, the KV cache type and flash attention, and says why, one line
per decision::

    from localllm.ggufinfo import read_gguf
    from localllm.hardware import probe
    p = plan(read_gguf("smollm2.gguf"), probe())
    p.backend, p.device, p.verdict_text, p.n_ctx  # ('llamacpp', 'cpu', 'CPU', 4096)

Memory, as the peers count it (``reference/tui-and-runners.md`` §3)::

    total = weights   (tensor bytes per layer from the GGUF; token embeddings stay on the CPU,
                       the output layer goes to the GPU last, a tied one is duplicated there)
          + KV cache  (info.kv_bytes_per_token(type) × n_ctx, split with the layers)
          + compute   (Ollama's GraphSize formulas, fs/ggml/ggml.go; matches llama.cpp's own
                       compute buffer within a few % for the default model)
          + overhead  (457 MiB per CUDA GPU, Ollama's cudaMinimumMemory; 128 MiB for the process)

Layers are offloaded like Ollama's ``EstimateGPULayers``: all of them (plus the output layer) when
they fit in free VRAM minus a 512 MiB margin, else as many as fit. ``n_gpu_layers`` follows
llama.cpp: ``n_layers + 1`` means every layer and the output layer.

The backend is the first of a priority list (:func:`backends.descriptor.ranked`: the backends' own
descriptors, MLX first on Apple Silicon, llama.cpp first elsewhere) that runs here and has weights for the
model; the descriptor says how its memory is counted (layers offloaded to a GPU, or one unified pool), which
KV types it takes and how it installs. So on Apple Silicon with mlx importable the planner picks MLX when it
can run the model: MLX weights are installed (pulled from the catalog's ``mlx_repo`` or converted before), or
the GGUF converts (then ``Plan.mlx_convert`` is set: the caller converts it once, offline, before loading).
Otherwise — a GGUF the converter refuses (the reason is one of the plan's lines), or a model over the Metal
budget — llama.cpp on Metal. What MLX has for an installed model is the caller's to ask
(:func:`localllm.mlxmodels.mlx_for_plan`, which owns the files and their cache) and comes in as ``mlx=``;
the MLX memory figure counts the MLX weights' own size (the requantized one for a conversion), not the
GGUF's. The planner reads no file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from backends import descriptor
from backends.descriptor import GGUF, KV_CACHE_TYPES, LLAMA_CPP_VERSION, Backend
from localllm.errors import PlanError
from localllm.ggufinfo import GGUFInfo
from localllm.hardware import BACKEND_CHOICES, GPU, BackendStatus, GiB, HardwareInfo, MiB, metal_budget_rule
from localllm.mlxmodels import MLXWeights

CUDA_ADVICE = (f'CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir '
               f'llama-cpp-python=={LLAMA_CPP_VERSION}')
METAL_ADVICE = (f'CMAKE_ARGS="-DGGML_METAL=on" pip install --force-reinstall --no-cache-dir '
                f'llama-cpp-python=={LLAMA_CPP_VERSION}')
ROCM_ADVICE = (f'CMAKE_ARGS="-DGGML_HIP=on" pip install --force-reinstall --no-cache-dir '
               f'llama-cpp-python=={LLAMA_CPP_VERSION}')
VULKAN_ADVICE = (f'CMAKE_ARGS="-DGGML_VULKAN=on" pip install --force-reinstall --no-cache-dir '
                 f'llama-cpp-python=={LLAMA_CPP_VERSION}')
SYCL_ADVICE = (f'CMAKE_ARGS="-DGGML_SYCL=on -DCMAKE_C_COMPILER=icx -DCMAKE_CXX_COMPILER=icpx" pip install '
               f'--force-reinstall --no-cache-dir llama-cpp-python=={LLAMA_CPP_VERSION}')
# the llama.cpp GPU backends (BackendStatus.gpu_backend) that can drive each vendor's GPUs besides NVIDIA's
_GPU_BACKENDS_FOR = {"amd": ("HIP", "Vulkan"), "intel": ("Vulkan", "SYCL")}

KV_TYPES = KV_CACHE_TYPES
BACKENDS = BACKEND_CHOICES  # "auto" and every registered backend's name
DEFAULT_CTX = 4096  # llama.cpp --fit's floor (--fit-ctx) and Ollama's default num_ctx
# the smallest num_ctx a request may ask for: llama.cpp pads contexts to 256 tokens; below that a chat template
# alone may not fit
MIN_CTX = 256
MIN_AUTO_CTX = 512  # the smallest context the planner shrinks to on its own
N_UBATCH = 512  # llama.cpp's default physical batch: the compute buffer scales with it
CUDA_OVERHEAD = 457 * MiB  # per GPU: CUDA context + cuBLAS (Ollama's cudaMinimumMemory)
HOST_OVERHEAD = 128 * MiB  # the process itself (measured: Python + llama.cpp ≈ 48 MiB RSS)
DEFAULT_PARALLEL = 4  # slots when num_parallel is not set and the pool fits (LM Studio's and llama-server's 4)
MAX_PARALLEL = 64
GPU_MARGIN = 512 * MiB  # free VRAM left alone per GPU (other processes, fragmentation)
FA_HEAD_DIMS = {64, 80, 96, 112, 128, 256}  # head sizes llama.cpp's CUDA/Metal FA kernels cover


def _gb(n: float) -> str:
    """Bytes as GiB, the unit GPU and RAM sizes are sold in (a "24 GB" card is 24 GiB)."""
    return f"{n / GiB:.1f} GiB" if abs(n) >= GiB else f"{n / MiB:.0f} MiB"


@dataclass
class MemoryEstimate:
    """Bytes. ``total == weights + kv_cache + compute + overhead == gpu + cpu``."""

    weights: int
    kv_cache: int
    compute: int
    overhead: int
    total: int
    gpu: int  # on the GPU (VRAM; on Apple Silicon the Metal working set)
    cpu: int  # in system RAM
    draft: int = 0  # of the above, what the draft model takes (weights + its KV cache)

    def __add__(self, other: MemoryEstimate) -> MemoryEstimate:
        return MemoryEstimate(*(a + b for a, b in zip(asdict(self).values(), asdict(other).values(), strict=True)))

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def describe(self, n_ctx: int, kv_type: str) -> str:
        """``"5.9 GiB: weights 4.6 GiB + KV cache 512 MiB (4,096 tokens, f16) + compute 266 MiB + ..."``"""
        text = (f"{_gb(self.total)}: weights {_gb(self.weights)} + KV cache {_gb(self.kv_cache)} "
                f"({n_ctx:,} tokens, {kv_type}) + compute {_gb(self.compute)} + overhead {_gb(self.overhead)}")
        return text + (f" (draft model {_gb(self.draft)} included)" if self.draft else "")


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

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.compute


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
    max_ctx: int | None = None  # the largest context that would fit the same way (None: not computed)
    mlx_convert: bool = False  # backend MLX from the GGUF: convert it (once, offline) before loading
    n_seq: int = 1  # parallel slots: sequences decoding together over one KV pool of n_ctx × n_seq cells
    # where the offloaded layers go, device by device in llama.cpp's order (empty: one GPU, or none)
    devices: list[DevicePlan] = field(default_factory=list)
    shares: list[float] | None = None  # --tensor-split as given (None: by usable memory)

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
        slots = f", {self.n_seq} slots" if self.n_seq > 1 else ""
        return (f"{name} on {where}, {self.verdict_text}, {self.n_ctx:,}-token context{slots}, "
                f"{_gb(self.memory.total)}")

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["summary"] = self.summary
        return d


# ------------------------------------------------------------------------------------------ weights


@dataclass(frozen=True)
class _Weights:
    embd: int  # token embeddings: llama.cpp keeps the input layer on the CPU
    output: int  # output layer (+ final norm); a tied one is the embedding matrix again
    tied: bool
    layers: tuple[int, ...]  # per repeating layer, blk.0 first

    @property
    def total(self) -> int:
        return self.embd + sum(self.layers) + (0 if self.tied else self.output)


def _weights(info: GGUFInfo) -> _Weights:
    """Per-layer weight bytes: from ``info.extra["tensor_bytes"]`` (``read_gguf`` records the tensor
    table's split), else estimated from the file size, the parameter count and the embedding shape
    (assuming an untied output layer)."""
    tb = (info.extra or {}).get("tensor_bytes")
    if isinstance(tb, dict) and tb.get("layers"):
        layers = tuple(int(x) for x in tb["layers"])
        if len(layers) == info.n_layers:
            embd = int(tb.get("token_embd") or 0)
            tied = tb.get("output") is None
            output = (embd if tied else int(tb["output"])) + int(tb.get("other") or 0)
            return _Weights(embd=embd, output=output, tied=tied, layers=layers)
    size = max(int(info.file_size), 0)
    bytes_per_param = size / info.parameters if info.parameters else 0.6
    embd = int(info.vocab_size * info.n_embd * bytes_per_param)
    embd = min(embd, size // 4)  # keep the guess sane when metadata is sparse
    rest = max(size - 2 * embd, 0)
    per_layer = rest // max(info.n_layers, 1)
    return _Weights(embd=embd, output=embd, tied=False, layers=(per_layer,) * info.n_layers)


# ------------------------------------------------------------------------------------------ compute


def _graph(info: GGUFInfo, n_ctx: int, flash_attn: bool, partial: bool) -> int:
    """Compute buffer, after Ollama's ``GraphSize`` (fs/ggml/ggml.go, the llama branch)."""
    b = min(n_ctx, N_UBATCH)
    e, v, h = info.n_embd, info.vocab_size, max(info.n_head, 1)
    hd, hkv = max(info.head_dim_k, 1), max(info.n_head_kv, 1)
    if not partial:
        attn = 4 * b * (1 + 4 * e + (0 if flash_attn else n_ctx * (1 + h)))
        return int(max(attn, 4 * b * (e + v)))
    attn = 4 * b * (1 + e + max(n_ctx, e)) + e * e * 9 // 16 + 4 * n_ctx * ((0 if flash_attn else b * h) + hd * hkv)
    out = 4 * b * (e + v) + e * v * 105 // 128
    return int(4 * b * e + max(attn, out))


def _default_flash_attn(kv_cache_type: str) -> bool:
    return kv_cache_type != "f16"


def estimate(info: GGUFInfo, n_ctx: int, kv_cache_type: str = "f16", n_gpu_layers: int = 0, *,
             flash_attn: bool | None = None, device: str = "cuda", n_gpus: int = 1, n_seq: int = 1,
             swa_full: bool = False) -> MemoryEstimate:
    """Memory to load ``info`` with ``n_ctx`` tokens of context (all ``n_seq`` slots) and ``n_gpu_layers``
    offloaded (llama.cpp's meaning; negative = all). ``flash_attn=None``: on when the V cache is quantized. The
    KV cache is what llama.cpp allocates (:meth:`GGUFInfo.memory_bytes`): sliding-window layers at their window
    (unless ``swa_full``), recurrent layers one state per sequence.

    >>> from localllm.ggufinfo import GGUFInfo
    >>> llama8b = GGUFInfo(path="", file_size=4_920_739_232, architecture="llama", name="8B",
    ...     n_layers=32, n_embd=4096, n_head=32, n_head_kv=8, head_dim_k=128, head_dim_v=128,
    ...     context_length=131072, vocab_size=128256, file_type="Q4_K_M", parameters=8_030_261_248,
    ...     chat_template=None, license=None)
    >>> estimate(llama8b, 8192).kv_cache // MiB      # 128 KiB per token
    1024
    """
    kv_cache_type = kv_cache_type.lower()
    if flash_attn is None:
        flash_attn = _default_flash_attn(kv_cache_type)
    n_layers = max(info.n_layers, 1)
    ngl = n_layers + 1 if n_gpu_layers < 0 else min(n_gpu_layers, n_layers + 1)
    layers_gpu, output_gpu = min(ngl, n_layers), ngl > n_layers
    w = _weights(info)
    split = len(w.layers) - layers_gpu  # llama.cpp offloads the last layers first
    gpu_w = sum(w.layers[split:]) + (w.output if output_gpu else 0)
    cpu_w = sum(w.layers[:split]) + w.embd + (0 if (output_gpu or w.tied) else w.output)
    kv = info.memory_bytes(n_ctx, kv_cache_type, n_seq=n_seq, swa_full=swa_full)
    kv_gpu = kv * layers_gpu // n_layers
    if ngl == 0:
        gpu_c, cpu_c = 0, _graph(info, n_ctx, flash_attn, partial=False)
    elif output_gpu or device == "metal":  # Ollama: on Metal partial offload costs what full does
        gpu_c, cpu_c = _graph(info, n_ctx, flash_attn, partial=False), 4 * min(n_ctx, N_UBATCH) * info.n_embd
    else:
        gpu_c = _graph(info, n_ctx, flash_attn, partial=True)
        cpu_c = 4 * min(n_ctx, N_UBATCH) * (info.n_embd + info.vocab_size)
    gpu_o = (CUDA_OVERHEAD * max(n_gpus, 1) if device == "cuda" else 0) if ngl else 0
    host = HOST_OVERHEAD + checkpoint_bytes(info, n_ctx, kv_cache_type, n_seq)  # checkpoints live in host memory
    gpu = gpu_w + kv_gpu + gpu_c + gpu_o
    cpu = cpu_w + (kv - kv_gpu) + cpu_c + host
    return MemoryEstimate(weights=gpu_w + cpu_w, kv_cache=kv, compute=gpu_c + cpu_c, overhead=gpu_o + host,
                          total=gpu + cpu, gpu=gpu, cpu=cpu)


def checkpoint_bytes(info: GGUFInfo, n_ctx: int, kv_cache_type: str, n_seq: int) -> int:
    """Host memory the checkpoints of a windowed or recurrent model may take at most (``backends.kvpool``'s
    :class:`~backends.kvpool.CheckpointPolicy`: per slot, 16 checkpoints of one sequence's recurrent state and
    window, within 256 MiB); 0 for a plain transformer. ``n_ctx``: all slots' cells."""
    from backends.kvpool import CheckpointPolicy

    pol = CheckpointPolicy()
    swa = info.swa_layers if info.sliding_window else 0
    if not (swa or info.recurrent_layers):
        return 0
    per_layer = info.kv_bytes_per_token(kv_cache_type) / max(info.n_layers - info.recurrent_layers, 1)
    window = min(n_ctx // max(n_seq, 1), (info.sliding_window or 0) + N_UBATCH)
    one = info.recurrent_bytes // 2 + int(swa * window * per_layer)  # (recurrent_bytes: two sequence ids a slot)
    return max(n_seq, 1) * min(pol.bytes_per_slot, pol.per_seq * one)


def memory_layout_reason(info: GGUFInfo, n_cells: int, kv_cache_type: str, n_seq: int, swa_full: bool) -> str:
    """One line on a windowed or recurrent model's memory (``probe``, ``run --verbose``).

    >>> from localllm.ggufinfo import GGUFInfo
    >>> g = GGUFInfo(path="", file_size=0, architecture="gemma3", name=None, n_layers=18, n_embd=640, n_head=4,
    ...     n_head_kv=1, head_dim_k=256, head_dim_v=256, context_length=32768, vocab_size=262144,
    ...     file_type="Q4_K_M", parameters=0, chat_template=None, license=None, sliding_window=512, swa_layers=15)
    >>> memory_layout_reason(g, 32768, "f16", 1, False)  # doctest: +ELLIPSIS
    'memory layout: 15 of 18 layers windowed (512 tokens): KV cache 118.5 MiB instead of 576.0 MiB (...); check...'
    """
    kv = info.memory_bytes(n_cells, kv_cache_type, n_seq=n_seq, swa_full=swa_full)
    parts = []
    if info.swa_layers and info.sliding_window:
        parts.append(f"{info.swa_layers} of {info.n_layers} layers windowed ({info.sliding_window:,} tokens)"
                     + (", cached whole (LOCALLLM_SWA_FULL=1)" if swa_full else ""))
    if info.recurrent_layers:
        parts.append(f"{info.recurrent_layers} of {info.n_layers} layers recurrent "
                     f"({info.recurrent_bytes / MiB:.1f} MiB of state a sequence, no KV cache)")
    text = "memory layout: " + "; ".join(parts) + f": KV cache {kv / MiB:.1f} MiB"
    if info.swa_layers and info.sliding_window and not swa_full:
        full = info.memory_bytes(n_cells, kv_cache_type, n_seq=n_seq, swa_full=True)
        text += f" instead of {full / MiB:.1f} MiB (LOCALLLM_SWA_FULL=1)"
    ck = checkpoint_bytes(info, n_cells, kv_cache_type, n_seq)
    return text + (f"; checkpoints up to {ck / MiB:.1f} MiB of host memory" if ck else "")


def _mlx_estimate(info: GGUFInfo, n_ctx: int, kv_cache_type: str, on_gpu: bool,
                  weights_bytes: int | None = None) -> MemoryEstimate:
    """MLX keeps everything in one (unified) pool. ``weights_bytes``: the MLX weights' own size (the
    directory, or a conversion's requantized estimate); without it, the GGUF's size stands in."""
    weights = int(weights_bytes) if weights_bytes else int(info.file_size)
    kv = int(info.kv_bytes_per_token(kv_cache_type) * n_ctx)
    compute = _graph(info, n_ctx, True, partial=False)  # fused scaled-dot-product attention
    total = weights + kv + compute + HOST_OVERHEAD
    return MemoryEstimate(weights=weights, kv_cache=kv, compute=compute, overhead=HOST_OVERHEAD, total=total,
                          gpu=total - HOST_OVERHEAD if on_gpu else 0,
                          cpu=HOST_OVERHEAD if on_gpu else total)


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
                 targets: list[DevicePlan], shares: list[float] | None = None, *, n_seq: int = 1,
                 swa_full: bool = False) -> list[DevicePlan]:
    """Place ``ngl`` offloaded layers on ``targets`` as llama.cpp does (``llama_model::load_tensors``: split
    points from the devices' shares, the last layers offloaded first, the output layer last) and estimate
    each device's weights, KV cache and compute buffer."""
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
    kv_layer = info.memory_bytes(n_ctx, kv_cache_type, n_seq=n_seq, swa_full=swa_full) / L
    out = [replace(t, layers=0, output=False, weights=0, kv_cache=0, compute=0) for t in targets]
    for il in range(start, L + 1):
        j = min(bisect_right(cum, (il - start) / act), n - 1)
        if il < L:
            out[j].layers += 1
            out[j].weights += w.layers[il] if il < len(w.layers) else 0
            out[j].kv_cache += int(kv_layer)
        else:
            out[j].output = True
            out[j].weights += w.output
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
            d.compute = 4 * b * (attn + (e + v if d.output else 15 * e))
    return out


class _Planner:
    def __init__(self, info: GGUFInfo, hw: HardwareInfo, kv: str, num_gpu: int | None, draft: GGUFInfo | None,
                 mlx_bytes: int | None = None, caps: dict[str, int] | None = None, swa_full: bool = False):
        self.info, self.hw, self.kv, self.num_gpu, self.draft = info, hw, kv, num_gpu, draft
        self.swa_full = swa_full
        self.mlx_bytes = mlx_bytes
        self.caps = caps or {}
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
        i = self.info
        if device in ("cuda", "metal") and i.head_dim_k == i.head_dim_v and i.head_dim_k in FA_HEAD_DIMS:
            return True, (f"flash attention on: the GPU kernels cover head size {i.head_dim_k}, and it saves "
                          f"the n_ctx × batch attention buffer")
        if device == "cpu":
            return True, "flash attention: llama.cpp's auto setting, on for the CPU kernels"
        if device == "gpu":
            return True, "flash attention: llama.cpp's auto setting (on where the devices run it, as RPC workers do)"
        return False, "flash attention off: the GPU kernels do not cover this head size"

    # llama.cpp layout ------------------------------------------------------------------------
    def llama_layout(self, device: str, n_ctx: int, fa: bool, n_seq: int = 1) -> _Layout:
        info, hw = self.info, self.hw
        budget, n_gpus, _ = self.gpu_budget(device)

        def est(ngl: int) -> MemoryEstimate:
            return estimate(info, n_ctx, self.kv, ngl, flash_attn=fa, device=device, n_gpus=n_gpus, n_seq=n_seq,
                            swa_full=self.swa_full)

        def draft_est(ngl: int) -> MemoryEstimate:
            assert self.draft is not None
            m = estimate(self.draft, n_ctx, self.kv, ngl, flash_attn=fa, device=device, n_gpus=n_gpus, n_seq=n_seq,
                         swa_full=self.swa_full)
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
        if targets and device != "cpu" and self.draft is None:
            return self._devices_layout(targets, device, n_ctx, fa, est, n_seq)
        if device == "cpu":
            ngl = 0
        elif self.num_gpu is not None and self.num_gpu >= 0:
            ngl = min(self.num_gpu, full)
        elif est(full).gpu <= budget:
            ngl = full
        else:  # most layers that fit: GPU memory grows with every layer, so bisect
            lo, hi = 0, full  # est(lo) fits (0 layers take no VRAM), est(hi) does not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if est(mid).gpu <= budget else (lo, mid)
            ngl = lo
        mem = est(ngl)
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
                           f"({_gb(hw.ram_total)} total)")
        return _Layout(mem, ngl, draft_ngl, True, "")

    def _devices_layout(self, targets: list[DevicePlan], device: str, n_ctx: int, fa: bool,
                        est: Callable[[int], MemoryEstimate], n_seq: int = 1) -> _Layout:
        """Several llama.cpp devices (RPC workers, ROCm/Vulkan GPUs): the most layers with every device's
        estimate inside its own usable memory."""
        full = self.L + 1

        def placed(ngl: int) -> list[DevicePlan]:
            return split_layers(self.info, ngl, n_ctx, self.kv, fa, targets, self.shares, n_seq=n_seq,
                                swa_full=self.swa_full)

        def ok(ngl: int) -> bool:
            return all(d.total <= d.usable_bytes for d in placed(ngl))

        if self.num_gpu is not None and self.num_gpu >= 0:
            ngl = min(self.num_gpu, full)
        elif ok(full):
            ngl = full
        else:
            lo, hi = 0, full
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if ok(mid) else (lo, mid)
            ngl = lo
        devs = placed(ngl) if ngl else []
        mem = est(ngl)
        gpu = sum(d.total for d in devs)
        mem = replace(mem, gpu=gpu, cpu=mem.total - gpu)
        ram_limit = _ram_limit(self.hw)
        if mem.cpu > ram_limit:
            return _Layout(mem, ngl, 0, False, f"needs {_gb(mem.cpu)} of RAM for the CPU part, more than the "
                                               f"{_gb(ram_limit)} this machine can give it", devs)
        return _Layout(mem, ngl, 0, True, "", devs)

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

    def layout(self, backend: Backend, device: str, n_ctx: int, fa: bool, n_seq: int = 1) -> _Layout:
        """How ``backend`` places the model (``n_ctx`` cells for ``n_seq`` slots): one unified pool (MLX), or
        layers offloaded to a GPU (llama.cpp)."""
        return (self.mlx_layout(device, n_ctx) if backend.memory == "unified"
                else self.llama_layout(device, n_ctx, fa, n_seq))

    def max_ctx(self, backend: Backend, device: str, fa: bool, ngl: int, n_seq: int = 1) -> int | None:
        """Largest context (a multiple of 256, ≤ the training context) that keeps the layout at
        least as good (same number of GPU layers), or None when even MIN_AUTO_CTX does not."""
        cap = self.info.context_length or 131072

        def ok(c: int) -> bool:
            lay = self.layout(backend, device, c * n_seq, fa, n_seq)
            return lay.fits and lay.ngl >= ngl

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


def _device(b: Backend, hw: HardwareInfo, reasons: list[str], advice: list[str], name: str, mw: MLXWeights,
            passed: list[Backend], status: dict[str, BackendStatus], *, asked: bool) -> str:
    """The device ``b`` runs on here; appends the reason lines: why it (and not the backends ``passed``, tried
    before it) and, where a better setup exists, the advice."""
    converts = (f"its GGUF converts to {b.label} (once, offline, before the first load: {mw.source})" if mw.source
                else f"its GGUF converts to {b.label} (once, offline, before the first load)")
    prepared = "" if b.weights == GGUF or mw.installed else f"; {converts}"
    if b.memory == "unified":
        gb = status[b.name].gpu_backend
        device = "metal" if gb == "Metal" else "cuda" if gb == "CUDA" else "cpu"
        if asked:
            reasons.append(f"backend {b.label} ({device}): asked for with --backend {b.name}{prepared}")
        elif passed:
            first = passed[0]
            reasons.append(f"backend {b.label} ({device}): {first.label} is not importable "
                           f"({status[first.name].reason}){prepared}")
        else:
            where = device.capitalize() if device == "metal" else device.upper()
            reasons.append(f"backend {b.label} on {where}: Apple Silicon, {b.name} importable and "
                           + (f"{b.label} weights of {name} installed ({mw.source or 'found'})" if mw.installed
                              else converts))
        return device
    for p in passed:  # the ones the priority list tried first
        st = status[p.name]
        ready = p.weights == GGUF or mw.usable
        if ready and not st.available:
            reasons.append(f"{p.label} not used: {st.reason}")
            advice.append(f"{p.install}  ({p.install_note})" if p.install_note else p.install)
        elif st.available and not ready:
            reasons.append(f"{p.label} not used: no {p.label} weights of {name} are installed and "
                           f"{mw.why_not[0].lower() + mw.why_not[1:]}" if mw.why_not else
                           f"{p.label} not used: no {p.label} build of {name} is installed")
    before = len(reasons)
    device = _layers_device(b, hw, reasons, advice)
    if asked and len(reasons) > before:
        reasons[-1] += f" (asked for with --backend {b.name})"
    return device


def _registry_device(b: Backend, hw: HardwareInfo, device: str, reasons: list[str]) -> str:
    """llama.cpp's own device list can offer devices NVML and Metal do not see: RPC workers, ROCm, Vulkan, SYCL
    GPUs. Where the other checks found none, those are where the layers go ("gpu")."""
    if b.memory != "layers" or device != "cpu" or not hw.backend(b.name).available:
        return device
    devs = [d for d in hw.offload_devices if d.backend not in ("CUDA", "Metal")]
    if not devs:
        return device
    names = ", ".join(f"{d.name} ({d.description})" if d.remote else f"{d.name} ({d.description}, {d.backend})"
                      for d in devs)
    line = f"backend {b.label} on {names}: llama.cpp's device list"
    if reasons and reasons[-1].startswith(f"backend {b.label} on the CPU"):
        reasons[-1] = line
    else:
        reasons.append(line)
    return "gpu"


def _gpu_label(g: GPU) -> str:
    size = _gb(g.total_bytes) if g.total_bytes else ""
    kind = "integrated" if g.integrated else ""
    extra = ", ".join(x for x in (size, kind) if x)
    return f"{g.name} ({extra})" if extra else g.name


def _idle_gpus(hw: HardwareInfo, gpu_backend: str | None) -> list[GPU]:
    """The AMD and Intel GPUs a build offloading via ``gpu_backend`` (None: CPU-only) cannot drive. An integrated
    GPU counts only where no discrete GPU (of any vendor) is there: offloading to it beside one gains little."""
    others = [g for g in hw.gpus if g.vendor in _GPU_BACKENDS_FOR and gpu_backend not in _GPU_BACKENDS_FOR[g.vendor]]
    if any(not g.integrated for g in hw.gpus if g.vendor != "apple"):
        others = [g for g in others if not g.integrated]
    return others


def _your(g: GPU, vendor: str) -> str:
    return g.name if g.name.startswith(vendor) else f"{vendor} GPU ({g.name})"


def _amd_intel_advice(gpus: list[GPU], why: str) -> list[str]:
    """The install commands for AMD (ROCm, else Vulkan) and Intel (Vulkan, else SYCL) GPUs; ``why``: the words
    after "is idle because" (e.g. "llama.cpp was built for the CPU only")."""
    out: list[str] = []
    amd = [g for g in gpus if g.vendor == "amd"]
    if amd:
        target = next((g.gfx_target for g in amd if g.gfx_target), None)
        out.append(f"Your {_your(amd[0], 'AMD')} is idle because {why}. Install a ROCm (HIP) build (needs ROCm "
                   f"with hipcc; takes a while): {ROCM_ADVICE}  (add -DGPU_TARGETS={target or 'gfxNNNN'} to "
                   f"CMAKE_ARGS to build for this GPU only{'' if target else ', as rocminfo names it'})")
        out.append(f"Or a Vulkan build (AMD and Intel GPUs; needs glslc and Vulkan headers newer than Debian 12's "
                   f"1.3.239): {VULKAN_ADVICE}")
    intel = [g for g in gpus if g.vendor == "intel"]
    if intel:
        out.append(f"Your {_your(intel[0], 'Intel')} is idle because {why}. Install a Vulkan build (needs glslc and "
                   f"Vulkan headers newer than Debian 12's 1.3.239): {VULKAN_ADVICE}")
        out.append(f"Or a SYCL build (Intel oneAPI; `source /opt/intel/oneapi/setvars.sh` first): {SYCL_ADVICE}")
    return out


def _layers_device(b: Backend, hw: HardwareInfo, reasons: list[str], advice: list[str]) -> str:
    """Which device a backend that offloads layers (llama.cpp) can use here; appends the reason (and advice)."""
    llama = hw.backend(b.name)
    nvidia = hw.nvidia_gpus
    gpu_names = ", ".join(f"{g.name} ({_gb(g.total_bytes)})" for g in nvidia)
    cc = next((g.compute_capability for g in nvidia if g.compute_capability), None)
    cuda_advice = (f"Your NVIDIA GPU is idle because llama.cpp was built for the CPU only. Install a CUDA build "
                   f"(needs the CUDA toolkit, nvcc on PATH; takes a while): {CUDA_ADVICE}"
                   + (f'  (add -DCMAKE_CUDA_ARCHITECTURES={cc.replace(".", "")} to CMAKE_ARGS to build for this '
                      f"GPU only, much faster)" if cc else ""))
    if not llama.available:
        reasons.append(f"{b.label}: {llama.reason}")
        idle = _idle_gpus(hw, None)
        if nvidia:
            advice.append(cuda_advice.replace("is idle because llama.cpp was built for the CPU only",
                                              "needs a CUDA build of llama.cpp"))
            advice.extend(_amd_intel_advice(idle, "llama.cpp is not installed"))
            return "cpu"
        if hw.apple_silicon:
            advice.append(f"{b.install}  (Metal is on by default on macOS)")
            return "metal"
        advice.extend(_amd_intel_advice(idle, "llama.cpp is not installed") or [b.install])
        return "cpu"
    if llama.gpu_offload:  # an RPC-only build counts as CPU-only here (backends.descriptor.llamacpp_status)
        gb = llama.gpu_backend
        if nvidia and gb in ("CUDA", "Vulkan", None):
            via = f" via {gb}" if gb and gb != "CUDA" else ""
            reasons.append(f"backend {b.label} on CUDA{via}: {gpu_names} and a GPU-capable llama.cpp build")
            return "cuda"
        if hw.apple_silicon and gb in ("Metal", None):
            reasons.append(f"backend {b.label} on Metal: Apple Silicon and a Metal build of llama.cpp")
            return "metal"
        idle = _idle_gpus(hw, gb)
        drivable = [g for g in hw.gpus if g.vendor in _GPU_BACKENDS_FOR and g not in idle]
        found = ", ".join(_gpu_label(g) for g in hw.gpus) or ("Apple Silicon GPU" if hw.apple_silicon else "none")
        if drivable:
            reasons.append(f"backend {b.label} on the CPU: the build offloads via {gb} to "
                           f"{', '.join(_gpu_label(g) for g in drivable)}, but llama.cpp's device list shows no "
                           f"{gb} device")  # where it does, _registry_device puts the layers there
        else:
            reasons.append(f"backend {b.label} on the CPU: the build offloads via {gb or 'a GPU backend'}, "
                           f"but no such GPU was found (GPUs: {found})")
            advice.extend(_amd_intel_advice(idle, f"this llama.cpp build offloads via {gb or 'another backend'} "
                                                  f"only"))
        return "cpu"
    idle = _idle_gpus(hw, None)
    if nvidia or idle:
        names = ", ".join([f"{g.name} ({_gb(g.total_bytes)})" for g in nvidia] + [_gpu_label(g) for g in idle])
        reasons.append(f"backend {b.label} on the CPU: {names} found, but this llama.cpp build is CPU-only")
        if nvidia:
            advice.append(cuda_advice)
        advice.extend(_amd_intel_advice(idle, "llama.cpp was built for the CPU only"))
    elif hw.apple_silicon:
        reasons.append(f"backend {b.label} on the CPU: this llama.cpp build has no Metal support")
        advice.append(f"Install a Metal build of llama.cpp: {METAL_ADVICE}")
    else:
        why = "; ".join(n for n in hw.notes if "NVML" in n or "nvidia-smi" in n or "drm" in n) or "none detected"
        reasons.append(f"backend {b.label} on the CPU: no usable GPU ({why})")
    return "cpu"


def plan(info: GGUFInfo, hw: HardwareInfo, *, num_ctx: int | None = None, kv_cache_type: str = "f16",
         backend: str = "auto", num_gpu: int | None = None, mlx_model: bool = False,
         draft: GGUFInfo | None = None, mlx: MLXWeights | None = None, num_parallel: int | None = None,
         projector_bytes: int = 0, projector_kind: str = "vision", device_memory: dict[str, int] | None = None,
         devices: list[str] | None = None, tensor_split: list[float] | None = None, swa_full: bool = False) -> Plan:
    """Decide how to load ``info`` on ``hw``.

    ``num_ctx``: a context size to honour (refused with numbers if the model or memory cannot take
    it); None = min(training context, 4096), shrunk to fit. ``num_gpu``: layers to offload (Ollama's
    meaning; 0 = CPU, negative or None = decide). ``mlx``: what MLX has for this model
    (:func:`localllm.mlxmodels.mlx_weights`); ``mlx_model=True`` is the short form of "MLX weights are installed".
    ``draft``: a draft model for speculative decoding, planned beside it. ``num_parallel``: sequences
    decoding at once (slots; one KV pool holds ``n_ctx`` tokens for each); None = 4 where that fits,
    fewer where it does not (the context is kept first). ``projector_bytes``: the size of the model's vision
    or audio projector (an automatic choice then takes a backend that runs it; its memory is counted with the
    weights, on the GPU where layers go there); ``projector_kind`` names it in the reasons ("vision", "audio").
    ``device_memory``: caps per llama.cpp device name ("*" for all;
    ``LOCALLLM_DEVICE_MEMORY``). ``devices``: only these of llama.cpp's devices take layers (``--device``); where
    the probe lists devices that offload, the layers are split over them as llama.cpp splits them
    (:func:`split_layers`, ``Plan.devices`` and ``Plan.tensor_split``); ``tensor_split``: the devices' shares
    instead of their usable memory (``--tensor-split 3,1``; one number per device, in that order). Raises
    :class:`PlanError` for what cannot be done as asked; a model that is simply too big gets ``verdict="too_big"``.
    """
    kv = (kv_cache_type or "f16").lower()
    if kv not in KV_TYPES:
        raise PlanError(f"KV cache type {kv_cache_type!r} is not one of {', '.join(KV_TYPES)}.")
    backend = (backend or "auto").lower()
    if backend not in BACKENDS:
        raise PlanError(f"Backend {backend!r} is not one of {', '.join(BACKENDS)}.")
    if info.n_layers <= 0:
        raise PlanError(f"{os.path.basename(info.path) or info.name} has no layer count in its metadata.")
    name = info.name or os.path.basename(info.path) or "the model"
    ctx_train = info.context_length or 0
    if num_ctx is not None:
        if num_ctx < 1:
            raise PlanError(f"num_ctx must be a positive number of tokens, got {num_ctx}.")
        if ctx_train and num_ctx > ctx_train:
            raise PlanError(f"A {num_ctx:,}-token context is more than {name} was trained for ({ctx_train:,} tokens).")

    reasons: list[str] = []
    advice: list[str] = []
    mw = mlx if mlx is not None else MLXWeights(installed=mlx_model)
    order = descriptor.ranked(hw.apple_silicon)  # the priority list for "auto"
    status = {b.name: hw.backend(b.name) for b in order}

    def ready(b: Backend) -> bool:
        """Its weights are installed or can be prepared (a GGUF always is)."""
        return b.weights == GGUF or mw.usable

    # 1. backend: the one asked for, else the first of the priority list that runs here and has weights ------
    chosen: Backend
    if backend != "auto":
        chosen = descriptor.get(backend)
        st = status[chosen.name]
        if not st.available:
            raise PlanError(f"--backend {chosen.name} cannot be used here: {st.reason}.")
        if not ready(chosen):
            if mw.why_not:
                raise PlanError(f"--backend {chosen.name} cannot run {name}: no {chosen.label} weights are installed "
                                f"for it and {mw.why_not[0].lower() + mw.why_not[1:]}.")
            raise PlanError(f"--backend {chosen.name} needs {chosen.label} weights of {name}, and none are installed "
                            f"for it.")
        passed: list[Backend] = []
    else:
        if projector_bytes:  # a vision model: the backends that run its projector (MLX: mlx-lm has no vision)
            blind = [b for b in order if not b.vision and status[b.name].available and ready(b)]
            order = [b for b in order if b.vision] or order
            article = "an" if projector_kind.startswith("a") else "a"
            for b in blind:
                reasons.append(f"{b.label} not used: it has no vision, and {name} has {article} {projector_kind} "
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

    if devices:  # --device: only these of llama.cpp's devices take layers
        hw = replace(hw, devices=[d for d in hw.devices if not d.offloads or d.name in devices])
    pl = _Planner(info, hw, kv, num_gpu, draft, mw.weights_bytes, device_memory, swa_full=swa_full)
    pl.shares = tensor_split
    device = _device(chosen, hw, reasons, advice, name, mw, passed, status, asked=backend != "auto")
    device = _registry_device(chosen, hw, device, reasons)
    if num_gpu == 0 and chosen.memory == "layers" and device != "cpu":
        device = "cpu"
        reasons.append("all layers on the CPU: asked for with num_gpu 0")
    elif num_gpu and num_gpu > 0 and device == "cpu":
        reasons.append(f"num_gpu {num_gpu} ignored: there is no GPU this build can use")

    # 2. context (and the MLX budget fallback) -------------------------------------------------
    fa, fa_reason = (False, None) if chosen.memory == "unified" else pl.flash_attn(device)
    if num_ctx is not None:
        candidates = [num_ctx]
    else:
        start = min(ctx_train, DEFAULT_CTX) if ctx_train else DEFAULT_CTX
        candidates = [start] + [c for c in (2048, 1024, MIN_AUTO_CTX) if c < start]

    if num_parallel is not None and not 1 <= num_parallel <= MAX_PARALLEL:
        raise PlanError(f"num_parallel must be between 1 and {MAX_PARALLEL}, got {num_parallel}.")
    slot_choices = [num_parallel] if num_parallel else [s for s in (DEFAULT_PARALLEL, 2, 1) if s <= DEFAULT_PARALLEL]
    n_seq = slot_choices[-1]

    def pick(backend_: Backend, device_: str, fa_: bool, shrink: bool = True) -> tuple[int, _Layout]:
        """The first context that fits, and at it the most slots that fit without moving a layer off the
        GPU (more slots never cost GPU placement: a second request is worth less than speed for the first)."""
        nonlocal n_seq
        for c in candidates if shrink else candidates[:1]:
            base = pl.layout(backend_, device_, c * slot_choices[-1], fa_, slot_choices[-1])
            if not base.fits:
                continue
            n_seq = slot_choices[-1]
            for s_ in slot_choices[:-1]:
                lay = pl.layout(backend_, device_, c * s_, fa_, s_)
                if lay.fits and lay.ngl >= base.ngl:
                    n_seq = s_
                    return c, lay
            return c, base
        n_seq = slot_choices[-1]  # nothing fits: describe the smallest setup at the first context
        return candidates[0], pl.layout(backend_, device_, candidates[0] * n_seq, fa_, n_seq)

    # an automatic choice of a unified-memory backend (MLX on Metal) that does not fit goes to the next backend
    # of the priority list that runs here (llama.cpp) rather than to a smaller context
    later = [b for b in order[order.index(chosen) + 1:] if status[b.name].available and ready(b)]
    fallback = later[0] if backend == "auto" and chosen.memory == "unified" and device != "cpu" and later else None
    n_ctx, lay = pick(chosen, device, fa, shrink=fallback is None)
    if fallback is not None and not lay.fits:
        reasons.append(f"{chosen.label} not used: {lay.why}; falling back to {fallback.label}"
                       + (", which can keep part of the model on the CPU" if fallback.memory == "layers" else ""))
        chosen, kv_reason = fallback, None
        pl = _Planner(info, hw, (kv_cache_type or "f16").lower(), num_gpu, draft, caps=device_memory,
                      swa_full=swa_full)
        device = _device(chosen, hw, reasons, advice, name, mw, [], status, asked=False)
        device = _registry_device(chosen, hw, device, reasons)
        fa, fa_reason = (False, None) if chosen.memory == "unified" else pl.flash_attn(device)
        n_ctx, lay = pick(chosen, device, fa)

    if not lay.fits and num_ctx is not None:
        smallest = pl.layout(chosen, device, min(MIN_AUTO_CTX, num_ctx), fa)
        if smallest.fits:  # the context is the problem, not the model
            best = pl.max_ctx(chosen, device, fa, 0)
            raise PlanError(f"A {num_ctx:,}-token context does not fit: with its "
                            f"{_gb(lay.mem.kv_cache)} KV cache ({pl.kv}) the model {lay.why}; "
                            f"at most about {best or MIN_AUTO_CTX:,} tokens fit.")

    if tensor_split and lay.devices and len(tensor_split) != len(lay.devices):
        raise PlanError(f"--tensor-split has {len(tensor_split)} value{'s' if len(tensor_split) != 1 else ''} for "
                        f"{len(lay.devices)} devices ({', '.join(d.name for d in lay.devices)}): give one each.")
    if tensor_split and any(x < 0 for x in tensor_split) or tensor_split and sum(tensor_split) <= 0:
        raise PlanError("--tensor-split takes shares of 0 or more, at least one above 0 (e.g. 3,1).")

    # 3. verdict ------------------------------------------------------------------------------
    L = info.n_layers
    mem = lay.mem
    if not lay.fits:
        verdict, verdict_text = "too_big", "does not fit"
    elif chosen.memory == "unified":
        verdict, verdict_text = ("gpu", "fits on GPU") if device != "cpu" else ("cpu", "CPU")
    elif lay.ngl >= L + 1:
        verdict, verdict_text = "gpu", "fits on GPU"
    elif lay.ngl > 0:
        verdict, verdict_text = "partial", f"partial offload {min(lay.ngl, L)}/{L} layers"
    else:
        verdict, verdict_text = "cpu", "CPU"

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
    reasons.append(f"memory {mem.describe(n_ctx * n_seq, pl.kv)}")
    if chosen.memory == "layers" and (info.swa_layers or info.recurrent_layers):
        reasons.append(memory_layout_reason(info, n_ctx * n_seq, pl.kv, n_seq, swa_full))
    if num_parallel:
        reasons.append(f"{n_seq} parallel slot{'s' if n_seq > 1 else ''}: asked for with num_parallel")
    elif n_seq == DEFAULT_PARALLEL:
        reasons.append(f"{n_seq} parallel slots: requests decode together, one KV pool of {n_ctx:,} tokens each")
    elif verdict != "too_big":
        reasons.append(f"{n_seq} parallel slot{'s' if n_seq > 1 else ''}: fewer than {DEFAULT_PARALLEL} so the "
                       f"{n_ctx:,}-token context fits")
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
            reasons.append(f"{min(lay.ngl, L)} of {L} layers on the GPU: asked for with num_gpu {num_gpu}"
                           + (f"; the estimate ({_gb(mem.gpu)}) exceeds {budget_desc}, loading may fail"
                              if over else ""))
        elif verdict == "gpu":
            reasons.append(f"all {L} layers and the output layer on the GPU: {_gb(mem.gpu)} of {budget_desc}")
        elif verdict == "partial":
            reasons.append(f"{lay.ngl} of {L} layers on the GPU: as many as fit in {budget_desc} "
                           f"(keeping {GPU_MARGIN // MiB} MiB spare); the rest run on the CPU, slower")
        else:
            reasons.append(f"no layer fits on the GPU ({budget_desc}): CPU only")
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
    if num_ctx is not None:
        reasons.append(f"context {n_ctx:,} tokens: as asked" + (f" (trained for {ctx_train:,})" if ctx_train else ""))
    elif n_ctx < candidates[0] and verdict != "too_big":
        reasons.append(f"context {n_ctx:,} tokens: reduced from {candidates[0]:,} so the model fits")
    else:
        reasons.append(f"context {n_ctx:,} tokens: the default, min(model's {ctx_train:,}, {DEFAULT_CTX:,})"
                       if ctx_train else f"context {n_ctx:,} tokens: the default (the model states none)")
    if info.sliding_window:
        reasons.append(f"sliding-window attention (window {info.sliding_window:,}): {chosen.label} keeps a "
                       f"full-size cache by default (swa_full), so the KV figure counts every layer at full context"
                       if chosen.memory == "layers" else
                       f"sliding-window attention (window {info.sliding_window:,}): the KV figure is an upper bound")
    per_tok = info.kv_bytes_per_token(pl.kv)
    reasons.append(kv_reason or f"KV cache {pl.kv}: {per_tok / 1024:,.1f} KiB per token"
                   + (f", {_gb(mem.kv_cache)} for {n_ctx * n_seq:,} tokens"
                      + (f" ({n_seq} slots × {n_ctx:,})" if n_seq > 1 else "") if mem.kv_cache else ""))
    if fa_reason:
        reasons.append(fa_reason)
    threads = max(hw.physical_cores or hw.logical_cores or 1, 1)
    reasons.append(f"threads {threads}: the physical cores this process may run on (hyper-threads do not speed up "
                   "generation)")
    if draft is not None:
        where = "on the GPU" if lay.draft_ngl else "on the CPU"
        reasons.append(f"draft model {draft.name or os.path.basename(draft.path)} {where}: "
                       f"{_gb(mem.draft)} for its weights and KV cache")
    if info.is_recurrent or info.is_hybrid:
        reasons.append(f"{info.architecture} is a recurrent/hybrid architecture: the KV estimate is approximate")

    max_ctx = None
    if verdict != "too_big":
        try:
            max_ctx = pl.max_ctx(chosen, device, fa, min(lay.ngl, L + 1), n_seq)
        except Exception:
            max_ctx = None
    return Plan(backend=chosen.name, device=device, n_gpu_layers=lay.ngl, n_layers=L, n_ctx=n_ctx,  # type: ignore[arg-type]
                kv_cache_type=pl.kv, flash_attn=fa, n_threads=threads, verdict=verdict,  # type: ignore[arg-type]
                verdict_text=verdict_text, memory=mem, reasons=reasons, advice="\n".join(advice) or None,
                draft_n_gpu_layers=lay.draft_ngl, max_ctx=max_ctx, n_seq=n_seq, devices=lay.devices,
                shares=tensor_split if tensor_split and len(tensor_split) == len(lay.devices) else None,
                mlx_convert=chosen.converts_from is not None and not mw.installed)
