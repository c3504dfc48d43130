"""``mcp.json`` in the config dir: the MCP servers a chat can use, in the format Claude Desktop, Cursor and LM
Studio share, so a file written for one of them works here unchanged::

    {
      "mcpServers": {
        "time":  {"command": "mcp-server-time", "args": ["--local-timezone", "Europe/Paris"]},
        "files": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "/tmp"],
                  "env": {"DEBUG": "0"}, "cwd": "/tmp", "default": true},
        "web":   {"url": "http://127.0.0.1:8000/mcp", "headers": {"Authorization": "Bearer ..."}}
      }
    }

An entry with ``command`` runs a server as a child process over stdio (``args``, ``env`` merged over a
minimal environment, ``cwd``); one with ``url`` talks streamable HTTP (``headers`` on every request). Two keys
are ours: ``"default": true`` puts a server in every new chat and in ``localllm run`` without ``--mcp``, and
``"timeout"`` (seconds, default 60) bounds each of its tool calls. Keys other tools add (``type``,
``disabled``, ``alwaysAllow``, ...) are read where they mean the same (``disabled``) and ignored otherwise.

A bad entry does not spoil the others: it becomes one sentence in :attr:`McpConfig.problems` and its server is
listed as failed with that sentence. Only a file that is not JSON at all, or has no ``mcpServers`` object,
is one error for the whole file (:class:`~localllm.errors.LocalLLMError`).

    >>> cfg = parse_config('{"mcpServers": {"t": {"command": "x"}, "bad": {"args": []}}}', "mcp.json")
    >>> sorted(cfg.servers), cfg.problems["bad"]
    (['t'], 'MCP server "bad" in mcp.json needs a "command" (stdio) or a "url" (streamable HTTP).')
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localllm.errors import LocalLLMError

DEFAULT_CALL_TIMEOUT = 60.0  # seconds a tool call may take before it counts as hung
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class ServerConfig:
    """One server: ``command`` (stdio) or ``url`` (streamable HTTP)."""

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    default: bool = False  # in every new chat / `run` without --mcp
    timeout: float = DEFAULT_CALL_TIMEOUT

    @property
    def transport(self) -> str:
        return "stdio" if self.command else "http"

    def describe(self) -> str:
        """``mcp-server-time --local-timezone UTC`` or the URL, for lists."""
        if self.command:
            return " ".join([self.command, *self.args])
        return self.url or ""


@dataclass
class McpConfig:
    """The servers of ``mcp.json`` (good entries) and one sentence per bad entry, by server name."""

    path: Path | None = None
    servers: dict[str, ServerConfig] = field(default_factory=dict)
    problems: dict[str, str] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        """Every entry, good or bad, in file order."""
        return list(dict.fromkeys([*self.servers, *self.problems]))

    def defaults(self) -> list[str]:
        return [n for n, s in self.servers.items() if s.default]


def config_path() -> Path:
    from localllm.config import paths

    return paths().config / "mcp.json"


def load_config(path: Path | None = None) -> McpConfig:
    """``mcp.json`` from the config dir (an empty config when there is none)."""
    path = path or config_path()
    if not path.is_file():
        return McpConfig(path=path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise LocalLLMError(f"Cannot read the MCP config {path}: {e.strerror or e}.") from None
    return parse_config(text, str(path), path=path)


def parse_config(text: str, where: str, *, path: Path | None = None) -> McpConfig:
    """Parse the text of an ``mcp.json`` (``where`` names it in the sentences)."""
    try:
        data = json.loads(text) if text.strip() else {}
    except ValueError as e:
        raise LocalLLMError(f"The MCP config {where} is not valid JSON: {e}.") from None
    if not isinstance(data, dict):
        raise LocalLLMError(f'The MCP config {where} must be a JSON object with "mcpServers" in it.')
    servers = data.get("mcpServers", {})
    if not isinstance(servers, dict):
        raise LocalLLMError(f'"mcpServers" in {where} must be an object of server name → settings.')
    cfg = McpConfig(path=path)
    for name, entry in servers.items():
        try:
            server = _server(str(name), entry, where)
        except LocalLLMError as e:
            cfg.problems[str(name)] = str(e)
            continue
        if server is not None:
            cfg.servers[server.name] = server
    return cfg


def _strings(value: Any, what: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str | int | float) for v in value.values()):
        raise LocalLLMError(f"{what} must be an object of names to strings.")
    return {str(k): str(v) for k, v in value.items()}


def _server(name: str, entry: Any, where: str) -> ServerConfig | None:
    who = f'MCP server "{name}" in {where}'
    if not _NAME.match(name):
        raise LocalLLMError(f"{who}: a server name is letters, digits, '_', '-' or '.', up to 64 characters.")
    if not isinstance(entry, dict):
        raise LocalLLMError(f"{who} must be an object with a \"command\" or a \"url\".")
    if entry.get("disabled") is True:
        return None
    command, url = entry.get("command"), entry.get("url")
    if command is not None and url is not None:
        raise LocalLLMError(f'{who} has both a "command" and a "url": give one.')
    if command is None and url is None:
        raise LocalLLMError(f'{who} needs a "command" (stdio) or a "url" (streamable HTTP).')
    timeout = entry.get("timeout", DEFAULT_CALL_TIMEOUT)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        raise LocalLLMError(f'{who}: "timeout" must be a positive number of seconds, got {timeout!r}.')
    default = entry.get("default", False)
    if not isinstance(default, bool):
        raise LocalLLMError(f'{who}: "default" must be true or false, got {default!r}.')
    if command is not None:
        if not isinstance(command, str) or not command.strip():
            raise LocalLLMError(f'{who}: "command" must be a program name or path, got {command!r}.')
        args = entry.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, str | int | float) for a in args):
            raise LocalLLMError(f'{who}: "args" must be a list of strings.')
        cwd = entry.get("cwd")
        if cwd is not None and (not isinstance(cwd, str) or not Path(cwd).expanduser().is_dir()):
            raise LocalLLMError(f'{who}: "cwd" {cwd!r} is not a directory.')
        return ServerConfig(name=name, command=command.strip(), args=tuple(str(a) for a in args),
                            env=_strings(entry.get("env"), f'{who}: "env"'),
                            cwd=str(Path(cwd).expanduser()) if cwd else None, default=default, timeout=float(timeout))
    if not isinstance(url, str) or not re.match(r"^https?://[^\s/]+", url):
        raise LocalLLMError(f'{who}: "url" must be an http:// or https:// address, got {url!r}.')
    return ServerConfig(name=name, url=url, headers=_strings(entry.get("headers"), f'{who}: "headers"'),
                        default=default, timeout=float(timeout))
