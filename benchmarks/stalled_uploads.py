"""``GET /api/tags`` latency while N blob uploads trickle (issue 46): a ``localllm serve`` process on a free
loopback port over an empty store in a temporary home; first ``--reps`` requests alone, then the same with
``--uploads`` ``POST /api/blobs/sha256:...`` bodies open (1 GiB announced, one byte a second each, from raw
sockets), each request with a 10 s timeout (the first that gets no answer ends the round).

    python benchmarks/stalled_uploads.py [--uploads 40] [--reps 20] [--code DIR]

``--code DIR``: the checkout whose ``localllm`` serves (default this one), so that the same script measures the
code before a change: ``--code /path/to/an/older/checkout``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tags_latencies(url: str, reps: int, timeout: float = 10.0) -> tuple[list[float], bool]:
    """Seconds per ``GET /api/tags`` (one keep-alive client); True when one got no answer in ``timeout``."""
    import httpx

    out: list[float] = []
    with httpx.Client(timeout=timeout) as client:
        for _ in range(reps):
            t0 = time.perf_counter()
            try:
                client.get(url + "/api/tags").raise_for_status()
            except httpx.TimeoutException:
                return out, True
            out.append(time.perf_counter() - t0)
    return out, False


def summary(lat: list[float], timed_out: bool) -> str:
    if not lat:
        return "no answer in 10 s" if timed_out else "no requests"
    ms = sorted(x * 1000 for x in lat)
    text = f"median {statistics.median(ms):.1f} ms, max {ms[-1]:.1f} ms over {len(ms)}"
    return text + (" (then one got no answer in 10 s)" if timed_out else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--uploads", type=int, default=40)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--code", type=Path, default=ROOT, help="the checkout whose localllm serves")
    args = ap.parse_args()

    port = free_port()
    home = Path(tempfile.mkdtemp(prefix="localllm-bench-uploads-"))
    env = {**os.environ, "LOCALLLM_HOME": str(home), "LOCALLLM_HOST": f"127.0.0.1:{port}",
           "PYTHONPATH": str(args.code.resolve())}
    env.pop("LOCALLLM_MODELS", None)
    log = open(home / "server.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "localllm", "serve"], env=env, cwd=home, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    socks: list[socket.socket] = []
    stop = threading.Event()
    try:
        import httpx

        for _ in range(600):
            try:
                httpx.get(url + "/api/version", timeout=1)
                break
            except httpx.HTTPError:
                if proc.poll() is not None:
                    tail = (home / "server.log").read_text(errors="replace")[-800:]
                    raise SystemExit(f"server exited: {tail}") from None
                time.sleep(0.1)
        alone = tags_latencies(url, args.reps)
        for i in range(args.uploads):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(f"POST /api/blobs/sha256:{i:064x} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                      f"Content-Length: {1 << 30}\r\n\r\nG".encode())
            socks.append(s)

        def trickle() -> None:
            while not stop.wait(1.0):
                for s in socks:
                    try:
                        s.send(b"G")
                    except OSError:
                        pass

        threading.Thread(target=trickle, daemon=True).start()
        time.sleep(1.0)
        beside = tags_latencies(url, args.reps)
        print(f"code: {args.code.resolve()}")
        print(f"/api/tags alone:                        {summary(*alone)}")
        print(f"/api/tags beside {args.uploads} trickling uploads: {summary(*beside)}")
    finally:
        stop.set()
        for s in socks:
            s.close()
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
