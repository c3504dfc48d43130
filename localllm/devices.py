"""Several machines: llama.cpp's RPC workers, as the CLI and the server use them.

``localllm worker`` serves this machine's devices (:func:`serve_worker`); ``serve``/``run``/``bench --rpc
HOST:PORT,...`` and ``LOCALLLM_RPC`` add workers as devices (:func:`use_workers`), before the first load: the
probe then lists them (``RPC0``, ``RPC1``...) with the memory each worker reports, and the planner places layers
on them as on any GPU. ggml keeps an added worker for the life of the process.

The protocol has no authentication or encryption (llama.cpp's own warning): a worker binds loopback unless told
otherwise, and says so when it is told.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

from backends.llamacpp import devices as ggml_devices
from localllm.errors import LocalLLMError

log = logging.getLogger("localllm.devices")

RPC_ENV = "LOCALLLM_RPC"
DEFAULT_PORT = ggml_devices.RPC_DEFAULT_PORT
HELLO_TIMEOUT_S = 3.0
RPC_INSTALL = ('CMAKE_ARGS="-DGGML_RPC=on" pip install --force-reinstall --no-cache-dir '
               "llama-cpp-python==0.3.36")


class RPCError(LocalLLMError):
    """A worker list that cannot be used as given (malformed, or a build without RPC)."""


@dataclass(frozen=True)
class Worker:
    endpoint: str  # "host:port"
    devices: tuple[str, ...]  # the names they got here: ("RPC0",)
    free_bytes: int
    total_bytes: int


def rpc_supported() -> bool:
    """The installed llama.cpp build has the RPC backend."""
    return ggml_devices.rpc_supported()


def parse_workers(value: str | None) -> list[str]:
    """``--rpc`` / ``LOCALLLM_RPC`` → endpoints; one sentence (RPCError) for a malformed one."""
    try:
        return ggml_devices.parse_endpoints(value or "")
    except ValueError as e:
        raise RPCError(str(e)) from None


def use_workers(value: str | None = None, *, say: Callable[[str], None] | None = None,
                timeout: float = HELLO_TIMEOUT_S) -> list[Worker]:
    """Add the workers named in ``value`` (else ``LOCALLLM_RPC``) to this process's devices.

    A worker that does not answer within ``timeout`` is skipped with one line through ``say`` (default: the
    log); a malformed list, or any worker asked of a build without RPC, is an :class:`RPCError`.
    """
    endpoints = parse_workers(value if value is not None else os.environ.get(RPC_ENV))
    if not endpoints:
        return []
    if not rpc_supported():
        raise RPCError(f"--rpc {','.join(endpoints)}: this llama.cpp build has no RPC backend. Install one with: "
                       f"{RPC_INSTALL}")
    out: list[Worker] = []
    for ep in endpoints:
        try:
            devs = ggml_devices.add_worker(ep, timeout)
        except (OSError, ValueError) as e:
            line = f"RPC worker {ep} skipped: {str(e).removeprefix(f'RPC worker {ep} ')}"
            (say or log.warning)(line)
            continue
        out.append(Worker(ep, tuple(d.name for d in devs), sum(d.free_bytes for d in devs),
                          sum(d.total_bytes for d in devs)))
    if out:
        from localllm.hardware import probe

        probe(refresh=True)  # the planner reads the device list through the probe
    return out


def added_workers() -> dict[str, list[str]]:
    """Endpoint → device names, for the workers this process added."""
    return ggml_devices.added_workers()


def check_port(host: str, port: int) -> None:
    """One sentence now for an address that cannot be bound (ggml only prints and returns)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise RPCError(f"Cannot listen on {host}:{port}: {e.strerror or e}.") from None


def serve_worker(host: str, port: int, threads: int, *, cache_dir: str | None = None,
                 devices: list[str] | None = None) -> threading.Thread:
    """Start serving this machine's devices on ``host:port`` in a daemon thread (ggml's server loop never
    returns while it serves); the caller waits on it. RPCError for a build without RPC, an unknown device or an
    address in use."""
    if not rpc_supported():
        raise RPCError(f"This llama.cpp build has no RPC backend. Install one with: {RPC_INSTALL}")
    check_port(host, port)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            ggml_devices.start_worker(host, port, threads, cache_dir, devices)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            errors.append(e)

    t = threading.Thread(target=run, name=f"rpc-worker-{port}", daemon=True)
    t.start()
    t.join(0.3)  # an unknown device fails at once
    if errors:
        raise RPCError(str(errors[0]))
    return t


def worker_devices(devices: list[str] | None = None) -> list[ggml_devices.Device]:
    """The local devices a worker would serve (``devices``: names; default every offload device, else CPU)."""
    return ggml_devices.worker_devices(devices)
