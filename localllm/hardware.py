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
* AMD and Intel GPUs (and an NVIDIA card NVML does not see), Linux: ``/sys/class/drm/card*/device``
  (PCI ``vendor``/``device``, amdgpu's ``mem_info_vram_total``/``mem_info_vram_used``, ``product_name``), named
  by ``rocm-smi --showproductname`` / ``vulkaninfo --summary`` when they are on PATH (short timeouts). Listed
  whether or not the llama.cpp build can use them: a GPU the build cannot use is what the planner's advice
  is about. ``LOCALLLM_SYSFS_ROOT`` (or :func:`probe_drm`'s ``root``) points the scan at another tree.
* llama.cpp's own device list (``HardwareInfo.devices``): every device of the installed build through ggml's
  registry (:mod:`backends.ggml_devices`) — CPU, CUDA, ROCm, Vulkan, Metal, SYCL, RPC workers — with free/total
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
import shutil
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from backends import descriptor
from backends.descriptor import BackendStatus, parse_gpu_backend

__all__ = ["BACKEND_CHOICES", "GPU", "BackendStatus", "HardwareInfo", "LlamaDevice", "backend_names",
           "metal_budget_rule", "parse_gpu_backend", "parse_nvidia_smi", "parse_rocm_smi", "parse_vulkaninfo",
           "probe", "probe_drm", "probe_nvidia_smi", "probe_nvml", "schema_problem", "simd_from_flags"]

GiB = 1024**3
MiB = 1024**2

NVIDIA_SMI_TIMEOUT_S = 5.0
SYSCTL_TIMEOUT_S = 2.0
NVIDIA_SMI_FIELDS = "index,name,memory.total,memory.free,driver_version,compute_cap"
GPU_TOOL_TIMEOUT_S = 5.0  # rocm-smi, vulkaninfo: only asked to name a card sysfs found
SYSFS_ROOT_ENV = "LOCALLLM_SYSFS_ROOT"  # where /sys is (tests lay out a fake tree there)
# PCI vendor ids of display devices in /sys/class/drm
PCI_VENDORS: dict[str, Literal["amd", "intel", "nvidia"]] = {"0x1002": "amd", "0x8086": "intel", "0x10de": "nvidia"}
_VENDOR_LABELS = {"amd": "AMD", "intel": "Intel", "nvidia": "NVIDIA", "apple": "Apple"}

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
    """One GPU the machine has (whether or not the llama.cpp build can use it: :attr:`HardwareInfo.devices` says
    what it can). On Apple Silicon ``total_bytes``/``free_bytes`` are the Metal working-set budget; 0 for both
    means the size is unknown (an Intel GPU, a card only sysfs sees)."""

    index: int
    name: str
    vendor: Literal["nvidia", "apple", "amd", "intel"]
    total_bytes: int
    free_bytes: int
    driver: str | None = None  # NVIDIA: the driver version; from sysfs: the kernel driver ("amdgpu", "i915")
    compute_capability: str | None = None  # "8.9" (NVIDIA only)
    integrated: bool = False  # shares the CPU's memory (an Intel iGPU, an AMD APU), where that is known
    pci_id: str | None = None  # "1002:744c" (vendor:device), from sysfs
    gfx_target: str | None = None  # "gfx1100" (AMD, from rocm-smi): what a ROCm build compiles for


@dataclass(frozen=True)
class LlamaDevice:
    """One device of the installed llama.cpp build's own list (ggml's registry), as the faces see it.

    The same fields as :class:`backends.ggml_devices.Device`, with ``offloads``/``remote``/``endpoint`` as data so
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
    # a process limited to some cores (taskset, a container's cpuset) runs its threads there only
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical
    return int(min(physical or logical, usable)), int(min(logical, usable))


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


# --------------------------------------------------------------------------------- AMD, Intel (sysfs)


def _read_int(path: Path) -> int | None:
    text = _read_text(str(path))
    try:
        return int(text.strip(), 0) if text and text.strip() else None
    except ValueError:
        return None


def _uevent(dev: Path) -> dict[str, str]:
    text = _read_text(str(dev / "uevent")) or ""
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def parse_vulkaninfo(text: str) -> dict[tuple[str, str], tuple[str, bool]]:
    """``vulkaninfo --summary`` → {(vendor id, device id): (device name, integrated)}, ids as ``0x1002``.
    CPU devices (llvmpipe) are left out.

    >>> parse_vulkaninfo('''GPU0:
    ...     vendorID           = 0x1002
    ...     deviceID           = 0x744c
    ...     deviceType         = PHYSICAL_DEVICE_TYPE_DISCRETE_GPU
    ...     deviceName         = AMD Radeon RX 7900 XTX (RADV NAVI31)''')
    {('0x1002', '0x744c'): ('AMD Radeon RX 7900 XTX (RADV NAVI31)', False)}
    """
    out: dict[tuple[str, str], tuple[str, bool]] = {}
    for block in re.split(r"^GPU\d+:\s*$", text, flags=re.MULTILINE)[1:]:
        fields = dict(re.findall(r"^\s*(\w+)\s*=\s*(.*?)\s*$", block, re.MULTILINE))
        kind = fields.get("deviceType", "")
        if "vendorID" not in fields or "deviceID" not in fields or kind.endswith("_CPU"):
            continue
        key = (f"0x{int(fields['vendorID'], 0):04x}", f"0x{int(fields['deviceID'], 0):04x}")
        out.setdefault(key, (fields.get("deviceName", ""), kind.endswith("INTEGRATED_GPU")))
    return out


def parse_rocm_smi(text: str) -> list[dict[str, str]]:
    """``rocm-smi --showproductname`` → one dict per ``GPU[i]``, keys lower-cased (``card series``, ``card model``,
    ``gfx version``...), in rocm-smi's order.

    >>> parse_rocm_smi("GPU[0]\\t\\t: Card Series: \\t\\tNavi31 [Radeon RX 7900 XTX]\\n"
    ...                "GPU[0]\\t\\t: Card Model: \\t\\t0x744c\\nGPU[0]\\t\\t: GFX Version: \\t\\tgfx1100")
    [{'card series': 'Navi31 [Radeon RX 7900 XTX]', 'card model': '0x744c', 'gfx version': 'gfx1100'}]
    """
    cards: dict[int, dict[str, str]] = {}
    for m in re.finditer(r"^GPU\[(\d+)\]\s*:\s*([^:]+?)\s*:\s*(.*?)\s*$", text, re.MULTILINE):
        cards.setdefault(int(m.group(1)), {})[m.group(2).strip().lower()] = m.group(3).strip()
    return [cards[i] for i in sorted(cards)]


def _tool(name: str, args: list[str], notes: list[str]) -> str | None:
    exe = shutil.which(name)
    if exe is None:
        return None
    try:
        return _run([exe, *args], GPU_TOOL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        notes.append(f"{name} did not answer within {GPU_TOOL_TIMEOUT_S:g} s")
    except Exception as e:
        notes.append(f"{name} failed: {_short_error(e)}")
    return None


def _drm_dir(root: str | os.PathLike[str] | None = None) -> Path:
    return Path(root or os.environ.get(SYSFS_ROOT_ENV) or "/sys") / "class" / "drm"


def probe_drm(root: str | os.PathLike[str] | None = None, notes: list[str] | None = None) -> list[GPU]:
    """The GPUs in ``ROOT/class/drm/card*/device`` (``ROOT``: ``root``, else ``$LOCALLLM_SYSFS_ROOT``, else
    ``/sys``): AMD, Intel and NVIDIA display devices by PCI vendor id, VRAM where amdgpu reports it, a name from
    ``product_name``, ``rocm-smi`` or ``vulkaninfo`` (when on PATH), else the PCI id. Never raises; what cannot
    be read goes to ``notes``.

    Why sysfs: NVML sees only NVIDIA cards, and llama.cpp's own device list only what its build supports; an
    AMD card with a CPU-only build would otherwise be invisible, and so would the advice to install a ROCm or
    Vulkan build.
    """
    notes = notes if notes is not None else []
    base = _drm_dir(root)
    try:
        cards = sorted((c for c in base.iterdir() if re.fullmatch(r"card\d+", c.name)),
                       key=lambda c: int(c.name[4:]))
    except OSError:
        return []
    found: list[tuple[GPU, str]] = []  # (gpu, product name from sysfs)
    seen: set[str] = set()
    for card in cards:
        dev = card / "device"
        vendor_id = (_read_text(str(dev / "vendor")) or "").strip().lower()
        vendor = PCI_VENDORS.get(vendor_id)
        if vendor is None:
            continue
        uevent = _uevent(dev)
        slot = uevent.get("PCI_SLOT_NAME") or os.path.basename(os.path.realpath(dev))
        if slot in seen:  # one PCI device, several cards (a render node, a second connector)
            continue
        seen.add(slot)
        device_id = (_read_text(str(dev / "device")) or "").strip().lower()
        pci_id = f"{vendor_id[2:]}:{device_id[2:]}" if device_id.startswith("0x") else None
        total = _read_int(dev / "mem_info_vram_total") or 0
        used = _read_int(dev / "mem_info_vram_used")
        free = max(total - used, 0) if total and used is not None else total
        product = (_read_text(str(dev / "product_name")) or "").strip()
        label = _VENDOR_LABELS[vendor]
        found.append((GPU(index=len(found), name=product or f"{label} GPU [{pci_id or device_id or '?'}]",
                          vendor=vendor, total_bytes=total, free_bytes=free, driver=uevent.get("DRIVER"),
                          integrated=vendor == "intel" and slot.endswith("00:02.0"), pci_id=pci_id), product))
    if not found:
        return []
    _name_with_tools([g for g, _ in found], {id(g) for g, product in found if product}, notes)
    return [g for g, _ in found]


def _name_with_tools(gpus: list[GPU], named: set[int], notes: list[str]) -> None:
    """Names (and the gfx target, integrated or not) from rocm-smi and vulkaninfo for the cards sysfs found;
    ``named``: the cards sysfs already named (``product_name``), whose name stays."""
    amd = [g for g in gpus if g.vendor == "amd"]
    if amd:
        text = _tool("rocm-smi", ["--showproductname"], notes)
        cards = parse_rocm_smi(text) if text else []
        for i, g in enumerate(amd):
            model = g.pci_id.split(":")[1] if g.pci_id else None
            by_id = [c for c in cards if model and c.get("card model", "").lower().removeprefix("0x") == model]
            card = by_id[0] if len(by_id) == 1 else cards[i] if len(cards) == len(amd) else None
            if card is None:
                continue
            g.gfx_target = card.get("gfx version") or None
            series = card.get("card series") or card.get("card sku") or ""
            if series and id(g) not in named:
                g.name = series if series.upper().startswith("AMD") else f"AMD {series}"
                named.add(id(g))
    if all(id(g) in named for g in gpus) and not amd:  # an AMD APU is told apart only by vulkaninfo
        return
    text = _tool("vulkaninfo", ["--summary"], notes)
    vk = parse_vulkaninfo(text) if text else {}
    for g in gpus:
        vendor, _, device = (g.pci_id or "").partition(":")
        name, integrated = vk.get((f"0x{vendor}", f"0x{device}"), ("", False))
        g.integrated = g.integrated or integrated
        if name and id(g) not in named:
            g.name = name


def _other_gpus(gpus: list[GPU], notes: list[str]) -> list[GPU]:
    """The sysfs GPUs besides the NVIDIA ones NVML/nvidia-smi listed (``gpus``), numbered after them."""
    drm = probe_drm(notes=notes)
    if any(g.vendor == "nvidia" for g in gpus):
        drm = [g for g in drm if g.vendor != "nvidia"]
    elif any(g.vendor == "nvidia" for g in drm):
        notes.append("an NVIDIA GPU is in /sys/class/drm, but NVML and nvidia-smi cannot read it "
                     "(is the NVIDIA driver loaded?)")
    if not drm and not gpus:
        base = _drm_dir()
        notes.append(f"no AMD or Intel GPU in {base}" if base.is_dir()
                     else f"no {base} (no GPU driver loaded, or a container without it)")
    for i, g in enumerate(drm):
        g.index = len(gpus) + i
    return drm


# ------------------------------------------------------------------------------ llama.cpp's devices


def _llama_devices(notes: list[str]) -> tuple[list[LlamaDevice], bool]:
    """llama.cpp's own device list and whether the build has RPC; ([], False) and a note when unreadable."""
    try:
        from backends import ggml_devices

        found = ggml_devices.list_devices()
        rpc = ggml_devices.rpc_supported()
    except Exception as e:  # no llama_cpp, a library without the registry symbols, ...
        notes.append(f"llama.cpp's device list not read: {_short_error(e)}")
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
    if os_name == "Linux":
        gpus += _guarded(lambda: _other_gpus(gpus, notes), [], notes, "sysfs GPU")

    backends = {b.name: _backend_status(b, notes) for b in descriptor.registered()}
    devices: list[LlamaDevice] = []
    rpc = False
    if backends.get("llamacpp") is not None and backends["llamacpp"].available:  # else its line says why
        devices, rpc = _guarded(lambda: _llama_devices(notes), ([], False), notes, "llama.cpp device")
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
                                      notes=[f"hardware probe failed: {_short_error(e)}"])
        return _cache
