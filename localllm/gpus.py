"""The machine's GPUs, whether or not the llama.cpp build can use them (:mod:`localllm.hardware` puts them in
its probe): NVIDIA through NVML (nvidia-ml-py), else ``nvidia-smi``; AMD and Intel (and an NVIDIA card NVML does
not see) on Linux from ``/sys/class/drm/card*/device``, named by ``rocm-smi`` / ``vulkaninfo`` when they are on
PATH. Every tool runs with a short timeout; a probe raises, and :func:`localllm.hardware.probe` turns that into a
note.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

MiB = 1024**2

NVIDIA_SMI_TIMEOUT_S = 5.0
NVIDIA_SMI_FIELDS = "index,name,memory.total,memory.free,driver_version,compute_cap"
GPU_TOOL_TIMEOUT_S = 5.0  # rocm-smi, vulkaninfo: only asked to name a card sysfs found
SYSFS_ROOT_ENV = "LOCALLLM_SYSFS_ROOT"  # where /sys is (tests lay out a fake tree there)
# PCI vendor ids of display devices in /sys/class/drm
PCI_VENDORS: dict[str, Literal["amd", "intel", "nvidia"]] = {"0x1002": "amd", "0x8086": "intel", "0x10de": "nvidia"}
_VENDOR_LABELS = {"amd": "AMD", "intel": "Intel", "nvidia": "NVIDIA", "apple": "Apple"}


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


# --------------------------------------------------------------------------------------- helpers


def run_tool(cmd: list[str], timeout: float) -> str:
    """Run ``cmd``, return stdout; raise on a missing binary, timeout or non-zero exit."""
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True,
                         stdin=subprocess.DEVNULL)
    return out.stdout


def read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return None


def short_error(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return text or type(e).__name__


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
        out = run_tool([exe, f"--query-gpu={NVIDIA_SMI_FIELDS}", fmt], NVIDIA_SMI_TIMEOUT_S)
    except subprocess.CalledProcessError:  # drivers older than 510 do not know compute_cap
        out = run_tool([exe, f"--query-gpu={NVIDIA_SMI_FIELDS.rsplit(',', 1)[0]}", fmt], NVIDIA_SMI_TIMEOUT_S)
    return parse_nvidia_smi(out)


def nvidia_gpus(notes: list[str]) -> list[GPU]:
    try:
        gpus = probe_nvml()
        if gpus:
            return gpus
        notes.append("NVML found no NVIDIA GPU")
        return []
    except ImportError as e:
        notes.append(f"NVML not available: nvidia-ml-py is not installed ({short_error(e)})")
    except Exception as e:
        notes.append(f"NVML not available: {short_error(e)}")
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
        notes.append(f"nvidia-smi failed: {short_error(e)}")
    return []


# --------------------------------------------------------------------------------- AMD, Intel (sysfs)


def _read_int(path: Path) -> int | None:
    text = read_text(str(path))
    try:
        return int(text.strip(), 0) if text and text.strip() else None
    except ValueError:
        return None


def _uevent(dev: Path) -> dict[str, str]:
    text = read_text(str(dev / "uevent")) or ""
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
        return run_tool([exe, *args], GPU_TOOL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        notes.append(f"{name} did not answer within {GPU_TOOL_TIMEOUT_S:g} s")
    except Exception as e:
        notes.append(f"{name} failed: {short_error(e)}")
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
        vendor_id = (read_text(str(dev / "vendor")) or "").strip().lower()
        vendor = PCI_VENDORS.get(vendor_id)
        if vendor is None:
            continue
        uevent = _uevent(dev)
        slot = uevent.get("PCI_SLOT_NAME") or os.path.basename(os.path.realpath(dev))
        if slot in seen:  # one PCI device, several cards (a render node, a second connector)
            continue
        seen.add(slot)
        device_id = (read_text(str(dev / "device")) or "").strip().lower()
        pci_id = f"{vendor_id[2:]}:{device_id[2:]}" if device_id.startswith("0x") else None
        total = _read_int(dev / "mem_info_vram_total") or 0
        used = _read_int(dev / "mem_info_vram_used")
        free = max(total - used, 0) if total and used is not None else total
        product = (read_text(str(dev / "product_name")) or "").strip()
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


def other_gpus(gpus: list[GPU], notes: list[str]) -> list[GPU]:
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
