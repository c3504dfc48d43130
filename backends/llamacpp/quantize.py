"""llama.cpp's quantizer (``llama_model_quantize``, what ``llama-quantize`` runs) on GGUF files: the types it
takes by their usual names (``q4_K_M``, ``q8_0``, ``f16``, ...), case-insensitive.

Imports nothing from ``localllm``; the store calls it for ``create --quantize`` (and ``localllm quantize``).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from backends.contract.errors import BackendError

# (bytes written so far, the planned size of the output file; 0 = unknown)
QuantizeProgress = Callable[[int, int], None]
POLL_SECONDS = 0.2  # how often the output file's size is read while llama.cpp writes it


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


def _params(key: str, allow_requantize: bool, n_threads: int) -> Any:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = quant_types()[key]
    params.allow_requantize = allow_requantize
    params.nthread = n_threads or (os.cpu_count() or 1)
    return params


@contextmanager
def _native_lines() -> Iterator[list[str]]:
    """The llama.cpp log lines this thread produces meanwhile (the quantizer's plan is only in its log): a filter
    on the router's logger takes this thread's records; those under the logger's own level go nowhere else, as
    they would not have without it (the rest of the process logs as before)."""
    from backends.llamacpp._log import install_log_router, native_log

    install_log_router()
    me, lines = threading.get_ident(), []
    floor = native_log.getEffectiveLevel()

    def take(record: logging.LogRecord) -> bool:
        if record.thread == me:
            lines.append(record.getMessage())
        return record.levelno >= floor

    old_level = native_log.level
    native_log.addFilter(take)
    native_log.setLevel(min(floor, logging.INFO))
    try:
        yield lines
    finally:
        native_log.setLevel(old_level)
        native_log.removeFilter(take)


# "[  12/ 273] blk.0.attn_q.weight - [  576,   576,     1,     1], type =    f32, size = ... (q8_0)"
_PLAN_LINE = re.compile(r"^\[\s*\d+/\s*\d+\]\s+(\S+)\s+-.*?type\s*=\s*(\w+),.*?(?:\((\w+)\))?\s*$")


def planned_size(src: str | os.PathLike[str], type_name: str, *, allow_requantize: bool = False) -> int:
    """The size in bytes of the file :func:`quantize` will write (0 when this llama.cpp cannot say): llama.cpp's
    own plan (its ``dry_run``: which type each tensor gets, fallbacks and ``_M`` mixes included, nothing
    written), each tensor's rows at that type's row size, padded to the file's alignment, after the source's
    header (the output's differs by a key or two). It reads the source's header, not its weights: fast."""
    import llama_cpp
    from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType

    from backends.gguf_header import GGUFHeaderError, read_header

    key = canonical_type(type_name)
    params = _params(key, allow_requantize, 1)
    if not hasattr(params, "dry_run"):
        return 0
    params.dry_run = True
    try:
        header = read_header(src)
    except (GGUFHeaderError, OSError):
        return 0
    with _native_lines() as lines:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), b"", params)
    if rc != 0:
        return 0
    targets: dict[str, str] = {}
    for line in lines:
        m = _PLAN_LINE.match(line.strip())
        if m:
            targets[m.group(1)] = (m.group(3) or m.group(2)).upper()
    align = header.fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    total = header.data_offset
    for t in header.tensors:
        name = targets.get(t.name, t.type.name)
        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
        except KeyError:
            return 0
        n = t.n_elements * size // block
        total += -(-n // align) * align
    return total


def quantize(src: str | os.PathLike[str], dst: str | os.PathLike[str], type_name: str, *,
             allow_requantize: bool = False, n_threads: int = 0, progress: QuantizeProgress | None = None,
             planned: int | None = None) -> None:
    """Write ``src`` quantized to ``type_name`` at ``dst`` (the caller makes ``dst`` a temporary name and renames
    it once this returns: llama.cpp writes in place). ``allow_requantize`` lets an already quantized model be
    quantized again (llama.cpp warns that this costs quality). Raises :class:`BackendError` in one sentence.

    ``progress(written, total)``: llama.cpp's quantizer has no progress callback, but it writes the output file
    tensor by tensor, so a thread reads that file's size every :data:`POLL_SECONDS` against
    :func:`planned_size` (``total``: ``planned`` when the caller has it already; 0 when unknown); the last call
    gives the finished file's size as both."""
    import llama_cpp

    from backends.llamacpp._log import install_log_router

    install_log_router()  # the quantizer logs every tensor: into logging, not onto the user's terminal
    key = canonical_type(type_name)
    params = _params(key, allow_requantize, n_threads)
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    done = threading.Event()
    watcher: threading.Thread | None = None
    if progress is not None:
        total = planned if planned is not None else planned_size(src, key, allow_requantize=allow_requantize)
        progress(0, total)

        def watch() -> None:
            while not done.wait(POLL_SECONDS):
                try:
                    written = os.stat(dst).st_size
                except OSError:
                    continue
                progress(min(written, total) if total else written, total)

        watcher = threading.Thread(target=watch, name="localllm-quantize-progress", daemon=True)
        watcher.start()
    try:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    finally:
        done.set()
        if watcher is not None:
            watcher.join()
    if rc != 0:
        raise BackendError(f"llama.cpp's quantizer could not make {key} of {Path(src).name} (it returned {rc}; "
                           f"LOCALLLM_DEBUG=1 shows its log).")
    if progress is not None:
        size = os.stat(dst).st_size
        progress(size, size)
