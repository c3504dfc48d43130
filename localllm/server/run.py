"""Bind the address and run uvicorn: ``serve()`` for ``localllm serve``, :class:`ServerThread` for tests
and benchmarks (a real server on a free port in a background thread)::

    with ServerThread() as srv:
        httpx.get(srv.url + "/api/version").json()
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from localllm.config import is_loopback
from localllm.errors import LocalLLMError

if TYPE_CHECKING:
    from localllm.engine import Engine


def parse_address(address: str) -> tuple[str, int]:
    """``"127.0.0.1:11434"``, ``"[::1]:8080"``, ``":9000"``, ``"0.0.0.0"`` → (host, port).

    >>> parse_address("[::1]:8080"), parse_address(":9000"), parse_address("http://localhost")
    (('::1', 8080), ('127.0.0.1', 9000), ('localhost', 11434))
    """
    a = address.strip()
    for prefix in ("http://", "https://"):
        if a.startswith(prefix):
            a = a[len(prefix):]
    a = a.split("/", 1)[0]
    if a.startswith("["):
        host, _, rest = a[1:].partition("]")
        port = rest.lstrip(":") or "11434"
    elif a.count(":") == 1:
        host, port = a.split(":")
    elif a.count(":") > 1:  # bare IPv6
        host, port = a, "11434"
    else:
        host, port = a, "11434"
    host = host or "127.0.0.1"
    try:
        p = int(port)
        if not 0 <= p <= 65535:
            raise ValueError
    except ValueError:
        raise LocalLLMError(f"{address!r} is not a valid address; use HOST:PORT like 127.0.0.1:11434.") from None
    return host, p


def _family(host: str) -> socket.AddressFamily:
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return socket.AF_INET


def free_port(host: str, start: int) -> int | None:
    for port in range(start + 1, min(start + 50, 65536)):
        with socket.socket(_family(host), socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
                return port
            except OSError:
                continue
    return None


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket, or one sentence: the port is taken (and which one to use instead)."""
    if host == "localhost":
        host = "127.0.0.1"
    # proto=IPPROTO_TCP matters: asyncio only turns Nagle off (TCP_NODELAY) on accepted sockets whose proto
    # says TCP, and with Nagle on every keep-alive response waits ~40 ms for a delayed ACK.
    sock = socket.socket(_family(host), socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if e.errno == errno.EADDRINUSE:
            alt = free_port(host, port)
            hint = f"; run `LOCALLLM_HOST={host}:{alt} localllm serve` to use port {alt} instead" if alt else ""
            raise LocalLLMError(f"Port {port} on {host} is already in use (another localllm or Ollama?){hint}.") \
                from None
        if e.errno == errno.EACCES:
            raise LocalLLMError(f"No permission to listen on {shown}; use a port above 1023.") from None
        raise LocalLLMError(f"Cannot listen on {shown}: {e.strerror or e}.") from None
    sock.setblocking(False)
    return sock


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The loud warning printed when the server listens beyond this machine."""
    if is_loopback(host):
        return None
    lines = [
        "!" * 78,
        f"WARNING: localllm is listening on {host}, beyond this machine.",
        "Anyone who can reach this port can run, pull and delete models.",
        "Set LOCALLLM_API_KEY to require a bearer token." if not api_key
        else "Requests need the bearer token in LOCALLLM_API_KEY.",
        "!" * 78,
    ]
    return "\n".join(lines)


def _config(app: Any, log_level: str) -> Any:
    import uvicorn

    return uvicorn.Config(app, log_level=log_level, lifespan="off", access_log=log_level == "debug",
                          timeout_graceful_shutdown=3, server_header=False)


STOP_GENERATING_AFTER = 2.0  # seconds into a shutdown: running generations are stopped (uvicorn cancels at 3)


class _CancelledAtShutdown(logging.Filter):
    """Drops uvicorn's "Exception in ASGI application" for a request task that the shutdown itself
    cancelled (a CancelledError while the server is stopping): that is the stop working, not a bug."""

    def __init__(self, server: Any):
        super().__init__()
        self.server = server

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (self.server.should_exit and isinstance(exc, asyncio.CancelledError))


def _server_class() -> type:
    import uvicorn
    from uvicorn.server import HANDLED_SIGNALS

    class Server(uvicorn.Server):
        """uvicorn's server, stopping cleanly on Ctrl+C (SIGINT) or SIGTERM.

        * uvicorn raises the signal again after a graceful shutdown, once its handlers are restored, which
          turns a clean stop into a KeyboardInterrupt ("Aborted!", exit 1) or a death by SIGTERM (exit 143)
          before the engine is closed. Here the stop is the end: the engine closes and the process exits 0.
        * requests in flight get ``STOP_GENERATING_AFTER`` seconds; then ``on_shutdown`` (the engine's
          ``cancel_all``) stops their generations, so their responses end properly before uvicorn's
          graceful timeout would cancel the tasks mid-response.
        """

        def __init__(self, config: Any, on_shutdown: Any = None):
            super().__init__(config)
            self.on_shutdown = on_shutdown

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            timer = None
            if self.on_shutdown is not None:
                timer = asyncio.get_running_loop().call_later(STOP_GENERATING_AFTER, self.on_shutdown)
            try:
                await super().shutdown(sockets)
            finally:
                if timer is not None:
                    timer.cancel()

    return Server


def page_url(host: str, port: int) -> str:
    """The web page's address for a browser on this machine (an unspecified bind address is reached on loopback).

    >>> page_url("0.0.0.0", 11434), page_url("::1", 8080), page_url("localhost", 80)
    ('http://127.0.0.1:11434/ui/', 'http://[::1]:8080/ui/', 'http://localhost:80/ui/')
    """
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}/ui/" if ":" in host else f"http://{host}:{port}/ui/"


def serve(address: str | None = None, *, engine: Engine | Callable[[], Engine] | None = None,
          log_level: str = "info", open_page: bool = False) -> None:
    """Run the server in the foreground until Ctrl+C or SIGTERM; then finish the requests in flight (3 s
    at most), close the engine (its models and threads) and return. ``open_page``: open the web page in the
    default browser once the address is bound."""
    import os

    from localllm import config
    from localllm.server.app import create_app

    host, port = parse_address(address or config.host())
    sock = bind_socket(host, port)
    api_key = os.environ.get("LOCALLLM_API_KEY") or None
    warning = exposure_warning(host, api_key)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    # a factory builds the engine once the address is ours
    app = create_app(engine() if callable(engine) else engine, bound_host=host, api_key=api_key)
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    print(f"localllm serving the Ollama API on http://{shown} and the OpenAI API on http://{shown}/v1",
          file=sys.stderr, flush=True)
    page = page_url(host, port)
    print(f"Web UI: {page}", file=sys.stderr, flush=True)
    if open_page:  # the socket listens already: the browser's first request waits in its backlog
        import webbrowser

        threading.Thread(target=webbrowser.open, args=(page,), name="localllm-open", daemon=True).start()
    server = _server_class()(_config(app, log_level), on_shutdown=app.state.engine.cancel_all)
    quiet = _CancelledAtShutdown(server)
    logging.getLogger("uvicorn.error").addFilter(quiet)
    try:
        server.run(sockets=[sock])
    finally:
        logging.getLogger("uvicorn.error").removeFilter(quiet)
        app.state.engine.close()


class ServerThread:
    """A real server on ``host:port`` (0 = a free port) in a daemon thread. ``url`` once started."""

    def __init__(self, app: Any = None, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning",
                 **app_kwargs: Any):
        import uvicorn

        if app is None:
            from localllm.server.app import create_app

            app = create_app(bound_host=host, **app_kwargs)
        self.app = app
        self.sock = bind_socket(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = uvicorn.Server(_config(app, log_level))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="localllm-server", daemon=True)

    @property
    def engine(self) -> Engine:
        return self.app.state.engine  # type: ignore[no-any-return]

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
