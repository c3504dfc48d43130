"""Facts the llama.cpp source checks before and while it loads: the host's physical cores, whether a KV cache
type fits the model's head sizes (:func:`check_kv_type`), the GGUF's header, its head sizes and its own pooling, and
what a failed load says (:func:`load_error`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from backends.contract.errors import ModelLoadError, UnsupportedError
from backends.descriptor import KV_CACHE_TYPES
from backends.llamacpp._log import capture, native_reason

if TYPE_CHECKING:
    from backends.contract.specs import LoadSpec

# ggml type ids (llama_cpp.GGML_TYPE_*), block sizes and bytes per element of the KV cache types we offer
KV_GGML_TYPE = {"f16": 1, "q8_0": 8, "q4_0": 2}
KV_BLOCK = {"f16": 1, "q8_0": 32, "q4_0": 32}
KV_BYTES_PER_ELEM = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


def physical_cores() -> int:
    """Physical CPU cores available to this process (threads for llama.cpp)."""
    n = None
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
    except Exception:
        pass
    logical = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(n or logical, logical))


def usable_cores() -> int:
    """The logical CPUs this process may run on (its affinity: taskset, a container's cpuset): more llama.cpp
    threads than these only take turns on them, each step waiting for the slowest."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


def kv_type_problem(kv_type: str, head_dim_k: int, head_dim_v: int) -> str | None:
    """Why ``kv_type`` cannot be used for a model with these head sizes (one sentence), else None.

    >>> kv_type_problem("q8_0", 64, 64) is None
    True
    >>> kv_type_problem("q4_0", 128, 128) is None
    True
    >>> kv_type_problem("q8_0", 72, 72)
    'KV cache type q8_0 needs a head size that is a multiple of 32 (with flash attention), but this model has 72.'
    >>> kv_type_problem("q5_k", 64, 64)
    "KV cache type 'q5_k' is not supported; choose one of f16, q8_0, q4_0."
    """
    if kv_type not in KV_GGML_TYPE:
        return f"KV cache type {kv_type!r} is not supported; choose one of {', '.join(KV_CACHE_TYPES)}."
    block = KV_BLOCK[kv_type]
    for dim in (head_dim_k, head_dim_v):
        if dim and dim % block:
            return (f"KV cache type {kv_type} needs a head size that is a multiple of {block} "
                    f"(with flash attention), but this model has {dim}.")
    return None


def head_dims_from_file(path: Path) -> tuple[int, int]:
    """(head_dim_k, head_dim_v) from the GGUF's key-value section (read in milliseconds); (0, 0) if unknown."""
    try:
        from backends.gguf_header import read_header

        val = read_header(path, tensors=False).fields.get
        arch = val("general.architecture")
        n_embd, n_head = val(f"{arch}.embedding_length"), val(f"{arch}.attention.head_count")
        if isinstance(n_head, list):
            n_head = max(n_head)
        default = n_embd // n_head if n_embd and n_head else 0
        hk = int(val(f"{arch}.attention.key_length") or default)
        return hk, int(val(f"{arch}.attention.value_length") or default)
    except Exception:
        return 0, 0


def check_gguf_file(path: Path) -> None:
    if not path.is_file():
        raise ModelLoadError(f"Model file not found: {path}.")
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise ModelLoadError(f"Cannot read model file {path}: {e.strerror}.") from None
    if len(head) < 8 or head[:4] != b"GGUF":
        raise ModelLoadError(f"{path.name} is not a GGUF model file (bad header); re-download it.")


def pooling_of(md: dict[str, str], arch: str) -> str | None:
    """The GGUF's own pooling (``<arch>.pooling_type``) by name; None for a model without one (0: none).

    >>> pooling_of({"bert.pooling_type": "4"}, "bert"), pooling_of({}, "llama")
    ('rank', None)
    """
    from backends.core.pooling import POOLING_TYPES

    try:
        return POOLING_TYPES.get(int(md.get(f"{arch}.pooling_type", "0")))
    except ValueError:
        return None


def check_kv_type(spec: LoadSpec, path: Path) -> None:
    """:class:`UnsupportedError` (one sentence) when the spec's KV cache type is not one llama.cpp takes, is quantized
    without flash attention, or does not fit the model's head sizes (``spec.head_dims``, else the file's)."""
    kv = spec.kv_cache_type
    if kv not in KV_GGML_TYPE:
        raise UnsupportedError(kv_type_problem(kv, 0, 0) or f"KV cache type {kv!r} is not supported.")
    if kv != "f16":
        if spec.flash_attn is False:
            raise UnsupportedError(f"A {kv} KV cache needs flash attention; do not switch it off, or use f16.")
        dims = spec.head_dims  # what the caller read already, else the file's
        problem = kv_type_problem(kv, *(dims if dims is not None and any(dims) else head_dims_from_file(path)))
        if problem:
            raise UnsupportedError(f"{path.name}: {problem} Use --kv-cache f16.")


def load_error(msg: str, path: Path, spec: LoadSpec) -> Exception:
    """The error a failed load of ``path`` raises, one sentence from what llama.cpp logged (``msg``: what failed)."""
    kv = spec.kv_cache_type
    if "Failed to create llama_context" in msg:
        reason = native_reason("cache", "flash", "memory", "alloc", "n_ctx", "head")
        if kv != "f16" and reason and ("cache" in reason or "flash" in reason or "head" in reason):
            return UnsupportedError(f"{path.name} cannot use a {kv} KV cache: llama.cpp says \"{reason}\"; "
                                    "use --kv-cache f16.")
        if reason and ("memory" in reason or "alloc" in reason):
            return ModelLoadError(f"Not enough memory for a {spec.n_ctx}-token context with {path.name} "
                                  f"(llama.cpp: {reason}); lower num_ctx or the GPU layers.")
        return ModelLoadError(f"llama.cpp could not create a context for {path.name}"
                              f"{f' ({reason})' if reason else ''}; lower num_ctx or try --kv-cache f16.")
    alloc = native_reason("unable to allocate", "failed to allocate")
    if alloc:  # a device (or the host) has no room for the weights: not a broken file
        return ModelLoadError(f"Not enough memory to load {path.name} with {spec.n_gpu_layers} GPU layers "
                              f"(llama.cpp: {alloc}); lower the GPU layers.")
    reason = native_reason("error loading model", "invalid", "unknown", "not within") or native_reason()
    reason = reason.replace("error loading model: ", "").split(",")[0] if reason else None
    return ModelLoadError(f"{path.name} could not be loaded: it is corrupt, truncated or of an unsupported "
                          f"architecture{f' (llama.cpp: {reason})' if reason else ''}.")


def flash_attn_enabled(ctx: Any, cp: Any, kv_cache_type: str) -> bool:
    """Whether flash attention ended up on in context ``ctx`` made with ``cp`` (AUTO is resolved when the context is
    made)."""
    import llama_cpp

    if cp.flash_attn_type != llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO:
        return bool(cp.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED)
    getter = getattr(llama_cpp, "llama_get_flash_attn_type", None)  # not in every build of the binding
    if getter is not None:
        try:
            return bool(getter(ctx) == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED)
        except Exception:  # noqa: BLE001
            pass
    # llama.cpp resolves AUTO when the context is made and says so ("resolve_fused_ops: Flash Attention
    # enabled" / "... not supported, set to disabled")
    for line in reversed(getattr(capture, "lines", None) or []):
        if "Flash Attention" in line:
            return "enabled" in line and "disabled" not in line
    if kv_cache_type != "f16":
        return True  # a quantized V cache loads only with flash attention
    from backends.descriptor import parse_gpu_backend

    return parse_gpu_backend(llama_cpp.llama_print_system_info().decode(errors="replace")) is None


def metadata_of(model: Any) -> dict[str, str]:
    """A loaded model's GGUF metadata, every key as llama.cpp reads it (values as strings)."""
    import ctypes

    import llama_cpp

    out: dict[str, str] = {}
    size = 1024
    buf = ctypes.create_string_buffer(size)
    for i in range(llama_cpp.llama_model_meta_count(model)):
        vals = []
        for fn in (llama_cpp.llama_model_meta_key_by_index, llama_cpp.llama_model_meta_val_str_by_index):
            n = fn(model, i, buf, size)
            if n >= size:
                size = n + 1
                buf = ctypes.create_string_buffer(size)
                n = fn(model, i, buf, size)
            vals.append(buf.value.decode("utf-8", errors="replace"))
        out[vals[0]] = vals[1]
    return out


_amx: bool | None = None


def amx_build() -> bool:
    """The installed llama.cpp has ggml's AMX kernels, which crash in this version
    (:data:`backends.descriptor.AMX_NOTE`): loads then turn llama.cpp's extra buffer types off. Read once; said once
    in the log, as a warning."""
    global _amx
    if _amx is None:
        import logging

        import llama_cpp

        from backends.descriptor import AMX_NOTE, has_amx_kernels

        _amx = has_amx_kernels(llama_cpp.llama_print_system_info().decode(errors="replace"))
        if _amx:
            logging.getLogger("backends.llamacpp").warning("llama-cpp-python: %s", AMX_NOTE)
    return _amx
