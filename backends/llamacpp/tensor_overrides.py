"""Where a load's weights go: onto which llama.cpp devices (:func:`place_on_devices`), and which stay in host
memory though their layer is offloaded (llama.cpp's tensor buffer-type overrides).

A mixture of experts on a device too small for it runs best with attention and the shared tensors on the device
and the expert tensors in RAM (llama.cpp's ``--cpu-moe`` / ``--n-cpu-moe N``). The binding declares
``llama_model_params.tensor_buft_overrides`` as a bare pointer; llama.cpp reads it as a NULL-terminated array of
``{const char *pattern; ggml_backend_buffer_type_t buft}``, matches each tensor's name with ``std::regex_search``
and puts the first match in that buffer type. :class:`CPUOverrides` builds that array, with the CPU buffer type
from ggml's registry (the pointer llama.cpp compares with ``ggml_backend_cpu_buffer_type()``), and owns it: keep
the object for the model's life (llama.cpp reads the patterns during the load)::

    >>> expert_patterns(2)
    ['blk\\\\.0\\\\.ffn_(up|down|gate|gate_up)_(ch|)exps', 'blk\\\\.1\\\\.ffn_(up|down|gate|gate_up)_(ch|)exps']
    >>> import re; bool(re.search(expert_patterns(2)[1], "blk.1.ffn_gate_up_exps.weight"))
    True
    >>> bool(re.search(expert_patterns(2)[1], "blk.11.ffn_up_exps.weight"))
    False
"""

from __future__ import annotations

import ctypes
from typing import Any

# llama.cpp's own (common/common.h LLM_FFN_EXPS_REGEX and llm_ffn_block_regex)
EXPERTS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"


class _Override(ctypes.Structure):
    """``struct llama_model_tensor_buft_override`` (include/llama.h)."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def expert_patterns(n_layers: int) -> list[str]:
    """The patterns of the expert tensors of layers ``0..n_layers-1`` (``--n-cpu-moe N``'s, in llama.cpp's
    order), the layer number anchored so that ``blk.1`` does not match ``blk.11``."""
    return [rf"blk\.{i}{EXPERTS_REGEX}" for i in range(max(n_layers, 0))]


class CPUOverrides:
    """A NULL-terminated override array keeping the tensors that match ``patterns`` in host memory; it owns the
    pattern strings and the array (ctypes memory) until it is dropped."""

    def __init__(self, patterns: list[str]):
        from backends.llamacpp import devices as ggml_devices
        buft = ggml_devices.cpu_buffer_type()
        self.patterns = list(patterns)
        self._strings = [ctypes.create_string_buffer(p.encode()) for p in self.patterns]
        self._array = (_Override * (len(self.patterns) + 1))()
        for entry, s in zip(self._array, self._strings, strict=False):
            entry.pattern = ctypes.cast(s, ctypes.c_char_p)
            entry.buft = buft
        self._array[len(self.patterns)].pattern = None  # the terminator
        self._array[len(self.patterns)].buft = None

    def apply(self, model_params: Any) -> None:
        """Point ``llama_model_params.tensor_buft_overrides`` at this array."""
        model_params.tensor_buft_overrides = ctypes.cast(self._array, ctypes.c_void_p)


def experts_on_cpu(model_params: Any, n_cpu_moe: int) -> CPUOverrides | None:
    """Keep the expert tensors of the first ``n_cpu_moe`` layers in RAM for this load (None: nothing to keep).
    Hold the result as long as the model lives."""
    if n_cpu_moe <= 0:
        return None
    ov = CPUOverrides(expert_patterns(n_cpu_moe))
    ov.apply(model_params)
    return ov


def place_on_devices(model_params: Any, names: list[str], split: list[float]) -> list[Any]:
    """Load onto exactly these llama.cpp devices (in this order), split by ``split`` (their shares; ignored unless
    one per device). Returns the ctypes arrays llama.cpp reads during the load: hold them until it is done.
    Raises :class:`~backends.contract.errors.ModelLoadError` naming the devices there are when one is unknown."""
    from backends.contract.errors import ModelLoadError
    from backends.llamacpp import devices as ggml_devices

    handles = []
    for n in names:
        h = ggml_devices.device_handle(n)
        if h is None:
            known = ", ".join(d.name for d in ggml_devices.list_devices())
            raise ModelLoadError(f"No llama.cpp device {n!r} (devices: {known}).")
        handles.append(h)
    arr = (ctypes.c_void_p * (len(handles) + 1))(*handles, None)
    model_params.devices = ctypes.cast(arr, ctypes.c_void_p)
    keep: list[Any] = [arr]
    if split and len(split) == len(handles) and sum(split) > 0:
        fl = (ctypes.c_float * 128)(*split)  # llama_max_devices() floats are read
        model_params.tensor_split = ctypes.cast(fl, ctypes.POINTER(ctypes.c_float))
        keep.append(fl)
    return keep
