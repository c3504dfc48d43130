"""llama.cpp's quantizer (``llama_model_quantize``, what ``llama-quantize`` runs) on GGUF files: the types it
takes by their usual names (``q4_K_M``, ``q8_0``, ``f16``, ...), case-insensitive.

Imports nothing from ``localllm``; the store calls it for ``create --quantize`` (and ``localllm quantize``).
"""

from __future__ import annotations

import os
from pathlib import Path

from backends.base import BackendError


def quant_types() -> dict[str, int]:
    """Type name (as llama-quantize spells it: ``Q4_K_M``, ``F16``) → llama.cpp's ftype value."""
    import llama_cpp

    out: dict[str, int] = {}
    for attr in dir(llama_cpp):
        if attr.startswith("LLAMA_FTYPE_MOSTLY_"):
            out[attr.removeprefix("LLAMA_FTYPE_MOSTLY_")] = int(getattr(llama_cpp, attr))
    out["F32"] = int(llama_cpp.LLAMA_FTYPE_ALL_F32)
    return out


def canonical_type(name: str) -> str:
    """``q4_k_m`` → ``Q4_K_M``; an unknown type is a :class:`BackendError` naming the ones that exist."""
    types = quant_types()
    key = name.strip().upper()
    if key not in types:
        common = [t for t in ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0", "F16", "BF16") if t in types]
        raise BackendError(f"Unknown quantization type {name!r}: llama.cpp's quantizer takes "
                           f"{', '.join(common)} and {len(types) - len(common)} more (IQ and TQ types, Q2_K, ...).")
    return key


def quantize(src: str | os.PathLike[str], dst: str | os.PathLike[str], type_name: str, *,
             allow_requantize: bool = False, n_threads: int = 0) -> None:
    """Write ``src`` quantized to ``type_name`` at ``dst`` (the caller makes ``dst`` a temporary name and renames
    it once this returns: llama.cpp writes in place). ``allow_requantize`` lets an already quantized model be
    quantized again (llama.cpp warns that this costs quality). Raises :class:`BackendError` in one sentence."""
    import llama_cpp

    from backends.llamacpp import install_log_router

    install_log_router()  # the quantizer logs every tensor: into logging, not onto the user's terminal
    key = canonical_type(type_name)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = quant_types()[key]
    params.allow_requantize = allow_requantize
    params.nthread = n_threads or (os.cpu_count() or 1)
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise BackendError(f"llama.cpp's quantizer could not make {key} of {Path(src).name} (it returned {rc}; "
                           f"LOCALLLM_DEBUG=1 shows its log).")
