"""Will this model fit, and how should it be loaded? A pure function of GGUF metadata and a probe.

``plan(info, hw)`` picks the backend (CUDA llama.cpp, MLX, Metal llama.cpp, CPU llama.cpp), the
layers to offload, the context size, the KV cache type and flash attention, and says why, one line
per decision::

    from localllm.ggufinfo import read_gguf
    from localllm.hardware import probe
    p = plan(read_gguf("smollm2.gguf"), probe())
    p.backend, p.device, p.verdict_text, p.n_ctx  # ('llamacpp', 'cpu', 'CPU', 4096)

It runs in four steps, one module each, read in this order:

- :mod:`~localllm.planner.estimation`: the bytes a load takes (weights per layer, KV cache, compute, overhead);
- :mod:`~localllm.planner.layout`: where they go (layers on a GPU or over llama.cpp's devices, or one unified
  pool), the most that fit, the largest context that keeps it;
- :mod:`~localllm.planner.advice`: which device a backend runs on here, and how to get a better build;
- :mod:`~localllm.planner.choice`: the request checked, the backend chosen, the context and slots fitted, the
  verdict and its reasons (:func:`plan`, :class:`Plan`).

The backend is the first of a priority list (:func:`backends.descriptor.ranked`: the backends' own
descriptors, MLX first on Apple Silicon, llama.cpp first elsewhere) that runs here and has weights for the
model; the descriptor says how its memory is counted (layers offloaded to a GPU, or one unified pool), which
KV types it takes and how it installs. So on Apple Silicon with mlx importable the planner picks MLX when it
can run the model: MLX weights are installed (pulled from the catalog's ``mlx_repo`` or converted before), or
the GGUF converts (then ``Plan.mlx_convert`` is set: the caller converts it once, offline, before loading).
Otherwise — a GGUF the converter refuses (the reason is one of the plan's lines), or a model over the Metal
budget — llama.cpp on Metal. What MLX has for an installed model is the caller's to ask
(:func:`localllm.formats.for_plan`: each format's own answer, MLX's from :func:`localllm.mlxmodels.mlx_for_plan`,
which owns the files and their cache) and comes in as ``weights={format: answer}``;
the MLX memory figure counts the MLX weights' own size (the requantized one for a conversion), not the
GGUF's. The planner reads no file.
"""

from localllm.planner.advice import CUDA_ADVICE, METAL_ADVICE, ROCM_ADVICE, SYCL_ADVICE, VULKAN_ADVICE
from localllm.planner.choice import Plan, PlanRequest, plan
from localllm.planner.estimation import (
    BACKENDS,
    CUDA_OVERHEAD,
    DEFAULT_CTX,
    DEFAULT_PARALLEL,
    FA_HEAD_DIMS,
    GPU_MARGIN,
    HOST_OVERHEAD,
    KV_TYPES,
    MAX_PARALLEL,
    MIN_AUTO_CTX,
    MIN_CTX,
    N_UBATCH,
    MemoryEstimate,
    checkpoint_bytes,
    estimate,
    memory_layout_reason,
)
from localllm.planner.layout import DevicePlan, split_layers

__all__ = [
    "BACKENDS", "CUDA_ADVICE", "CUDA_OVERHEAD", "DEFAULT_CTX", "DEFAULT_PARALLEL", "FA_HEAD_DIMS", "GPU_MARGIN",
    "HOST_OVERHEAD", "KV_TYPES", "MAX_PARALLEL", "METAL_ADVICE", "MIN_AUTO_CTX", "MIN_CTX",
    "N_UBATCH", "ROCM_ADVICE", "SYCL_ADVICE", "VULKAN_ADVICE", "DevicePlan", "MemoryEstimate", "Plan",
    "PlanRequest", "checkpoint_bytes", "estimate", "memory_layout_reason", "plan", "split_layers",
]
