"""What is this machine? CPU, RAM, GPUs, the Metal budget, and which backends can run here.

``probe()`` answers once per process (``probe(refresh=True)`` asks again: free RAM and VRAM change)
and **never raises**: every part that cannot be read degrades to "none found" and leaves a line in
``HardwareInfo.notes`` saying why. On a 2-core machine without a GPU::

    from localllm.hardware import probe
    hw = probe()
    hw.physical_cores, hw.gpus, [(b.label, b.available) for b in hw.backends.values()]
    # (2, [], [('llama.cpp', True), ('MLX', False)])
    hw.notes
    # ['NVML not available: NVML Shared Library Not Found', 'nvidia-smi not found on PATH']

Sources, in order of preference:

* CPU model: ``/proc/cpuinfo`` (Linux), ``sysctl machdep.cpu.brand_string`` (macOS), ``platform``.
* SIMD: ``/proc/cpuinfo`` flags (Linux x86 and ARM), ``sysctl hw.optional`` (macOS), else the CPU
  features llama.cpp reports for its own build.
* Cores and RAM: psutil (``os.cpu_count`` / ``sysconf`` if psutil is missing).
* GPUs (:mod:`localllm.gpus`). NVIDIA: NVML through nvidia-ml-py (name, total/free VRAM, driver, compute
  capability), else ``nvidia-smi --query-gpu=... --format=csv,noheader,nounits`` with a short timeout.
* AMD and Intel GPUs (and an NVIDIA card NVML does not see), Linux: ``/sys/class/drm/card*/device``
  (PCI ``vendor``/``device``, amdgpu's ``mem_info_vram_total``/``mem_info_vram_used``, ``product_name``), named
  by ``rocm-smi --showproductname`` / ``vulkaninfo --summary`` when they are on PATH (short timeouts). Listed
  whether or not the llama.cpp build can use them: a GPU the build cannot use is what the planner's advice
  is about. ``LOCALLLM_SYSFS_ROOT`` (or :func:`probe_drm`'s ``root``) points the scan at another tree.
* llama.cpp's own device list (``HardwareInfo.devices``): every device of the installed build through ggml's
  registry (:mod:`backends.llamacpp.devices`) — CPU, CUDA, ROCm, Vulkan, Metal, SYCL, RPC workers — with free/total
  memory; this is what the build can actually use. ``HardwareInfo.rpc``: the build has the RPC backend.
* Apple Silicon Metal working-set budget: ``mx.device_info()["max_recommended_working_set_size"]``
  (Metal's ``recommendedMaxWorkingSetSize``) when MLX is importable; an ``iogpu.wired_limit_mb``
  the user raised; else Ollama's former rule (``gpu/gpu_darwin.go``): 2/3 of RAM up to 36 GiB,
  3/4 above.
* Backends: each registered backend's own check (:meth:`backends.descriptor.Backend.status`: for llama.cpp
  ``llama_cpp`` importable, ``llama_supports_gpu_offload()`` and the GPU backend compiled in; for MLX
  ``mlx.core`` + ``mlx_lm`` importable and MLX's default device), the same check that decides whether the
  backend loads.
"""

from __future__ import annotations

import os
import platform
import re
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from backends import descriptor
from backends.descriptor import BackendStatus
from localllm.gpus import (
    GPU,
    nvidia_gpus,
    other_gpus,
    read_text,
    run_tool,
    short_error,
)

__all__ = ["BACKEND_CHOICES", "HardwareInfo", "backend_names", "probe"]

GiB = 1024**3
MiB = 1024**2

SYSCTL_TIMEOUT_S = 2.0

# SIMD features worth showing (they decide which llama.cpp kernels run), as /proc/cpuinfo spells
# them → the name we show. ARM Linux spells NEON "asimd", dot product "asimddp", fp16 "asimdhp".
_SIMD_NAMES: dict[str, str] = {
    "sse3": "sse3", "pni": "sse3", "ssse3": "ssse3", "sse4_1": "sse4_1", "sse4_2": "sse4_2",
    "avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c", "avx_vnni": "avx_vnni",
    "avx512f": "avx512f", "avx512cd": "avx512cd", "avx512bw": "avx512bw", "avx512dq": "avx512dq",
    "avx512vl": "avx512vl", "avx512_vnni": "avx512_vnni", "avx512vnni": "avx512_vnni",
    "avx512_bf16": "avx512_bf16", "avx512vbmi": "avx512_vbmi", "avx512_vbmi": "avx512_vbmi",
    "avx512ifma": "avx512ifma", "avx512_fp16": "avx512_fp16",
    "amx_tile": "amx_tile", "amx_int8": "amx_int8", "amx_bf16": "amx_bf16",
    "neon": "neon", "asimd": "neon", "asimdhp": "fp16", "fphp": "fp16", "asimddp": "dotprod",
    "i8mm": "i8mm", "bf16": "bf16", "sve": "sve", "sve2": "sve2", "sme": "sme", "sme2": "sme2",
}
_SIMD_ORDER = list(dict.fromkeys(_SIMD_NAMES.values()))

# macOS sysctl hw.optional.* → the name we show
_MAC_ARM_FEATURES = {
    "hw.optional.neon": "neon", "hw.optional.arm.FEAT_FP16": "fp16",
    "hw.optional.arm.FEAT_DotProd": "dotprod", "hw.optional.arm.FEAT_I8MM": "i8mm",
    "hw.optional.arm.FEAT_BF16": "bf16", "hw.optional.arm.FEAT_SME": "sme",
    "hw.optional.arm.FEAT_SME2": "sme2",
}


@dataclass(frozen=True)
class LlamaDevice:
    """One device of the installed llama.cpp build's own list (ggml's registry), as the faces see it.

    The same fields as :class:`backends.llamacpp.devices.Device`, with ``offloads``/``remote``/``endpoint`` as data so
    that ``probe --json`` carries them.
    """

    index: int  # position in ggml's device list (what llama.cpp's split uses)
    name: str  # "CPU", "CUDA0", "ROCm0", "Vulkan0", "Metal", "RPC0"
    description: str  # "NVIDIA GeForce RTX 4090", the CPU model, or an RPC worker's "host:port"
    type: Literal["cpu", "gpu", "igpu", "accel"]
    free_bytes: int
    total_bytes: int
    backend: str  # "CPU", "CUDA", "ROCm", "Vulkan", "Metal", "RPC"...
    offloads: bool = False  # layers can go here (every device but the CPU)
    remote: bool = False  # an RPC worker's device
    endpoint: str | None = None  # the worker's host:port (remote devices)


@dataclass
class HardwareInfo:
    os: str  # "Linux", "Darwin", "Windows"
    arch: str  # "x86_64", "arm64", "aarch64"
    cpu_model: str
    physical_cores: int
    logical_cores: int
    simd: list[str]
    ram_total: int
    ram_available: int
    gpus: list[GPU] = field(default_factory=list)
    apple_silicon: bool = False
    metal_budget: int | None = None  # bytes Metal may keep resident (Apple Silicon only)
    backends: dict[str, BackendStatus] = field(default_factory=dict)  # every registered backend, by name
    notes: list[str] = field(default_factory=list)  # why something was not found
    devices: list[LlamaDevice] = field(default_factory=list)  # llama.cpp's own device list ([] when unreadable)
    rpc: bool = False  # the llama.cpp build has the RPC backend (``-DGGML_RPC=on``)

    @property
    def offload_devices(self) -> list[LlamaDevice]:
        """llama.cpp's devices that take layers (all but the CPU), in its device-list order."""
        return [d for d in self.devices if d.offloads]

    @property
    def nvidia_gpus(self) -> list[GPU]:
        return [g for g in self.gpus if g.vendor == "nvidia"]

    def backend(self, name: str) -> BackendStatus:
        """The status of ``name``; an unknown/unprobed backend reads as unavailable."""
        return self.backends.get(name) or BackendStatus(name, False, "not probed", False)

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (``json.dumps(hw.as_dict())`` works)."""
        return asdict(self)


# ----------------------------------------------------------------------------------------------- CPU


def _sysctl(name: str) -> str | None:
    try:
        value = run_tool(["sysctl", "-n", name], SYSCTL_TIMEOUT_S).strip()
    except Exception:
        return None
    return value or None


def _cpu_model(os_name: str, cpuinfo: str | None) -> str:
    if cpuinfo:
        for key in ("model name", "Hardware", "cpu model", "Model", "Processor"):
            m = re.search(rf"^{key}\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
            if m and m.group(1).strip():
                return m.group(1).strip()
    if os_name == "Darwin":
        brand = _sysctl("machdep.cpu.brand_string")
        if brand:
            return brand
    return platform.processor() or platform.machine() or "unknown CPU"


def simd_from_flags(flags: str) -> list[str]:
    """Map a cpuinfo ``flags``/``Features`` line to the SIMD names we show, in a stable order.

    >>> simd_from_flags("fpu sse sse2 pni ssse3 fma avx avx2 avx512f")
    ['sse3', 'ssse3', 'avx', 'avx2', 'fma', 'avx512f']
    >>> simd_from_flags("fp asimd asimdhp asimddp sve i8mm")
    ['neon', 'fp16', 'dotprod', 'i8mm', 'sve']
    """
    found = {_SIMD_NAMES[f] for f in flags.split() if f in _SIMD_NAMES}
    return [name for name in _SIMD_ORDER if name in found]


def _simd(os_name: str, arch: str, cpuinfo: str | None) -> list[str]:
    if cpuinfo:
        m = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", cpuinfo, re.MULTILINE)
        if m:
            return simd_from_flags(m.group(1))
    if os_name == "Darwin":
        if arch in ("arm64", "aarch64"):
            found = [name for key, name in _MAC_ARM_FEATURES.items() if _sysctl(key) == "1"]
            return [n for n in _SIMD_ORDER if n in found] or ["neon"]
        feats = " ".join(filter(None, (_sysctl("machdep.cpu.features"), _sysctl("machdep.cpu.leaf7_features"))))
        return simd_from_flags(feats.lower().replace(".", "_"))
    if arch in ("arm64", "aarch64"):
        return ["neon"]  # NEON is mandatory on AArch64
    return []


def _cores() -> tuple[int, int]:
    logical = os.cpu_count() or 1
    physical = None
    try:
        import psutil

        logical = psutil.cpu_count(logical=True) or logical
        physical = psutil.cpu_count(logical=False)
    except Exception:
        pass
    # a process limited to some cores (taskset, a container's cpuset) runs its threads there only
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical
    return int(min(physical or logical, usable)), int(min(logical, usable))


def _ram(notes: list[str]) -> tuple[int, int]:
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.total), int(vm.available)
    except Exception as e:
        notes.append(f"psutil could not read memory ({short_error(e)}); using sysconf")
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page
        avail = os.sysconf("SC_AVPHYS_PAGES") * page
        return int(total), int(avail)
    except (ValueError, OSError, AttributeError):
        notes.append("RAM size unknown")
        return 0, 0


# ------------------------------------------------------------------------------ llama.cpp's devices


def _llama_devices(backend: descriptor.Backend, notes: list[str]) -> tuple[list[LlamaDevice], bool]:
    """The backend's own device list (llama.cpp's: ggml's registry) and whether its build has RPC; ([], False)
    and a note when unreadable."""
    try:
        found, rpc = backend.device_list()
    except Exception as e:  # no llama_cpp, a library without the registry symbols, ...
        notes.append(f"{backend.label}'s device list not read: {short_error(e)}")
        return [], False
    return [LlamaDevice(index=d.index, name=d.name, description=d.description, type=d.type,
                        free_bytes=d.free_bytes, total_bytes=d.total_bytes, backend=d.backend, offloads=d.offloads,
                        remote=d.remote, endpoint=d.description if d.remote else None) for d in found], rpc


# -------------------------------------------------------------------------------------------- Apple


def metal_budget_rule(ram_total: int) -> int:
    """Ollama's former rule for Metal's working-set budget (``gpu/gpu_darwin.go``): 2/3 of RAM on
    machines with up to 36 GiB, 3/4 above. Metal's own ``recommendedMaxWorkingSetSize`` is better.

    >>> round(metal_budget_rule(16 * GiB) / GiB, 2), metal_budget_rule(64 * GiB) / GiB
    (10.67, 48.0)
    """
    return ram_total * 2 // 3 if ram_total <= 36 * GiB else ram_total * 3 // 4


def _mlx_device_info() -> dict[str, Any]:
    import mlx.core as mx

    info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    return dict(info)


def _metal_budget(ram_total: int, notes: list[str]) -> int:
    wired = _sysctl("iogpu.wired_limit_mb")
    if wired and wired.isdigit() and int(wired) > 0:
        notes.append(f"Metal budget from iogpu.wired_limit_mb = {wired} (raised by the user)")
        return int(wired) * MiB
    try:
        value = _mlx_device_info().get("max_recommended_working_set_size")
        if value:
            return int(value)
        notes.append("MLX reports no max_recommended_working_set_size")
    except Exception as e:
        notes.append(f"Metal budget not read from MLX ({short_error(e)})")
    notes.append("Metal budget estimated as 2/3 of RAM (≤ 36 GiB) or 3/4 (above), Ollama's former rule")
    return metal_budget_rule(ram_total)


def _is_apple_silicon(os_name: str, arch: str, notes: list[str]) -> bool:
    if os_name != "Darwin":
        return False
    if arch == "arm64":
        return True
    if _sysctl("hw.optional.arm64") == "1":  # x86_64 Python under Rosetta on an Apple Silicon Mac
        notes.append("Python runs under Rosetta (x86_64): install an arm64 Python to use Metal and MLX")
    return False


# ------------------------------------------------------------------------------------------ backends


def backend_names() -> list[str]:
    """Every registered backend's name (what ``--backend`` takes besides ``auto``)."""
    return descriptor.names()


class _Choices(Sequence[str]):
    """``"auto"`` and every registered backend's name, read from the registry each time it is looked at (a
    backend registered after this module was imported is in it)."""

    def _all(self) -> tuple[str, ...]:
        return ("auto", *descriptor.names())

    def __getitem__(self, i: Any) -> Any:
        return self._all()[i]

    def __len__(self) -> int:
        return len(self._all())

    def __repr__(self) -> str:
        return repr(self._all())


BACKEND_CHOICES: Sequence[str] = _Choices()


def _backend_status(b: descriptor.Backend, notes: list[str]) -> BackendStatus:
    return _guarded(b.status, BackendStatus(b.name, False, "probe failed", False, label=b.label), notes, b.label)


def schema_problem(schema: Any, backend: str = "auto") -> str | None:
    """The first thing in a JSON schema that ``backend``'s structured output cannot follow (one sentence), or
    None. For ``"auto"`` (the planner picks per model) a schema is refused only when no backend that runs here
    can follow it, in the words of the one the planner tries first."""
    if backend != "auto":
        return descriptor.get(backend).schema_problem(schema)
    hw = probe()
    order = descriptor.ranked(hw.apple_silicon)
    runnable = [b for b in order if hw.backend(b.name).available] or order[:1]
    first = None
    for b in runnable:
        problem = b.schema_problem(schema)
        if problem is None:
            return None
        first = first or problem
    return first


def _guarded(fn, fallback, notes: list[str], what: str):
    try:
        return fn()
    except Exception as e:  # a bug in one probe must not take the others down
        notes.append(f"{what} probe failed: {short_error(e)}")
        return fallback


# --------------------------------------------------------------------------------------------- probe

_cache: HardwareInfo | None = None
_lock = threading.Lock()


def _probe() -> HardwareInfo:
    notes: list[str] = []
    os_name = platform.system() or "unknown"
    arch = platform.machine() or "unknown"
    cpuinfo = read_text("/proc/cpuinfo") if os_name == "Linux" else None
    cpu_model = _guarded(lambda: _cpu_model(os_name, cpuinfo), "unknown CPU", notes, "CPU model")
    simd = _guarded(lambda: _simd(os_name, arch, cpuinfo), [], notes, "SIMD")
    physical, logical = _guarded(_cores, (os.cpu_count() or 1,) * 2, notes, "core count")
    ram_total, ram_available = _guarded(lambda: _ram(notes), (0, 0), notes, "RAM")
    apple = _guarded(lambda: _is_apple_silicon(os_name, arch, notes), False, notes, "Apple Silicon")

    gpus: list[GPU] = []
    metal_budget = None
    if apple:
        metal_budget = _guarded(lambda: _metal_budget(ram_total, notes), metal_budget_rule(ram_total), notes,
                                "Metal budget")
        gpus.append(GPU(0, f"{cpu_model} GPU", "apple", metal_budget, metal_budget))
    elif os_name != "Darwin":  # no NVIDIA driver exists for current macOS
        gpus = _guarded(lambda: nvidia_gpus(notes), [], notes, "NVIDIA")
    if os_name == "Linux":
        gpus += _guarded(lambda: other_gpus(gpus, notes), [], notes, "sysfs GPU")

    backends = {b.name: _backend_status(b, notes) for b in descriptor.registered()}
    devices: list[LlamaDevice] = []
    rpc = False
    # the device list of the backend that has one (llama.cpp), where it runs (else its line says why)
    listing = next((b for b in descriptor.registered() if b.devices and backends[b.name].available), None)
    if listing is not None:
        devices, rpc = _guarded(lambda: _llama_devices(listing, notes), ([], False), notes, f"{listing.label} device")
    for b in backends.values():
        if simd:
            break  # e.g. Windows: take the CPU features a backend's build reports (llama.cpp's system info)
        simd = [n for n in _SIMD_ORDER if re.search(rf"\b{re.escape(n)}\s*=\s*1", b.detail, re.IGNORECASE)]
    return HardwareInfo(os=os_name, arch=arch, cpu_model=cpu_model, physical_cores=physical, logical_cores=logical,
                        simd=simd, ram_total=ram_total, ram_available=ram_available, gpus=gpus,
                        apple_silicon=apple, metal_budget=metal_budget, backends=backends, notes=notes,
                        devices=devices, rpc=rpc)


def probe(*, refresh: bool = False) -> HardwareInfo:
    """Probe this machine (cached per process; ``refresh=True`` re-reads it). Never raises."""
    global _cache
    with _lock:
        if _cache is None or refresh:
            try:
                _cache = _probe()
            except Exception as e:  # last line of defence: a minimal, honest answer
                _cache = HardwareInfo(os=platform.system(), arch=platform.machine(), cpu_model="unknown CPU",
                                      physical_cores=os.cpu_count() or 1, logical_cores=os.cpu_count() or 1,
                                      simd=[], ram_total=0, ram_available=0,
                                      notes=[f"hardware probe failed: {short_error(e)}"])
        return _cache
