"""llama.cpp's own device list, and its RPC backend, through ggml's registry (ctypes over the wheel's libraries).

llama-cpp-python does not wrap ggml's device registry, but ``libggml.so`` / ``libggml-base.so`` beside
``libllama.so`` export it. One call lists every device of the installed build — CPU, CUDA, ROCm/HIP, Vulkan,
Metal, SYCL, and ``RPC<n>`` devices for each worker added — with free/total memory, where NVML sees only
NVIDIA (``../shared/reference/devices.md`` has what was measured). On a machine without a GPU::

    [d.name for d in list_devices()]  # ['CPU']
    rpc_supported()                   # False: a build without -DGGML_RPC=on

RPC (a build with ``-DGGML_RPC=on``): :func:`start_worker` serves this machine's devices (what
``localllm worker`` runs); :func:`add_worker` makes a worker's devices part of this process's device list, after
:func:`hello` checked that it answers (ggml aborts the process when a worker it adds does not: we ask first,
with a timeout). The protocol has no authentication: loopback or a trusted network only.

A worker that dies while a model uses it makes ggml abort the process (``RPC_STATUS_ASSERT`` in ggml-rpc's
dispatcher thread, which cannot be caught). :func:`watch` installs ggml's abort callback: when it fires, the
callback asks every added worker whether it still answers; if one does not, the models that use it are told
(their requests fail with one sentence, their decode loop is abandoned) and the dispatcher thread that was
about to call ``abort()`` is parked for good instead, so the process lives on. A dead worker's devices are left
out of :func:`list_devices` from then on (ggml cannot remove them).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger("backends.llamacpp.devices")

DeviceType = Literal["cpu", "gpu", "igpu", "accel"]
_TYPES: dict[int, DeviceType] = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}

RPC_DEFAULT_PORT = 50052
RPC_PROTO_MAJOR = 7  # ggml-rpc.h's RPC_PROTO_MAJOR_VERSION in the pinned llama.cpp
_RPC_CMD_HELLO = 14
_RPC_CONN_CAPS = 24  # transport.h: RPC_CONN_CAPS_SIZE


@dataclass(frozen=True)
class Device:
    """One device of llama.cpp's registry, as ggml reports it."""

    index: int  # position in ggml's device list (what llama.cpp's split uses)
    name: str  # "CPU", "CUDA0", "Vulkan0", "RPC0"...
    description: str  # "NVIDIA GeForce RTX 4090", "AMD EPYC...", or a worker's "host:port"
    type: DeviceType
    free_bytes: int
    total_bytes: int
    backend: str  # the registry that provides it: "CPU", "CUDA", "RPC"...

    @property
    def offloads(self) -> bool:
        """Layers can go here (every non-CPU device; ggml's CPU device is where the rest stays)."""
        return self.type != "cpu"

    @property
    def remote(self) -> bool:
        return self.backend == "RPC"


class _Lib:
    """ggml's registry functions, bound once (after ``import llama_cpp`` loaded the libraries)."""

    def __init__(self) -> None:
        import llama_cpp  # loads libllama and, through it, libggml*

        libdir = Path(llama_cpp.__file__).parent / "lib"
        self.llama = llama_cpp
        self.ggml = self._open(libdir, "ggml")
        self.base = self._open(libdir, "ggml-base")
        g, b = self.ggml, self.base
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        g.ggml_backend_dev_count.restype = sz
        g.ggml_backend_dev_get.argtypes, g.ggml_backend_dev_get.restype = [sz], vp
        g.ggml_backend_reg_by_name.argtypes, g.ggml_backend_reg_by_name.restype = [ctypes.c_char_p], vp
        g.ggml_backend_register.argtypes, g.ggml_backend_register.restype = [vp], None
        g.ggml_backend_dev_by_name.argtypes, g.ggml_backend_dev_by_name.restype = [ctypes.c_char_p], vp
        for f in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
            getattr(b, f).argtypes, getattr(b, f).restype = [vp], ctypes.c_char_p
        b.ggml_backend_dev_type.argtypes, b.ggml_backend_dev_type.restype = [vp], ctypes.c_int
        b.ggml_backend_dev_memory.argtypes = [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)]
        b.ggml_backend_dev_memory.restype = None
        b.ggml_backend_dev_backend_reg.argtypes, b.ggml_backend_dev_backend_reg.restype = [vp], vp
        b.ggml_backend_reg_name.argtypes, b.ggml_backend_reg_name.restype = [vp], ctypes.c_char_p
        b.ggml_backend_reg_get_proc_address.argtypes = [vp, ctypes.c_char_p]
        b.ggml_backend_reg_get_proc_address.restype = vp
        b.ggml_set_abort_callback.argtypes = [vp]
        b.ggml_set_abort_callback.restype = vp

    @staticmethod
    def _open(libdir: Path, stem: str) -> ctypes.CDLL:
        """The copy of ``lib<stem>`` that libllama already uses. A wheel cannot hold symlinks, so
        ``libggml.so`` and ``libggml.so.0`` are two files: opening the other one would give a second, empty
        device registry (measured: RPC workers added there never reach a model)."""
        mapped = _mapped(stem)
        candidates: list[Path] = [Path(m) for m in mapped]
        for path in [*candidates, *(libdir / n for n in (f"lib{stem}.so.0", f"lib{stem}.so", f"lib{stem}.0.dylib",
                                                     f"lib{stem}.dylib", f"{stem}.dll"))]:
            if Path(path).exists():
                return ctypes.CDLL(str(path))
        return ctypes.CDLL(f"lib{stem}.so.0")  # a system-wide build: the loader's search path

    def rpc_proc(self, name: str, restype: Any, argtypes: list[Any]) -> Any:
        reg = self.ggml.ggml_backend_reg_by_name(b"RPC")
        addr = self.base.ggml_backend_reg_get_proc_address(reg, name.encode()) if reg else None
        if not addr:
            raise RuntimeError("this llama.cpp build has no RPC backend")
        return ctypes.CFUNCTYPE(restype, *argtypes)(addr)


def _mapped(stem: str) -> list[str]:
    """Paths of ``lib<stem>`` shared objects mapped into this process now (Linux; [] elsewhere)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(None, 5)[-1].strip() for line in f if f"/lib{stem}." in line}
    except OSError:
        return []
    return sorted(p for p in paths if re.search(rf"/lib{re.escape(stem)}\.(so(\.[0-9]+)*|[0-9.]*dylib)$", p))


_lib: _Lib | None = None
_lock = threading.Lock()


def _L() -> _Lib:
    global _lib
    with _lock:
        if _lib is None:
            _lib = _Lib()
        return _lib


def _device(i: int, dev: int) -> Device:
    b = _L().base
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    b.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
    reg = b.ggml_backend_dev_backend_reg(dev)
    reg_name = (b.ggml_backend_reg_name(reg) or b"").decode(errors="replace") if reg else ""
    if reg_name.startswith("RPC"):
        reg_name = "RPC"  # each worker is its own "RPC[host:port]" registry
    return Device(index=i, name=(b.ggml_backend_dev_name(dev) or b"?").decode(errors="replace"),
                  description=(b.ggml_backend_dev_description(dev) or b"").decode(errors="replace"),
                  type=_TYPES.get(int(b.ggml_backend_dev_type(dev)), "accel"),
                  free_bytes=int(free.value), total_bytes=int(total.value), backend=reg_name)


def list_devices() -> list[Device]:
    """Every device of the installed llama.cpp build (and of the RPC workers added, but those that died), with
    its memory now."""
    g = _L().ggml
    dead = {n for ep in _dead for n in _added.get(ep, [])}
    out = []
    for i in range(int(g.ggml_backend_dev_count())):
        h = g.ggml_backend_dev_get(i)
        if dead and (_L().base.ggml_backend_dev_name(h) or b"").decode(errors="replace") in dead:
            continue  # asking a dead worker for its memory would abort the process
        out.append(_device(i, h))
    return out


def listing() -> tuple[list[Device], bool]:
    """(:func:`list_devices`, :func:`rpc_supported`): what the descriptor's ``devices`` names for the probe."""
    return list_devices(), rpc_supported()


def device_handle(name: str) -> int | None:
    """ggml's handle of the device called ``name`` (for ``llama_model_params.devices``), or None."""
    h = _L().ggml.ggml_backend_dev_by_name(name.encode())
    return int(h) if h else None


def cpu_buffer_type() -> int:
    """The CPU device's buffer type (``ggml_backend_cpu_buffer_type()``, reached through the registry): where a
    tensor buffer-type override keeps weights in host memory (:mod:`backends.llamacpp.tensor_overrides`)."""
    L = _L()
    L.ggml.ggml_backend_dev_by_type.argtypes, L.ggml.ggml_backend_dev_by_type.restype = [ctypes.c_int], ctypes.c_void_p
    L.base.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
    L.base.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
    dev = L.ggml.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    buft = L.base.ggml_backend_dev_buffer_type(dev) if dev else None
    if not buft:
        raise RuntimeError("llama.cpp's device list has no CPU device")
    return int(buft)


def rpc_supported() -> bool:
    """The installed build has ggml's RPC backend (``-DGGML_RPC=on``)."""
    try:
        return bool(_L().ggml.ggml_backend_reg_by_name(b"RPC"))
    except Exception:  # noqa: BLE001 - no llama_cpp, no library: no RPC
        return False


# ------------------------------------------------------------------------------------------------ RPC

_ENDPOINT = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(?P<port>[0-9]{1,5})$")


def parse_endpoint(text: str) -> tuple[str, int]:
    """``host:port`` → (host, port); a ValueError with one sentence otherwise.

    >>> parse_endpoint("127.0.0.1:50052"), parse_endpoint("gpu-box.local:50053")
    (('127.0.0.1', 50052), ('gpu-box.local', 50053))
    >>> parse_endpoint("127.0.0.1")
    Traceback (most recent call last):
    ...
    ValueError: RPC worker '127.0.0.1' is not HOST:PORT (for example 127.0.0.1:50052).
    """
    m = _ENDPOINT.match(text.strip())
    port = int(m.group("port")) if m else 0
    if not m or not 0 < port < 65536:
        raise ValueError(f"RPC worker {text!r} is not HOST:PORT (for example 127.0.0.1:{RPC_DEFAULT_PORT}).")
    return m.group("host").strip("[]"), port


def parse_endpoints(text: str) -> list[str]:
    """A comma-separated list (``--rpc``, ``LOCALLLM_RPC``) → normalized endpoints; ValueError on a bad one."""
    out: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if part:
            host, port = parse_endpoint(part)
            ep = f"{host}:{port}"
            if ep not in out:
                out.append(ep)
    return out


def hello(endpoint: str, timeout: float = 3.0) -> tuple[int, int, int]:
    """Ask a worker for its protocol version, as ggml's client does first; OSError/TimeoutError if it does not
    answer in ``timeout`` seconds, ValueError if it answers something else.

    Why here and not in ggml: ``ggml_backend_rpc_add_server`` aborts the whole process on a worker that does
    not answer. A worker serves one client at a time: a busy one times out here.
    """
    host, port = parse_endpoint(endpoint)
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.settimeout(timeout)
        s.sendall(struct.pack("<BQ", _RPC_CMD_HELLO, _RPC_CONN_CAPS) + bytes(_RPC_CONN_CAPS))
        head = _recv(s, 8)
        (size,) = struct.unpack("<Q", head)
        if size != 4 + _RPC_CONN_CAPS:
            raise ValueError(f"{endpoint} is not a llama.cpp RPC worker of this version (answered {size} bytes)")
        body = _recv(s, size)
    major, minor, patch = body[0], body[1], body[2]
    if major != RPC_PROTO_MAJOR:
        raise ValueError(f"{endpoint} speaks RPC protocol {major}.{minor}.{patch}; this build speaks "
                         f"{RPC_PROTO_MAJOR}.x (install the same llama-cpp-python on both machines)")
    return major, minor, patch


def _recv(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the worker closed the connection")
        buf += chunk
    return buf


_added: dict[str, list[str]] = {}  # endpoint → the device names it added (ggml keeps them for the process)
_dead: set[str] = set()  # endpoints that stopped answering while in use


def add_worker(endpoint: str, timeout: float = 3.0) -> list[Device]:
    """Make a worker's devices part of this process's device list (once per endpoint); returns them.

    Raises RuntimeError (no RPC in this build), ValueError (a malformed endpoint, another protocol) or OSError
    (the worker does not answer), each with one sentence. ggml cannot remove a worker again.
    """
    host, port = parse_endpoint(endpoint)
    endpoint = f"{host}:{port}"
    if endpoint not in _added:
        if not rpc_supported():
            raise RuntimeError("this llama.cpp build has no RPC backend; " + RPC_INSTALL_HINT)
        try:
            hello(endpoint, timeout)
        except (OSError, ConnectionError) as e:
            raise OSError(f"RPC worker {endpoint} does not answer ({e or type(e).__name__})") from None
        L = _L()
        add = L.rpc_proc("ggml_backend_rpc_add_server", ctypes.c_void_p, [ctypes.c_char_p])
        before = {d.name for d in list_devices()}
        reg = add(endpoint.encode())
        if not reg:
            raise OSError(f"RPC worker {endpoint} reports no devices")
        L.ggml.ggml_backend_register(reg)
        _added[endpoint] = [d.name for d in list_devices() if d.name not in before]
    names = set(_added[endpoint])
    return [d for d in list_devices() if d.name in names]


def added_workers() -> dict[str, list[str]]:
    """The workers added in this process (and still answering): endpoint → device names."""
    return {k: list(v) for k, v in _added.items() if k not in _dead}


def endpoints_of(device_names: list[str]) -> list[str]:
    """The workers behind these device names ([] for local devices)."""
    return [ep for ep, names in _added.items() if set(names) & set(device_names)]


RPC_INSTALL_HINT = ('install an RPC-enabled build: CMAKE_ARGS="-DGGML_RPC=on" pip install --force-reinstall '
                    "--no-cache-dir llama-cpp-python==0.3.36")


def worker_devices(names: list[str] | None = None) -> list[Device]:
    """The local devices a worker serves: those named, else every one that offloads, else the CPU."""
    local = [d for d in list_devices() if not d.remote]
    if names:
        return [d for d in local if d.name in names]
    return [d for d in local if d.offloads] or [d for d in local if d.type == "cpu"]


def start_worker(host: str, port: int, threads: int, cache_dir: str | None = None,
                 devices: list[str] | None = None) -> None:
    """Serve this machine's devices over llama.cpp's RPC protocol; blocks until the process ends.

    ``devices``: names from :func:`list_devices` (default: every device that offloads, else the CPU), as
    ``ggml-rpc-server -d`` takes them. ``cache_dir``: where the worker caches large tensors by hash, so a reload
    does not send the weights again (``ggml-rpc-server -c``).
    """
    if not rpc_supported():
        raise RuntimeError("this llama.cpp build has no RPC backend; " + RPC_INSTALL_HINT)
    L = _L()
    chosen = worker_devices(devices)
    missing = sorted(set(devices or ()) - {d.name for d in chosen})
    if missing:
        known = ", ".join(d.name for d in list_devices() if not d.remote)
        raise ValueError(f"no device {', '.join(missing)} here (devices: {known})")
    handles = [h for h in (device_handle(d.name) for d in chosen) if h]
    arr = (ctypes.c_void_p * len(handles))(*handles)
    start = L.rpc_proc("ggml_backend_rpc_start_server", None,
                       [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                        ctypes.POINTER(ctypes.c_void_p)])
    start(f"{host}:{port}".encode(), cache_dir.encode() if cache_dir else None, threads, len(handles), arr)


# --------------------------------------------------------------------------------------------- aborts

_abort_state: dict[str, Any] = {"cb": None, "watchers": {}}
_ABORT_T = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_park = threading.Event()  # never set: a parked thread waits on it for good


def watch(key: object, endpoints: list[str], on_dead: Callable[[str], None]) -> None:
    """Call ``on_dead(sentence)`` when one of ``endpoints`` dies while in use (ggml is about to abort); until
    :func:`unwatch`. ``key``: whatever identifies the watcher (a model)."""
    _abort_state["watchers"][id(key)] = (list(endpoints), on_dead)
    if _abort_state["cb"] is None:
        fn = _ABORT_T(_on_abort)
        _abort_state["cb"] = fn
        _L().base.ggml_set_abort_callback(ctypes.cast(fn, ctypes.c_void_p))


def unwatch(key: object) -> None:
    _abort_state["watchers"].pop(id(key), None)


def _reachable(endpoint: str, timeout: float = 1.0) -> bool:
    """The worker's port still accepts connections. Not :func:`hello`: a worker serves one client at a time, so
    one in use by this process would not answer it."""
    host, port = parse_endpoint(endpoint)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _on_abort(msg: bytes | None) -> None:
    """ggml's abort callback: runs on the thread that is about to call ``abort()``."""
    try:
        text = (msg or b"").decode(errors="replace").strip()
        log.error("ggml is aborting: %s", text)
        try:  # straight to stderr too: the process may end right after, whatever the logging setup
            os.write(2, f"llama.cpp: {text}\n".encode(errors="replace"))
        except OSError:
            pass
        if "RPC" not in text:
            return  # not ours to save: abort() follows
        # which worker? A killed process closes its connections before its listening socket, so a connect can
        # still succeed for a moment after the error: ask again for up to 3 s
        dead: list[str] = []
        deadline = time.monotonic() + 3.0
        while not dead and time.monotonic() < deadline:
            dead = [ep for ep in _added if ep not in _dead and not _reachable(ep, timeout=0.5)]
            if not dead:
                time.sleep(0.1)
        dead = dead or [ep for ep in _added if ep in _dead]  # else one that died before, talked to again
        _dead.update(dead)
        watchers = list(_abort_state["watchers"].values())
        if not dead and not watchers:
            return  # nobody to tell, nothing known: abort() follows
        for endpoints, on_dead in watchers:
            # none found dead (it accepts connects but sent garbage): every model that uses a worker ends
            hit = [ep for ep in endpoints if ep in dead] if dead else list(endpoints)
            if hit:
                try:
                    on_dead(f"RPC worker {', '.join(hit)} stopped answering while this model used it; the model "
                            f"is unloaded (the next request loads it without that worker)")
                except Exception:  # noqa: BLE001 - never raise into C
                    log.exception("an RPC watcher failed")
    except Exception:  # noqa: BLE001 - never raise into C
        log.exception("the abort callback failed")
        return
    log.error("RPC worker(s) %s died: the thread that talked to them is parked, the process goes on", dead)
    _park.wait()  # never returns: ggml's abort() does not run
