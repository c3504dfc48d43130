"""What is this machine? CPU, RAM, GPUs, the Metal budget, and which backends can run here.

``probe()`` answers once per process (``probe(refresh=True)`` asks again: free RAM and VRAM change)
and **never raises**: every part that cannot be read degrades to "none found" and leaves a line in
``HardwareInfo.notes`` saying why::

    >>> from localllm.hardware import probe
    >>> hw = probe()  # doctest: +SKIP
    >>> hw.physical_cores, hw.gpus, [(b.label, b.available) for b in hw.backends.values()]  # doctest: +SKIP
    (2, [], [('llama.cpp', True), ('MLX', False)])
    >>> hw.notes  # doctest: +SKIP
    ['NVML not available: NVML Shared Library Not Found', 'nvidia-smi not found on PATH']

Sources, in order of preference:

* CPU model: ``/proc/cpuinfo`` (Linux), ``sysctl machdep.cpu.brand_string`` (macOS), ``platform``.
* SIMD: ``/proc/cpuinfo`` flags (Linux x86 and ARM), ``sysctl hw.optional`` (macOS), else the CPU
  features llama.cpp reports for its own build.
* Cores and RAM: psutil (``os.cpu_count`` / ``sysconf`` if psutil is missing).
* NVIDIA: NVML through nvidia-ml-py (name, total/free VRAM, driver, compute capability), else
  ``nvidia-smi --query-gpu=... --format=csv,noheader,nounits`` with a short timeout.
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
import shutil
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from backends import descriptor
from backends.descriptor import BackendStatus, parse_gpu_backend
from backends.ggml_devices import Device

__all__ = ["BACKEND_CHOICES", "GPU", "BackendStatus", "HardwareInfo", "backend_names", "metal_budget_rule",
           "parse_gpu_backend", "parse_nvidia_smi", "probe", "probe_nvidia_smi", "probe_nvml", "schema_problem",
           "simd_from_flags"]

GiB = 1024**3
MiB = 1024**2

NVIDIA_SMI_TIMEOUT_S = 5.0
SYSCTL_TIMEOUT_S = 2.0
NVIDIA_SMI_FIELDS = "index,name,memory.total,memory.free,driver_version,compute_cap"

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


@dataclass
class GPU:
    """One GPU. On Apple Silicon ``total_bytes``/``free_bytes`` are the Metal working-set budget."""

    index: int
    name: str
    vendor: Literal["nvidia", "apple"]
    total_bytes: int
    free_bytes: int
    driver: str | None = None
    compute_capability: str | None = None  # "8.9" (NVIDIA only)


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
    devices: list[Device] = field(default_factory=list)  # llama.cpp's device list (CPU, CUDA0, RPC0...)

    @property
    def offload_devices(self) -> list[Device]:
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


# --------------------------------------------------------------------------------------- helpers


def _run(cmd: list[str], timeout: float) -> str:
    """Run ``cmd``, return stdout; raise on a missing binary, timeout or non-zero exit."""
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True,
                         stdin=subprocess.DEVNULL)
    return out.stdout


def _sysctl(name: str) -> str | None:
    try:
        value = _run(["sysctl", "-n", name], SYSCTL_TIMEOUT_S).strip()
    except Exception:
        return None
    return value or None


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return None


def _short_error(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return text or type(e).__name__


# ----------------------------------------------------------------------------------------------- CPU


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
    return int(physical or logical), int(logical)


def _ram(notes: list[str]) -> tuple[int, int]:
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.total), int(vm.available)
    except Exception as e:
        notes.append(f"psutil could not read memory ({_short_error(e)}); using sysconf")
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page
        avail = os.sysconf("SC_AVPHYS_PAGES") * page
        return int(total), int(avail)
    except (ValueError, OSError, AttributeError):
        notes.append("RAM size unknown")
        return 0, 0


# ------------------------------------------------------------------------------------------- NVIDIA


def _as_str(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def probe_nvml() -> list[GPU]:
    """NVIDIA GPUs through NVML (nvidia-ml-py). Raises on anything wrong; :func:`probe` catches."""
    import pynvml

    pynvml.nvmlInit()
    try:
        driver: str | None
        try:
            driver = _as_str(pynvml.nvmlSystemGetDriverVersion())
        except Exception:
            driver = None
        gpus = []
        for i in range(int(pynvml.nvmlDeviceGetCount())):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            try:
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
                cc: str | None = f"{major}.{minor}"
            except Exception:
                cc = None
            gpus.append(GPU(index=i, name=_as_str(pynvml.nvmlDeviceGetName(h)), vendor="nvidia",
                            total_bytes=int(mem.total), free_bytes=int(mem.free), driver=driver,
                            compute_capability=cc))
        return gpus
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def parse_nvidia_smi(text: str) -> list[GPU]:
    """Parse ``nvidia-smi --query-gpu=index,name,memory.total,memory.free,driver_version,compute_cap
    --format=csv,noheader,nounits`` (MiB). Raises ``ValueError`` on output it does not understand.

    >>> parse_nvidia_smi("0, NVIDIA GeForce RTX 4090, 24564, 23911, 550.54.14, 8.9")[0].free_bytes // MiB
    23911
    """
    gpus = []
    for line in text.strip().splitlines():
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 5:
            raise ValueError(f"unexpected line {line[:80]!r}")
        index, name, total, free, driver = parts[:5]
        cc = parts[5] if len(parts) > 5 and re.fullmatch(r"\d+\.\d+", parts[5]) else None
        gpus.append(GPU(index=int(index), name=name, vendor="nvidia", total_bytes=int(float(total) * MiB),
                        free_bytes=int(float(free) * MiB),
                        driver=driver if driver and not driver.startswith("[") else None,
                        compute_capability=cc))
    if not gpus:
        raise ValueError("no GPU lines")
    return gpus


def probe_nvidia_smi() -> list[GPU]:
    """NVIDIA GPUs through ``nvidia-smi``. Raises on anything wrong; :func:`probe` catches."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        raise FileNotFoundError("nvidia-smi not found on PATH")
    fmt = "--format=csv,noheader,nounits"
    try:
        out = _run([exe, f"--query-gpu={NVIDIA_SMI_FIELDS}", fmt], NVIDIA_SMI_TIMEOUT_S)
    except subprocess.CalledProcessError:  # drivers older than 510 do not know compute_cap
        out = _run([exe, f"--query-gpu={NVIDIA_SMI_FIELDS.rsplit(',', 1)[0]}", fmt], NVIDIA_SMI_TIMEOUT_S)
    return parse_nvidia_smi(out)


def _nvidia(notes: list[str]) -> list[GPU]:
    try:
        gpus = probe_nvml()
        if gpus:
            return gpus
        notes.append("NVML found no NVIDIA GPU")
        return []
    except ImportError as e:
        notes.append(f"NVML not available: nvidia-ml-py is not installed ({_short_error(e)})")
    except Exception as e:
        notes.append(f"NVML not available: {_short_error(e)}")
    try:
        return probe_nvidia_smi()
    except FileNotFoundError:
        notes.append("nvidia-smi not found on PATH")
    except subprocess.TimeoutExpired:
        notes.append(f"nvidia-smi did not answer within {NVIDIA_SMI_TIMEOUT_S:g} s")
    except subprocess.CalledProcessError as e:
        err = (e.stderr or e.stdout or "").strip().splitlines()
        notes.append(f"nvidia-smi failed (exit {e.returncode}): {err[0] if err else 'no output'}")
    except ValueError as e:
        notes.append(f"nvidia-smi output not understood: {e}")
    except Exception as e:
        notes.append(f"nvidia-smi failed: {_short_error(e)}")
    return []


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
        notes.append(f"Metal budget not read from MLX ({_short_error(e)})")
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
        notes.append(f"{what} probe failed: {_short_error(e)}")
        return fallback


# --------------------------------------------------------------------------------------------- probe

_cache: HardwareInfo | None = None
_lock = threading.Lock()


def _probe() -> HardwareInfo:
    notes: list[str] = []
    os_name = platform.system() or "unknown"
    arch = platform.machine() or "unknown"
    cpuinfo = _read_text("/proc/cpuinfo") if os_name == "Linux" else None
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
        gpus = _guarded(lambda: _nvidia(notes), [], notes, "NVIDIA")

    backends = {b.name: _backend_status(b, notes) for b in descriptor.registered()}
    devices: list[Device] = []
    if backends.get("llamacpp") is not None and backends["llamacpp"].available:
        from backends import ggml_devices

        devices = _guarded(ggml_devices.list_devices, [], notes, "llama.cpp devices")
    for b in backends.values():
        if simd:
            break  # e.g. Windows: take the CPU features a backend's build reports (llama.cpp's system info)
        simd = [n for n in _SIMD_ORDER if re.search(rf"\b{re.escape(n)}\s*=\s*1", b.detail, re.IGNORECASE)]
    return HardwareInfo(os=os_name, arch=arch, cpu_model=cpu_model, physical_cores=physical, logical_cores=logical,
                        simd=simd, ram_total=ram_total, ram_available=ram_available, gpus=gpus,
                        apple_silicon=apple, metal_budget=metal_budget, backends=backends, notes=notes,
                        devices=devices)


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
                                      notes=[f"hardware probe failed: {_short_error(e)}"])
        return _cache
