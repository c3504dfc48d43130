"""``localllm worker``: serve this machine's devices to another localllm (or llama.cpp) over RPC.

    $ localllm worker                                  # 127.0.0.1:50052, every GPU here (else the CPU)
    $ localllm worker --port 50053 --threads 4
    $ localllm worker --host 0.0.0.0 --allow-network   # other machines: the protocol has NO authentication
    $ localllm serve --rpc 127.0.0.1:50052,127.0.0.1:50053   # on the machine that runs the model

It needs a llama.cpp build with RPC (``CMAKE_ARGS="-DGGML_RPC=on"``, README "Install options"); the protocol is
llama.cpp's own, so ``llama-server --rpc`` and ``llama-bench --rpc`` can use this worker too. Ctrl-C stops it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import click


@click.command("worker")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. Anything but loopback needs --allow-network.")
@click.option("--port", type=click.IntRange(1, 65535), default=50052, show_default=True, help="Port to listen on.")
@click.option("--threads", type=click.IntRange(1, 1024), default=None,
              help="CPU threads for the work it is sent (default: the physical cores).")
@click.option("--device", "devices", multiple=True, metavar="NAME",
              help="Serve only this device (repeatable; names as `localllm probe` lists them).")
@click.option("--cache", "cache", is_flag=True,
              help="Cache the tensors it is sent on disk, so a reload does not send the weights again.")
@click.option("--allow-network", is_flag=True,
              help="Allow a non-loopback --host. Anyone who reaches the port can use this machine's devices.")
def command(host: str, port: int, threads: int | None, devices: tuple[str, ...], cache: bool,
            allow_network: bool) -> None:
    """Serve this machine's devices over llama.cpp's RPC protocol (for --rpc elsewhere)."""
    from localllm import config
    from localllm.config import is_loopback
    from localllm.devices import RPCError, serve_worker, worker_devices
    from localllm.hardware import probe

    if not is_loopback(host) and not allow_network:
        raise click.UsageError(f"--host {host} reaches beyond this machine and the RPC protocol has no "
                               "authentication; add --allow-network if that is what you want.")
    n = threads or probe().physical_cores or 1
    cache_dir = str(config.paths().cache / "rpc") if cache else None
    try:
        serving = worker_devices(list(devices) or None)
        if devices and len(serving) != len(set(devices)):
            known = ", ".join(d.name for d in worker_devices()) or "none"
            missing = ", ".join(sorted(set(devices) - {d.name for d in serving}))
            raise RPCError(f"No device {missing} here (devices: {known}).")
        t = serve_worker(host, port, n, cache_dir=cache_dir, devices=list(devices) or None)
    except RPCError as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(1)
    what = ", ".join(f"{d.name} ({d.description}, {d.free_bytes // 2**20} MiB free)" for d in serving)
    click.echo(f"RPC worker on {host}:{port}, {n} threads: {what}", err=True)
    if not is_loopback(host):
        click.echo("Warning: llama.cpp's RPC protocol has no authentication or encryption; use a trusted "
                   "network only.", err=True)
    click.echo(f"Use it with: localllm serve --rpc {host}:{port}   (Ctrl-C stops)", err=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while t.is_alive() and not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    # ggml's server loop cannot be stopped from Python: leave without running its static destructors
    # under a thread still inside it.
    os._exit(0)
