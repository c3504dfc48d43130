"""The MCP host: the servers of ``mcp.json`` as clients of the official ``mcp`` SDK, on one event loop of their
own in a background thread, so neither the REPL (synchronous) nor the terminal app (its own event loop) ever
blocks on a server.

    host = McpHost(load_config())
    host.start(["time"])                  # returns at once; the server starts in the background
    host.wait(["time"], timeout=30)       # the REPL waits; the TUI listens with host.subscribe(callback)
    tools = host.tools(["time"])          # ToolInfo per tool, names made unique across servers
    result = host.call(tools[0], {"timezone": "UTC"})   # or `await host.acall(...)` from an event loop
    host.close()                          # every server stopped, its process gone

Why one loop in one thread: the SDK's stdio and HTTP transports are anyio task groups that must be entered and
left by the same task; a server's whole life (start, list, calls, stop) therefore runs in one long task, and
calls from either face arrive as coroutines submitted to that loop (``run_coroutine_threadsafe``). Cancelling
the caller's wait (Esc in the app, Ctrl+C in the REPL) cancels the call there too.

Faults cost one line and leave the host usable: a command that does not exist, a server that exits or never
answers while starting (``start_timeout``), a tool list with a malformed schema — the server is ``failed`` with
the reason; a call past its timeout, a server that dies mid-call, a tool error — the call's
:class:`ToolResult` says so (``is_error``) and goes back to the model as the tool's answer. A huge result is
cut to ``max_result_chars`` with a note saying so. Each server's stderr goes to ``<data>/logs/mcp-NAME.log``.

Shutdown: :meth:`McpHost.close` (also run at exit) leaves every server's context in its own task, which closes
the server's stdin and then terminates its process tree (the SDK's shutdown sequence); a stdio server whose
host is killed outright sees its stdin close and exits on its own.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import json
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

from localllm.errors import LocalLLMError
from localllm.mcp.config import McpConfig, ServerConfig

DEFAULT_MAX_RESULT_CHARS = 8000  # a small model's context is a few thousand tokens
DEFAULT_START_TIMEOUT = 30.0

State = Literal["off", "starting", "ready", "failed", "stopped"]


@dataclass(frozen=True)
class ToolInfo:
    """One tool of one server. ``public`` is the name the model sees: the tool's own name, or
    ``server__tool`` when two enabled servers offer a tool of that name."""

    server: str
    name: str
    public: str
    description: str = ""
    schema: dict[str, Any] = field(default_factory=lambda: {"type": "object"})

    def spec(self) -> dict[str, Any]:
        """The OpenAI-shaped function the chat template renders."""
        return {"type": "function", "function": {"name": self.public, "description": self.description,
                                                 "parameters": self.schema}}


@dataclass
class ToolResult:
    """What a call gave back: its text (what the model reads), whether it is an error, whether it was cut."""

    text: str
    is_error: bool = False
    truncated: bool = False
    seconds: float = 0.0


@dataclass
class ServerStatus:
    """A server's state as the settings list it: ``starting``, ``ready`` with its tools, ``failed`` with why."""

    name: str
    state: State = "off"
    tools: list[ToolInfo] = field(default_factory=list)
    error: str | None = None
    describe: str = ""  # the command line or the URL

    def line(self) -> str:
        """``time: ready, 2 tools`` / ``web: failed: ...``."""
        if self.state == "ready":
            n = len(self.tools)
            return f"{self.name}: ready, {n} tool{'s' if n != 1 else ''}"
        if self.state == "failed":
            return f"{self.name}: failed: {self.error}"
        return f"{self.name}: {self.state}"


class _Server:
    def __init__(self, name: str):
        self.status = ServerStatus(name)
        self.client: Any = None  # mcp.Client while ready
        self.stop: asyncio.Event | None = None
        self.task: asyncio.Task[None] | None = None
        self.started = threading.Event()  # set once it is no longer "starting"


def one_line(e: BaseException) -> str:
    """The first leaf of an exception group, as one short sentence."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:300]


def _public_name(text: str) -> str:
    """A name every chat template and API accepts: ``[A-Za-z0-9_-]{1,64}``."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", text)[:64] or "tool"


def schema_problem(schema: Any) -> str | None:
    """Why a tool's input schema cannot be given to a model, or None: it must be a valid JSON Schema of an
    object (``jsonschema``'s own meta-schema check)."""
    if not isinstance(schema, dict):
        return "its input schema is not a JSON object"
    if schema.get("type", "object") != "object":
        return f'its input schema has type {json.dumps(schema.get("type"))}, not "object"'
    import jsonschema  # type: ignore[import-untyped]

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        return f"its input schema is not valid JSON Schema ({e.message})"
    return None


class McpHost:
    """The MCP servers of one app (or REPL) session. Thread-safe; every method returns quickly except
    :meth:`wait` and :meth:`call`, which block by design (the REPL)."""

    def __init__(self, config: McpConfig, *, log_dir: Path | None = None,
                 max_result_chars: int = DEFAULT_MAX_RESULT_CHARS, start_timeout: float = DEFAULT_START_TIMEOUT):
        self.config = config
        if log_dir is None:
            from localllm.config import paths

            log_dir = paths().data / "logs"
        self.log_dir = log_dir
        self.max_result_chars = max_result_chars
        self.start_timeout = start_timeout
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._listeners: list[Callable[[ServerStatus], None]] = []
        self._logs: list[TextIO] = []
        self._closed = False
        self._servers: dict[str, _Server] = {n: _Server(n) for n in config.names}
        for name, srv in self._servers.items():
            cfg = config.servers.get(name)
            srv.status.describe = cfg.describe() if cfg else ""
            if name in config.problems:  # a bad entry: listed as failed with its sentence
                self._fail(srv, config.problems[name])
        _open_hosts.add(self)

    # ------------------------------------------------------------------ state

    @property
    def names(self) -> list[str]:
        return list(self._servers)

    def status(self, name: str) -> ServerStatus:
        srv = self._servers.get(name)
        if srv is None:
            known = ", ".join(self._servers) or "none (no mcp.json)"
            raise LocalLLMError(f'There is no MCP server "{name}" in {self.config.path}; the servers: {known}.')
        return srv.status

    def statuses(self) -> list[ServerStatus]:
        return [s.status for s in self._servers.values()]

    def subscribe(self, callback: Callable[[ServerStatus], None]) -> Callable[[], None]:
        """Call ``callback(status)`` (from the host's thread) whenever a server's state changes; returns the
        function that unsubscribes."""
        self._listeners.append(callback)
        return lambda: self._listeners.remove(callback) if callback in self._listeners else None

    def _changed(self, srv: _Server) -> None:
        if srv.status.state != "starting":
            srv.started.set()
        for cb in list(self._listeners):
            try:
                cb(srv.status)
            except Exception:  # noqa: BLE001 - a listener's bug must not stop a server
                pass

    def _fail(self, srv: _Server, reason: str) -> None:
        srv.status.state, srv.status.error, srv.status.tools = "failed", reason, []
        srv.client = None
        self._changed(srv)

    # ------------------------------------------------------------------ lifecycle

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._closed:
                raise LocalLLMError("The MCP host is closed.")
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="localllm-mcp", daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop

    def start(self, names: Iterable[str], *, retry: bool = False) -> None:
        """Start these servers in the background (those not started yet; with ``retry`` also those that failed,
        unless their ``mcp.json`` entry is what is wrong); returns at once."""
        for name in names:
            srv = self._servers.get(name)
            if srv is None:
                self.status(name)  # raises the sentence
                continue
            again = retry and srv.status.state == "failed" and name in self.config.servers
            if srv.status.state not in ("off", "stopped") and not again:
                continue
            srv.status.state, srv.status.error = "starting", None
            srv.started.clear()
            self._changed(srv)
            loop = self._ensure_loop()
            loop.call_soon_threadsafe(self._spawn, srv)

    def _spawn(self, srv: _Server) -> None:
        cfg = self.config.servers[srv.status.name]
        srv.stop = asyncio.Event()
        srv.task = asyncio.ensure_future(self._run(srv, cfg))
        assert self._loop is not None
        self._loop.call_later(self.start_timeout, self._start_watchdog, srv, srv.task)

    def _start_watchdog(self, srv: _Server, task: asyncio.Task[None]) -> None:
        if srv.task is task and srv.status.state == "starting":
            self._fail(srv, f"it did not answer within {self.start_timeout:g} s (its log: {self._log_path(srv)})")
            task.cancel()

    def _log_path(self, srv: _Server) -> Path:
        return self.log_dir / f"mcp-{srv.status.name}.log"

    async def _run(self, srv: _Server, cfg: ServerConfig) -> None:
        """One server's whole life in one task: connect, list its tools, wait for the stop, disconnect."""
        from mcp import Client

        name = cfg.name
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = open(self._log_path(srv), "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - kept open while it runs
            self._logs.append(log)
            log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting {cfg.describe()}\n")
        except OSError as e:
            self._fail(srv, f"its log file cannot be written: {e.strerror or e}")
            return
        me = asyncio.current_task()

        def mine() -> bool:  # a retry may have replaced this task while it was still shutting down
            return srv.task is me

        try:
            async with AsyncExitStack() as stack:
                transport = await self._transport(cfg, log, stack)
                client = await stack.enter_async_context(Client(transport))
                tools = await self._list_tools(client, name)
                if not mine():
                    return
                srv.client = client
                srv.status.tools, srv.status.state = tools, "ready"
                self._changed(srv)
                assert srv.stop is not None
                await srv.stop.wait()
        except asyncio.CancelledError:
            if mine() and srv.status.state == "starting":
                self._fail(srv, "it was stopped while starting")
            raise
        except Exception as e:  # noqa: BLE001 - one line, the chat goes on
            if mine() and srv.status.state != "failed":
                self._fail(srv, self._start_error(cfg, e, srv))
        finally:
            if mine():
                srv.client = None
                if srv.status.state == "ready":
                    srv.status.state = "stopped"
                    self._changed(srv)
            log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} stopped\n")

    async def _transport(self, cfg: ServerConfig, log: TextIO, stack: AsyncExitStack) -> Any:
        if cfg.command:
            import os
            import shutil

            from mcp.client.stdio import StdioServerParameters, stdio_client

            exe = cfg.command
            if os.sep not in exe and shutil.which(exe) is None:
                raise FileNotFoundError(exe)
            params = StdioServerParameters(command=exe, args=list(cfg.args), env=cfg.env or None, cwd=cfg.cwd)
            return stdio_client(params, errlog=log)
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        http = await stack.enter_async_context(
            httpx2.AsyncClient(headers=cfg.headers, timeout=httpx2.Timeout(30.0, read=300.0)))
        assert cfg.url is not None
        return streamable_http_client(cfg.url, http_client=http)

    def _start_error(self, cfg: ServerConfig, e: BaseException, srv: _Server) -> str:
        leaf = e
        while isinstance(leaf, BaseExceptionGroup) and leaf.exceptions:
            leaf = leaf.exceptions[0]
        if isinstance(leaf, FileNotFoundError) and cfg.command:
            return f'its command "{cfg.command}" was not found (is it installed and on PATH?)'
        if isinstance(leaf, PermissionError) and cfg.command:
            return f'its command "{cfg.command}" cannot be run (permission denied)'
        if cfg.url and "connect" in type(leaf).__name__.lower():
            return f"nothing answers at {cfg.url} ({one_line(leaf)})"
        return f"{one_line(leaf)} (its log: {self._log_path(srv)})"

    async def _list_tools(self, client: Any, server: str) -> list[ToolInfo]:
        out: list[ToolInfo] = []
        cursor: str | None = None
        for _ in range(100):  # a paginator that never ends cannot hang the start
            page = await client.list_tools(cursor=cursor)
            for tool in page.tools:
                schema = tool.input_schema
                problem = schema_problem(schema)
                if problem:
                    raise LocalLLMError(f'it lists the tool "{tool.name}" with a malformed schema: {problem}')
                out.append(ToolInfo(server=server, name=tool.name, public=_public_name(tool.name),
                                    description=tool.description or "", schema=dict(schema)))
            cursor = page.next_cursor
            if not cursor:
                break
        return out

    def wait(self, names: Iterable[str], timeout: float | None = None) -> None:
        """Block until none of these servers is starting any more (the REPL; the app subscribes instead)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for name in names:
            srv = self._servers.get(name)
            if srv is None:
                continue
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            srv.started.wait(left)

    def tools(self, names: Iterable[str], disabled: Iterable[str] = ()) -> list[ToolInfo]:
        """The tools of the ready servers among ``names``, minus ``disabled`` (``server/tool`` or a public name);
        a tool name offered by two of them becomes ``server__tool`` for both."""
        off = set(disabled)
        ready = [s for n in dict.fromkeys(names) if (s := self._servers.get(n)) and s.status.state == "ready"]
        counts: dict[str, int] = {}
        for s in ready:
            for t in s.status.tools:
                counts[t.public] = counts.get(t.public, 0) + 1
        out: list[ToolInfo] = []
        for s in ready:
            for t in s.status.tools:
                public = _public_name(f"{t.server}__{t.name}") if counts[t.public] > 1 else t.public
                tool = ToolInfo(server=t.server, name=t.name, public=public, description=t.description,
                                schema=t.schema)
                if f"{t.server}/{t.name}" in off or public in off:
                    continue
                out.append(tool)
        return out

    # ------------------------------------------------------------------ calls

    def _submit(self, tool: ToolInfo, arguments: dict[str, Any],
                timeout: float | None) -> concurrent.futures.Future[ToolResult]:
        loop = self._ensure_loop()
        return asyncio.run_coroutine_threadsafe(self._call(tool, arguments, timeout), loop)

    def call(self, tool: ToolInfo, arguments: dict[str, Any], *, timeout: float | None = None,
             cancel: threading.Event | None = None) -> ToolResult:
        """Call ``tool`` and wait for its result (``cancel`` set, or Ctrl+C, stops the call)."""
        future = self._submit(tool, arguments, timeout)
        try:
            while True:
                try:
                    return future.result(timeout=0.1)
                except concurrent.futures.TimeoutError:
                    if cancel is not None and cancel.is_set():
                        future.cancel()
                        return ToolResult("The user stopped this tool call.", is_error=True)
        except BaseException:
            future.cancel()
            raise

    async def acall(self, tool: ToolInfo, arguments: dict[str, Any], *, timeout: float | None = None) -> ToolResult:
        """:meth:`call` for an event loop; cancelling the awaiting task cancels the call on the server."""
        return await asyncio.wrap_future(self._submit(tool, arguments, timeout))

    async def _call(self, tool: ToolInfo, arguments: dict[str, Any], timeout: float | None) -> ToolResult:
        srv = self._servers.get(tool.server)
        cfg = self.config.servers.get(tool.server)
        if srv is None or cfg is None or srv.client is None or srv.status.state != "ready":
            state = srv.status.line() if srv is not None else f"{tool.server}: unknown"
            return ToolResult(f'The MCP server "{tool.server}" is not running ({state}).', is_error=True)
        limit = timeout if timeout is not None else cfg.timeout
        t0 = time.perf_counter()
        try:
            result = await asyncio.wait_for(srv.client.call_tool(tool.name, arguments), limit)
        except TimeoutError:
            return ToolResult(f'The tool "{tool.public}" did not answer within {limit:g} s; the call was abandoned.',
                              is_error=True, seconds=time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - the error is the tool's result
            from mcp.shared.exceptions import MCPError
            from mcp_types import CONNECTION_CLOSED

            text = one_line(e)
            if isinstance(e, MCPError) and e.code == CONNECTION_CLOSED:  # the server went away: failed from now on
                self._fail(srv, f"it exited during a call to {tool.name} (its log: {self._log_path(srv)})")
                if srv.stop is not None:
                    srv.stop.set()
                text = f'The MCP server "{tool.server}" exited during the call.'
            else:
                text = f'The tool "{tool.public}" failed: {text}'
            return ToolResult(text, is_error=True, seconds=time.perf_counter() - t0)
        out = self._result_text(result)
        out.seconds = time.perf_counter() - t0
        return out

    def _result_text(self, result: Any) -> ToolResult:
        parts: list[str] = []
        for item in result.content or []:
            kind = getattr(item, "type", "")
            if kind == "text":
                parts.append(item.text)
            elif kind in ("image", "audio"):
                parts.append(f"[{item.mime_type} {kind}, not shown to the model]")
            elif kind == "resource":
                res = item.resource
                parts.append(getattr(res, "text", None) or f"[resource {res.uri}]")
            elif kind == "resource_link":
                parts.append(f"[resource {item.uri}]")
        if not parts and result.structured_content is not None:
            parts.append(json.dumps(result.structured_content, ensure_ascii=False))
        text = "\n".join(parts)
        cut = len(text) > self.max_result_chars
        if cut:
            text = (text[: self.max_result_chars] + f"\n[… cut: the tool returned {len(text)} characters; the first "
                    f"{self.max_result_chars} are shown]")
        return ToolResult(text, is_error=bool(result.is_error), truncated=cut)

    # ------------------------------------------------------------------ shutdown

    def close(self, timeout: float = 10.0) -> None:
        """Stop every server (its process ends) and the host's thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop, thread = self._loop, self._thread
        _open_hosts.discard(self)
        if loop is None or thread is None:
            return

        async def stop_all() -> None:
            tasks = [s.task for s in self._servers.values() if s.task is not None and not s.task.done()]
            for s in self._servers.values():
                if s.stop is not None:
                    s.stop.set()
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=timeout * 0.8)
                for t in pending:
                    t.cancel()
                if pending:
                    await asyncio.wait(pending, timeout=timeout * 0.2)

        try:
            asyncio.run_coroutine_threadsafe(stop_all(), loop).result(timeout + 1)
        except BaseException:  # noqa: BLE001 - shutting down: the servers' stdin closes with us anyway
            pass
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        if not thread.is_alive():
            loop.close()
        for log in self._logs:
            try:
                log.close()
            except OSError:
                pass

    def __enter__(self) -> McpHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_open_hosts: weakref.WeakSet[McpHost] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for host in list(_open_hosts):
        host.close(timeout=5)
