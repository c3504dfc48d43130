"""Facts the llama.cpp source checks before and while it loads: the host's physical cores, whether a KV cache
type fits the model's head sizes, the GGUF's header, its head sizes and its own pooling."""

from __future__ import annotations

import os
from pathlib import Path

from backends.contract.errors import ModelLoadError
from backends.descriptor import KV_CACHE_TYPES

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
