"""`localllm serve` with no host setting listens on loopback only: the real command in a subprocess."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def other_local_addresses() -> list[str]:
    """This machine's IPv4/IPv6 addresses that are not loopback."""
    out = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                ip = a.address.split("%")[0]
                if not (ip.startswith("127.") or ip == "::1" or ip.startswith("fe80:")):
                    out.append(ip)
    return out


def test_serve_without_a_host_listens_on_loopback_only(installed_default_model):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "LOCALLLM_HOST"}
    # `--host :PORT` names a port and leaves the host to the default (the documented way to move the port)
    proc = subprocess.Popen([sys.executable, "-m", "localllm", "serve", "--host", f":{port}"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read().decode(errors="replace")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "serve did not answer on 127.0.0.1 within 60 s"
            time.sleep(0.2)
        listening = [c for c in psutil.Process(proc.pid).net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN]
        assert listening, "the server process has no listening socket"
        assert {(c.laddr.ip, c.laddr.port) for c in listening} == {("127.0.0.1", port)}, listening
        for ip in other_local_addresses():  # reachable from outside this machine: must be refused
            family = socket.AF_INET6 if ":" in ip else socket.AF_INET
            with socket.socket(family) as s:
                s.settimeout(5)
                assert s.connect_ex((ip, port)) != 0, f"port {port} answers on {ip}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
