"""MCP tools for the chat faces (the ``>>>`` REPL and the terminal app), in one place:

* :mod:`localllm.mcp.config` — ``mcp.json`` (Claude Desktop's format), one sentence per bad entry;
* :mod:`localllm.mcp.host` — the servers as clients of the official ``mcp`` SDK, on one event loop of their
  own in a background thread: lazy start, logs, tool lists, calls with a timeout, faults as one line, shutdown;
* :mod:`localllm.mcp.loop` — the tool loop without I/O: which tools go with a request, confirmation state,
  the messages that carry calls and results back to the model, the bound on rounds.

The SDK is imported only when a server starts, so a face that uses no tools pays nothing for it.
"""
