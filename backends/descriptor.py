"""Each backend described once: what it is called, whether it can run here and why not, which weights it
loads and how they are prepared, its KV cache types, its structured-output rules, how the planner counts
its memory, how to install it and where it stands in the planner's choice.

The probe (:mod:`localllm.hardware`), the planner, the engine, the server's schema check and the CLI's
``--backend`` choices read these; nobody outside ``backends/`` spells a backend's name. Importing this
module imports no backend library (each check imports what it needs when called)::

    >>> [b.name for b in ranked(apple_silicon=False)], [b.name for b in ranked(apple_silicon=True)]
    (['llamacpp', 'mlx'], ['mlx', 'llamacpp'])
    >>> get("mlx").weights, get("llamacpp").weights, get("llamacpp").label
    ('mlx', 'gguf', 'llama.cpp')

A third backend is its package (``backends/<name>/``, its :class:`~backends.contract.source.TokenSource` in
``source.py``) plus one :func:`register` line (the two built-in ones are registered at the bottom of this module; a
test registers its own the same way).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

KVCacheType = Literal["f16", "q8_0", "q4_0"]
KV_CACHE_TYPES: tuple[str, ...] = get_args(KVCacheType)  # the one list
GGUF = "gguf"  # weights: one GGUF file (what the store pulls)
MLX = "mlx"  # weights: an MLX directory (safetensors, config.json, tokenizer), downloaded or converted from the GGUF

LLAMA_CPP_VERSION = "0.3.36"  # the llama-cpp-python the install hints name


@dataclass
class BackendStatus:
    """Can this backend run here, and can it use the GPU? (What ``localllm probe`` lists per backend.)"""

    name: str  # the backend's name (its descriptor's)
    available: bool
    reason: str  # one line: why (not) available, e.g. "llama-cpp-python 0.3.36, CPU-only build"
    gpu_offload: bool  # the build can put work on a GPU (CUDA/Metal/... for llama.cpp; Metal/CUDA for MLX)
    detail: str = ""  # llama.cpp's system info / MLX's device
    gpu_backend: str | None = None  # "CUDA", "Metal", "Vulkan"... (compiled in); None = CPU only
    version: str | None = None
    label: str = ""  # how a person reads the name ("llama.cpp")


@dataclass(frozen=True)
class Backend:
    """One backend, as everything above ``backends/`` sees it."""

    name: str  # what --backend, LoadOptions.backend and Plan.backend say
    label: str  # how a person reads it
    source: str  # "module:Class" of its TokenSource (imported when first used)
    weights: str  # what it loads: GGUF or MLX
    memory: Literal["layers", "unified"]  # how the planner counts it: layers offloaded to a GPU, or one unified pool
    install: str  # how to install it (one command)
    priority: int  # the planner's order for backend "auto": lower is tried first
    apple_priority: int | None = None  # the order on Apple Silicon (None: ``priority``)
    install_note: str = ""  # why to install it, where the planner advises it
    kv_cache_types: tuple[str, ...] = KV_CACHE_TYPES
    # why a quantized KV type cannot be used for a model: (kv type, head size, sliding window) -> sentence | None
    kv_problem: Callable[[str, int, int | None], str | None] | None = field(default=None, compare=False)
    schema_rules: str = ""  # "module:function": a JSON schema -> the first thing it cannot follow, or None
    probe: Callable[[], BackendStatus] | None = field(default=None, compare=False)  # None: the source's check
    vision: bool = False  # runs a vision projector (LoadSpec.mmproj): models with one prefer it
    mtp: bool = False  # drafts from a GGUF's own multi-token-prediction layers (DraftSpec kind "mtp")
    devices: str = ""  # "module:function" -> (its device list, RPC built in): devices a plan may split layers over

    def rank(self, apple_silicon: bool) -> int:
        return self.apple_priority if apple_silicon and self.apple_priority is not None else self.priority

    def source_class(self) -> Any:
        """Its :class:`~backends.contract.source.TokenSource` class (imports the backend's module)."""
        return _named(self.source)

    def status(self) -> BackendStatus:
        """Whether it can run here, and how (version, GPU): the one check. Never raises."""
        try:
            if self.probe is not None:
                return replace(self.probe(), name=self.name, label=self.label)
            cls = self.source_class()  # importable; and the class's own check, where it has one
            owner = next(k for k in cls.__mro__ if "available" in vars(k))
            ok, why = (True, "") if owner.__module__ == "backends.contract.source" else cls.available()
        except Exception as e:  # noqa: BLE001 - a module that fails to import, a probe with a bug
            return BackendStatus(self.name, False, _short_error(e), False, label=self.label)
        return BackendStatus(self.name, ok, why or f"{self.source.split(':')[0]} importable", False, label=self.label)

    def available(self) -> tuple[bool, str]:
        """(usable here, why not and how to install it); never raises."""
        s = self.status()
        return (True, "") if s.available else (False, f"{s.reason}; install it with: {self.install}")

    def device_list(self) -> tuple[list[Any], bool]:
        """(the devices its build can put layers on, whether it has RPC); ([], False) for a backend with none.
        Imports the backend's module; raises what the library raises (the probe guards it)."""
        if not self.devices:
            return [], False
        return _named(self.devices)()  # type: ignore[no-any-return]

    def schema_problem(self, schema: Any) -> str | None:
        """The first thing in a JSON schema this backend's structured output cannot follow (one sentence),
        or None; a backend that states no rules follows any schema."""
        if not self.schema_rules:
            return None
        return _named(self.schema_rules)(schema)  # type: ignore[no-any-return]


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Add (or replace) a backend; it shows up in the probe, the planner and every ``--backend`` choice."""
    _REGISTRY[backend.name] = backend
    return backend


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def names() -> list[str]:
    """Every registered backend's name, in registration order."""
    return list(_REGISTRY)


def registered() -> list[Backend]:
    """Every registered backend, in registration order."""
    return list(_REGISTRY.values())


def get(name: str) -> Backend:
    """The descriptor of ``name``; ``ValueError`` naming the choices for an unknown one."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r} (choose {' or '.join(sorted(_REGISTRY))})") from None


def ranked(apple_silicon: bool) -> list[Backend]:
    """The backends in the planner's order for ``backend="auto"`` on this kind of machine."""
    return sorted(_REGISTRY.values(), key=lambda b: b.rank(apple_silicon))


def drafting_mtp() -> list[Backend]:
    """The backends that draft from a GGUF's multi-token-prediction layers."""
    return [b for b in _REGISTRY.values() if b.mtp]


def taking(weights: str) -> list[Backend]:
    """The backends that load ``weights`` (GGUF or MLX)."""
    return [b for b in _REGISTRY.values() if b.weights == weights]


def _named(ref: str) -> Any:
    """What a ``"module:name"`` reference of a descriptor names (its module imported now)."""
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def _short_error(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return text or type(e).__name__


# --------------------------------------------------------------------------------------------- llama.cpp

# what llama_print_system_info() names a compiled-in GPU backend → the name we show
_GPU_BACKENDS = {"CUDA": "CUDA", "METAL": "Metal", "MTL": "Metal", "VULKAN": "Vulkan", "HIP": "HIP",
                 "ROCM": "HIP", "SYCL": "SYCL", "CANN": "CANN", "MUSA": "MUSA", "OPENCL": "OpenCL"}


def parse_gpu_backend(system_info: str) -> str | None:
    """The GPU backend named in ``llama_print_system_info()``, or None for a CPU-only build.

    >>> parse_gpu_backend("CPU : SSE3 = 1 | AVX2 = 1 | LLAMAFILE = 1 |")
    >>> parse_gpu_backend("CUDA : ARCHS = 890 | USE_GRAPHS = 1 | CPU : AVX2 = 1 |")
    'CUDA'
    """
    for m in re.finditer(r"(?:^|\|)\s*([A-Za-z][A-Za-z0-9_]*)\s*:", system_info):
        name = _GPU_BACKENDS.get(m.group(1).upper())
        if name:
            return name
    return None


# ggml's AMX kernels in the pinned llama.cpp (built in by a native build on a CPU that lists AMX) run tile
# instructions on a tile configuration the compiler dropped and on threads without the kernel's XTILEDATA permission:
# the process dies with SIGILL at the first matrix product (ggml-org/llama.cpp#26954). A load then leaves llama.cpp's
# extra buffer types (AMX, and with them the CPU weight repacking) off.
AMX_NOTE = ("its AMX kernels crash in this llama.cpp (ggml-org/llama.cpp#26954), so models load without them and "
            "without weight repacking; for repacked weights reinstall it without AMX: CMAKE_ARGS='-DCMAKE_C_FLAGS="
            "-mno-amx-tile\\ -mno-amx-int8\\ -mno-amx-bf16 "
            "-DCMAKE_CXX_FLAGS=-mno-amx-tile\\ -mno-amx-int8\\ -mno-amx-bf16' "
            f"pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python=={LLAMA_CPP_VERSION}")


def has_amx_kernels(system_info: str) -> bool:
    """The build named in ``llama_print_system_info()`` has ggml's AMX kernels (see :data:`AMX_NOTE`).

    >>> has_amx_kernels("CPU : AVX512 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 |"), has_amx_kernels("CPU : AVX2 = 1 |")
    (True, False)
    """
    return re.search(r"\bAMX_INT8\s*=\s*1\b", system_info) is not None


def llamacpp_status() -> BackendStatus:
    """llama-cpp-python importable, ``llama_supports_gpu_offload()`` and the GPU backend compiled in."""
    try:
        import llama_cpp
    except Exception as e:  # ImportError, or OSError when the shared library cannot load
        return BackendStatus("llamacpp", False, f"llama-cpp-python is not importable: {_short_error(e)}", False)
    version = getattr(llama_cpp, "__version__", None)
    try:
        offload = bool(llama_cpp.llama_supports_gpu_offload())
    except Exception as e:
        return BackendStatus("llamacpp", True, f"llama-cpp-python {version}; GPU offload unknown: "
                             f"{_short_error(e)}", False, version=version)
    try:
        info = llama_cpp.llama_print_system_info()
        info = info.decode(errors="replace") if isinstance(info, bytes) else str(info)
    except Exception:
        info = ""
    try:
        rpc = bool(llama_cpp.llama_supports_rpc())
    except Exception:
        rpc = False
    gpu = parse_gpu_backend(info) if offload else None
    if offload and gpu is None and rpc:
        offload = False  # llama_supports_gpu_offload() is true for RPC alone: no local GPU backend is built in
    with_rpc = " with RPC (--rpc adds workers)" if rpc else ""
    if offload:
        reason = f"llama-cpp-python {version}, GPU offload via {gpu or 'a GPU backend'}{with_rpc}"
    else:
        reason = f"llama-cpp-python {version}, CPU-only build{with_rpc}"
    if has_amx_kernels(info):
        reason += f"; {AMX_NOTE}"
    return BackendStatus("llamacpp", True, reason, offload, info.strip(), gpu_backend=gpu if offload else None,
                         version=version)


# ------------------------------------------------------------------------------------------------- MLX


def mlx_status() -> BackendStatus:
    """``mlx.core`` and ``mlx_lm`` importable, and MLX's default device."""
    try:
        import mlx.core as mx
    except Exception as e:
        return BackendStatus("mlx", False, f"mlx is not importable: {_short_error(e)}", False)
    version = getattr(mx, "__version__", None)
    try:
        device = str(mx.default_device())
        metal = bool(mx.metal.is_available())
        cuda = bool(getattr(mx, "cuda", None) and mx.cuda.is_available())
    except Exception as e:
        return BackendStatus("mlx", False, f"mlx is installed but not usable: {_short_error(e)}", False,
                             version=version)
    gpu = "Metal" if metal else "CUDA" if cuda else None
    if importlib.util.find_spec("mlx_lm") is None:
        return BackendStatus("mlx", False, f"mlx {version} is importable but mlx-lm is not installed", bool(gpu),
                             device, gpu_backend=gpu, version=version)
    where = f"on {gpu}" if gpu else "on the CPU only"
    return BackendStatus("mlx", True, f"mlx {version} with mlx-lm, {where}", bool(gpu), device,
                         gpu_backend=gpu, version=version)


def mlx_kv_problem(kv: str, head_dim: int, sliding_window: int | None) -> str | None:
    """MLX quantizes a KV cache in groups of 64 along the head, and cannot quantize a rotating one."""
    if kv == "f16":
        return None
    if head_dim % 64:
        return f"head size {head_dim} is not a multiple of MLX's group size 64"
    if sliding_window:
        return "the model's sliding-window (rotating) cache cannot be quantized"
    return None


# ----------------------------------------------------------------------------------------- the built-ins

LLAMACPP = register(Backend(
    name="llamacpp", label="llama.cpp", source="backends.llamacpp.source:LlamaCppSource", weights=GGUF, memory="layers",
    install=f"pip install llama-cpp-python=={LLAMA_CPP_VERSION}", priority=20,
    schema_rules="backends.llamacpp._schema:schema_problem", probe=llamacpp_status, vision=True, mtp=True,
    devices="backends.llamacpp.devices:listing"))
MLX_BACKEND = register(Backend(
    name="mlx", label="MLX", source="backends.mlx.source:MLXSource", weights=MLX, memory="unified",
    install="pip install 'localllm[mlx]'", install_note="MLX is usually the fastest backend on Apple Silicon",
    priority=30, apple_priority=10, kv_problem=mlx_kv_problem,
    schema_rules="backends.mlx._json:schema_problem", probe=mlx_status))
