"""Step 3 of a plan: which device a backend runs on here, why, and how to get a better setup (the install
command of a GPU build of llama.cpp for the GPU this machine has)."""

from __future__ import annotations

from backends.descriptor import GGUF, LLAMA_CPP_VERSION, Backend, BackendStatus
from localllm.formats import PlanWeights
from localllm.gpus import GPU
from localllm.hardware import HardwareInfo
from localllm.planner.estimation import _gb

CUDA_ADVICE = (f'CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir '
               f'llama-cpp-python=={LLAMA_CPP_VERSION}')
METAL_ADVICE = (f'CMAKE_ARGS="-DGGML_METAL=on" pip install --force-reinstall --no-cache-dir '
                f'llama-cpp-python=={LLAMA_CPP_VERSION}')
ROCM_ADVICE = (f'CMAKE_ARGS="-DGGML_HIP=on" pip install --force-reinstall --no-cache-dir '
               f'llama-cpp-python=={LLAMA_CPP_VERSION}')
VULKAN_ADVICE = (f'CMAKE_ARGS="-DGGML_VULKAN=on" pip install --force-reinstall --no-cache-dir '
                 f'llama-cpp-python=={LLAMA_CPP_VERSION}')
SYCL_ADVICE = (f'CMAKE_ARGS="-DGGML_SYCL=on -DCMAKE_C_COMPILER=icx -DCMAKE_CXX_COMPILER=icpx" pip install '
               f'--force-reinstall --no-cache-dir llama-cpp-python=={LLAMA_CPP_VERSION}')
# the llama.cpp GPU backends (BackendStatus.gpu_backend) that can drive each vendor's GPUs besides NVIDIA's
_GPU_BACKENDS_FOR = {"amd": ("HIP", "Vulkan"), "intel": ("Vulkan", "SYCL")}

def answer(weights: dict[str, PlanWeights], b: Backend) -> PlanWeights:
    """What ``b``'s own weights format has for the model, from the planner's per-format answers
    (:attr:`~localllm.planner.PlanRequest.weights`); a format not in them has nothing installed and nothing that
    converts."""
    return weights.get(b.weights) or PlanWeights()


def _device(b: Backend, hw: HardwareInfo, reasons: list[str], advice: list[str], name: str,
            weights: dict[str, PlanWeights], passed: list[Backend], status: dict[str, BackendStatus], *,
            asked: bool) -> str:
    """The device ``b`` runs on here; appends the reason lines: why it (and not the backends ``passed``, tried
    before it, each judged by its own format's answer in ``weights``) and, where a better setup exists, the
    advice."""
    mw = answer(weights, b)
    converts = (f"its GGUF converts to {b.label} (once, offline, before the first load: {mw.source})" if mw.source
                else f"its GGUF converts to {b.label} (once, offline, before the first load)")
    prepared = "" if b.weights == GGUF or mw.installed else f"; {converts}"
    if b.memory == "unified":
        gb = status[b.name].gpu_backend
        device = "metal" if gb == "Metal" else "cuda" if gb == "CUDA" else "cpu"
        if asked:
            reasons.append(f"backend {b.label} ({device}): asked for with --backend {b.name}{prepared}")
        elif passed:
            first = passed[0]
            reasons.append(f"backend {b.label} ({device}): {first.label} is not importable "
                           f"({status[first.name].reason}){prepared}")
        else:
            where = device.capitalize() if device == "metal" else device.upper()
            reasons.append(f"backend {b.label} on {where}: Apple Silicon, {b.name} importable and "
                           + (f"{b.label} weights of {name} installed ({mw.source or 'found'})" if mw.installed
                              else converts))
        return device
    for p in passed:  # the ones the priority list tried first
        st = status[p.name]
        pw = answer(weights, p)
        ready = p.weights == GGUF or pw.usable
        if ready and not st.available:
            reasons.append(f"{p.label} not used: {st.reason}")
            advice.append(f"{p.install}  ({p.install_note})" if p.install_note else p.install)
        elif st.available and not ready:
            reasons.append(f"{p.label} not used: no {p.label} weights of {name} are installed and "
                           f"{pw.why_not[0].lower() + pw.why_not[1:]}" if pw.why_not else
                           f"{p.label} not used: no {p.label} build of {name} is installed")
    before = len(reasons)
    device = _layers_device(b, hw, reasons, advice)
    if asked and len(reasons) > before:
        reasons[-1] += f" (asked for with --backend {b.name})"
    return device


def _registry_device(b: Backend, hw: HardwareInfo, device: str, reasons: list[str]) -> str:
    """llama.cpp's own device list can offer devices NVML and Metal do not see: RPC workers, ROCm, Vulkan, SYCL
    GPUs. Where the other checks found none, those are where the layers go ("gpu")."""
    if b.memory != "layers" or device != "cpu" or not hw.backend(b.name).available:
        return device
    devs = [d for d in hw.offload_devices if d.backend not in ("CUDA", "Metal")]
    if not devs:
        return device
    names = ", ".join(f"{d.name} ({d.description})" if d.remote else f"{d.name} ({d.description}, {d.backend})"
                      for d in devs)
    line = f"backend {b.label} on {names}: llama.cpp's device list"
    if reasons and reasons[-1].startswith(f"backend {b.label} on the CPU"):
        reasons[-1] = line
    else:
        reasons.append(line)
    return "gpu"


def _gpu_label(g: GPU) -> str:
    size = _gb(g.total_bytes) if g.total_bytes else ""
    kind = "integrated" if g.integrated else ""
    extra = ", ".join(x for x in (size, kind) if x)
    return f"{g.name} ({extra})" if extra else g.name


def _idle_gpus(hw: HardwareInfo, gpu_backend: str | None) -> list[GPU]:
    """The AMD and Intel GPUs a build offloading via ``gpu_backend`` (None: CPU-only) cannot drive. An integrated
    GPU counts only where no discrete GPU (of any vendor) is there: offloading to it beside one gains little."""
    others = [g for g in hw.gpus if g.vendor in _GPU_BACKENDS_FOR and gpu_backend not in _GPU_BACKENDS_FOR[g.vendor]]
    if any(not g.integrated for g in hw.gpus if g.vendor != "apple"):
        others = [g for g in others if not g.integrated]
    return others


def _your(g: GPU, vendor: str) -> str:
    return g.name if g.name.startswith(vendor) else f"{vendor} GPU ({g.name})"


def _amd_intel_advice(gpus: list[GPU], why: str) -> list[str]:
    """The install commands for AMD (ROCm, else Vulkan) and Intel (Vulkan, else SYCL) GPUs; ``why``: the words
    after "is idle because" (e.g. "llama.cpp was built for the CPU only")."""
    out: list[str] = []
    amd = [g for g in gpus if g.vendor == "amd"]
    if amd:
        target = next((g.gfx_target for g in amd if g.gfx_target), None)
        out.append(f"Your {_your(amd[0], 'AMD')} is idle because {why}. Install a ROCm (HIP) build (needs ROCm "
                   f"with hipcc; takes a while): {ROCM_ADVICE}  (add -DGPU_TARGETS={target or 'gfxNNNN'} to "
                   f"CMAKE_ARGS to build for this GPU only{'' if target else ', as rocminfo names it'})")
        out.append(f"Or a Vulkan build (AMD and Intel GPUs; needs glslc and Vulkan headers newer than Debian 12's "
                   f"1.3.239): {VULKAN_ADVICE}")
    intel = [g for g in gpus if g.vendor == "intel"]
    if intel:
        out.append(f"Your {_your(intel[0], 'Intel')} is idle because {why}. Install a Vulkan build (needs glslc and "
                   f"Vulkan headers newer than Debian 12's 1.3.239): {VULKAN_ADVICE}")
        out.append(f"Or a SYCL build (Intel oneAPI; `source /opt/intel/oneapi/setvars.sh` first): {SYCL_ADVICE}")
    return out


def _layers_device(b: Backend, hw: HardwareInfo, reasons: list[str], advice: list[str]) -> str:
    """Which device a backend that offloads layers (llama.cpp) can use here; appends the reason (and advice)."""
    llama = hw.backend(b.name)
    nvidia = hw.nvidia_gpus
    gpu_names = ", ".join(f"{g.name} ({_gb(g.total_bytes)})" for g in nvidia)
    cc = next((g.compute_capability for g in nvidia if g.compute_capability), None)
    cuda_advice = (f"Your NVIDIA GPU is idle because llama.cpp was built for the CPU only. Install a CUDA build "
                   f"(needs the CUDA toolkit, nvcc on PATH; takes a while): {CUDA_ADVICE}"
                   + (f'  (add -DCMAKE_CUDA_ARCHITECTURES={cc.replace(".", "")} to CMAKE_ARGS to build for this '
                      f"GPU only, much faster)" if cc else ""))
    if not llama.available:
        reasons.append(f"{b.label}: {llama.reason}")
        idle = _idle_gpus(hw, None)
        if nvidia:
            advice.append(cuda_advice.replace("is idle because llama.cpp was built for the CPU only",
                                              "needs a CUDA build of llama.cpp"))
            advice.extend(_amd_intel_advice(idle, "llama.cpp is not installed"))
            return "cpu"
        if hw.apple_silicon:
            advice.append(f"{b.install}  (Metal is on by default on macOS)")
            return "metal"
        advice.extend(_amd_intel_advice(idle, "llama.cpp is not installed") or [b.install])
        return "cpu"
    if llama.gpu_offload:  # an RPC-only build counts as CPU-only here (backends.descriptor.llamacpp_status)
        gb = llama.gpu_backend
        if nvidia and gb in ("CUDA", "Vulkan", None):
            via = f" via {gb}" if gb and gb != "CUDA" else ""
            reasons.append(f"backend {b.label} on CUDA{via}: {gpu_names} and a GPU-capable llama.cpp build")
            return "cuda"
        if hw.apple_silicon and gb in ("Metal", None):
            reasons.append(f"backend {b.label} on Metal: Apple Silicon and a Metal build of llama.cpp")
            return "metal"
        idle = _idle_gpus(hw, gb)
        drivable = [g for g in hw.gpus if g.vendor in _GPU_BACKENDS_FOR and g not in idle]
        found = ", ".join(_gpu_label(g) for g in hw.gpus) or ("Apple Silicon GPU" if hw.apple_silicon else "none")
        if drivable:
            reasons.append(f"backend {b.label} on the CPU: the build offloads via {gb} to "
                           f"{', '.join(_gpu_label(g) for g in drivable)}, but llama.cpp's device list shows no "
                           f"{gb} device")  # where it does, _registry_device puts the layers there
        else:
            reasons.append(f"backend {b.label} on the CPU: the build offloads via {gb or 'a GPU backend'}, "
                           f"but no such GPU was found (GPUs: {found})")
            advice.extend(_amd_intel_advice(idle, f"this llama.cpp build offloads via {gb or 'another backend'} "
                                                  f"only"))
        return "cpu"
    idle = _idle_gpus(hw, None)
    if nvidia or idle:
        names = ", ".join([f"{g.name} ({_gb(g.total_bytes)})" for g in nvidia] + [_gpu_label(g) for g in idle])
        reasons.append(f"backend {b.label} on the CPU: {names} found, but this llama.cpp build is CPU-only")
        if nvidia:
            advice.append(cuda_advice)
        advice.extend(_amd_intel_advice(idle, "llama.cpp was built for the CPU only"))
    elif hw.apple_silicon:
        reasons.append(f"backend {b.label} on the CPU: this llama.cpp build has no Metal support")
        advice.append(f"Install a Metal build of llama.cpp: {METAL_ADVICE}")
    else:
        why = "; ".join(n for n in hw.notes if "NVML" in n or "nvidia-smi" in n or "drm" in n) or "none detected"
        reasons.append(f"backend {b.label} on the CPU: no usable GPU ({why})")
    return "cpu"

