"""llama.cpp's own log lines, routed into Python logging (``backends.llamacpp.native``, quiet by default), and what the
llama.cpp source reads from them: the buffers it allocated per device, the reason behind a failed load."""

from __future__ import annotations

import ctypes
import logging
import re
import threading
from collections import deque
from typing import Any

native_log = logging.getLogger("backends.llamacpp.native")  # llama.cpp's own messages
native_log.addHandler(logging.NullHandler())  # quiet unless the application configures logging

MiB = 1 << 20


# ------------------------------------------------------------------------------------ native logging

# ggml_log_level: NONE=0, DEBUG=1, INFO=2, WARN=3, ERROR=4, CONT=5 (llama-cpp-python's _logger.py has the old order)
_GGML_LEVELS = {0: logging.CRITICAL, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_log_state: dict[str, Any] = {"cb": None, "level": logging.DEBUG, "buf": "", "verbose": False}
_recent_native: deque[str] = deque(maxlen=40)  # recent WARN/ERROR lines, to explain load failures
capture = threading.local()  # .lines: the loading thread's llama.cpp lines (buffer sizes per device)
# "load_tensors: RPC0[127.0.0.1:50052] model buffer size =    33.82 MiB", "sched_reserve: CPU compute buffer ..."
_BUFFER_LINE = re.compile(r"^\w+:\s+(\S+?)\s+(model|KV|RS|compute|output) buffer size =\s*([0-9.]+) MiB")


def _on_native_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    try:
        if level != 5:  # 5 = GGML_LOG_LEVEL_CONT: continues the previous message
            _log_state["level"] = _GGML_LEVELS.get(level, logging.DEBUG)
        lvl = _log_state["level"]
        _log_state["buf"] += text.decode("utf-8", errors="replace")
        if not _log_state["buf"].endswith("\n"):
            return
        msg, _log_state["buf"] = _log_state["buf"].rstrip(), ""
        lines = getattr(capture, "lines", None)
        if lines is not None and ("buffer size" in msg or "Flash Attention" in msg):
            lines.append(msg)
        if lvl >= logging.WARNING:
            _recent_native.append(msg)
        if native_log.isEnabledFor(lvl):
            native_log.log(lvl, "%s", msg)
    except Exception:  # never let an exception cross into C
        pass


def allocations(lines: list[str], workers: dict[str, list[str]]) -> dict[str, dict[str, int]]:
    """What llama.cpp says it allocated, per device: {"RPC0": {"weights": b, "kv": b, "compute": b}, "CPU": ...}.

    ``workers``: endpoint → device names (ggml names a worker's buffers ``RPC<k>[host:port]``, k its device
    there). Host-side buffers (``CPU_Mapped``, ``CUDA_Host``, ``CPU_REPACK``) count as CPU.

    >>> allocations(["load_tensors: RPC0[127.0.0.1:50052] model buffer size =    33.82 MiB",
    ...              "sched_reserve:        CPU compute buffer size =     7.68 MiB"], {"127.0.0.1:50052": ["RPC3"]})
    {'RPC3': {'weights': 35462840}, 'CPU': {'compute': 8053063}}
    """
    kinds = {"model": "weights", "KV": "kv", "RS": "kv", "compute": "compute", "output": "compute"}  # RS: recurrent
    out: dict[str, dict[str, int]] = {}
    for line in lines:
        m = _BUFFER_LINE.match(line)
        if not m:
            continue
        buf, kind, mib = m.group(1), kinds[m.group(2)], float(m.group(3))
        rpc = re.fullmatch(r"RPC(\d+)\[(.+)\]", buf)
        if rpc:
            names = workers.get(rpc.group(2)) or []
            k = int(rpc.group(1))
            dev = names[k] if k < len(names) else f"RPC[{rpc.group(2)}]"
        elif buf.startswith("CPU") or buf.endswith("_Host"):
            dev = "CPU"
        else:
            dev = buf
        slot = out.setdefault(dev, {})
        slot[kind] = slot.get(kind, 0) + int(mib * MiB)
    return out


def install_log_router(verbose: bool = False) -> None:
    """Route llama.cpp/ggml logging to the ``backends.llamacpp.native`` logger (quiet by default).

    ``verbose`` adds a stderr handler at DEBUG level (``LOCALLLM_DEBUG``). The ctypes callback is kept
    alive in module state: llama.cpp holds a raw pointer to it.
    """
    import llama_cpp

    if _log_state["cb"] is None:
        _log_state["cb"] = llama_cpp.llama_log_callback(_on_native_log)
        llama_cpp.llama_log_set(_log_state["cb"], ctypes.c_void_p(0))
    if verbose and not _log_state["verbose"]:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("llama.cpp: %(message)s"))
        native_log.addHandler(handler)
        native_log.setLevel(logging.DEBUG)
        _log_state["verbose"] = True


def native_reason(*needles: str) -> str | None:
    """The most recent llama.cpp warning/error line containing one of ``needles`` (or the last one)."""
    for line in reversed(_recent_native):
        if not needles or any(n in line for n in needles):
            return line.split(": ", 1)[-1].strip().rstrip(".")
    return None


def forget_recent() -> None:
    """Forget the warnings seen so far: what :func:`native_reason` finds next comes from the call after this."""
    _recent_native.clear()


def log_callback() -> Any:
    """The ctypes callback :func:`install_log_router` installed (None before), for libraries (mtmd) that take one."""
    return _log_state["cb"]
