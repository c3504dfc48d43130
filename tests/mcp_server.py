"""A small MCP server written with the official SDK, for the tool-loop tests: ``python tests/mcp_server.py``
serves stdio; ``--http PORT`` serves streamable HTTP at ``http://127.0.0.1:PORT/mcp``; ``--malformed`` lists a
tool whose input schema is not valid JSON Schema.

Every call of ``record`` appends its arguments as one JSON line to ``$MCP_RECORD`` (so a test sees what arrived
at the server), and returns ``recorded: TEXT`` plus ``$MCP_SECRET``. ``nap`` sleeps (a hung tool), ``die``
ends the process mid-call, ``boom`` raises (a tool error), ``big`` returns N characters (a huge result), and
``pid`` returns the server's process id (the tests check that it is gone after the app exits). ``--only NAME``
lists that tool alone (so a grammar-forced call of a real model can only pick it); ``wait`` sleeps a minute
and takes no arguments (a tool to interrupt)."""

from __future__ import annotations

import json
import os
import sys
import time

from mcp.server import MCPServer


class Malformed(MCPServer):
    async def list_tools(self):  # type: ignore[no-untyped-def]
        tools = await super().list_tools()
        for t in tools:
            if t.name == "record":
                t.input_schema = {"type": "object", "properties": 5}
        return tools


def build(malformed: bool = False, only: str | None = None) -> MCPServer:
    mcp = (Malformed if malformed else MCPServer)("recorder")

    @mcp.tool()
    def record(text: str) -> str:
        """Record a text and return it with the secret."""
        path = os.environ.get("MCP_RECORD")
        if path:
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"tool": "record", "arguments": {"text": text}}) + "\n")
        return f"recorded: {text} {os.environ.get('MCP_SECRET', '')}".strip()

    @mcp.tool()
    def nap(seconds: float) -> str:
        """Sleep for a number of seconds."""
        time.sleep(seconds)
        return "woke up"

    @mcp.tool()
    def die() -> str:
        """End the server process in the middle of the call."""
        os._exit(3)

    @mcp.tool()
    def boom() -> str:
        """Fail."""
        raise ValueError("the boom tool always fails")

    @mcp.tool()
    def big(n: int) -> str:
        """Return n characters."""
        return "x" * n

    @mcp.tool()
    def pid() -> str:
        """The server's process id."""
        return str(os.getpid())

    @mcp.tool()
    def wait() -> str:
        """Wait a minute."""
        time.sleep(60)
        return "waited"

    if only:
        for name in ("record", "nap", "die", "boom", "big", "pid", "wait"):
            if name != only:
                mcp.remove_tool(name)
    return mcp


if __name__ == "__main__":
    args = sys.argv[1:]
    server = build(malformed="--malformed" in args, only=args[args.index("--only") + 1] if "--only" in args else None)
    print(f"recorder MCP server {os.getpid()} starting", file=sys.stderr, flush=True)
    if "--http" in args:
        import anyio

        port = int(args[args.index("--http") + 1])
        anyio.run(lambda: server.run_streamable_http_async(host="127.0.0.1", port=port))
    else:
        server.run()
