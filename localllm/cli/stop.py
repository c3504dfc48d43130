"""``localllm stop MODEL``: unload a model from the server now (``keep_alive: 0``), as ``ollama stop``.

    $ localllm stop smollm2:135m
"""

from __future__ import annotations

import click


@click.command("stop")
@click.argument("model")
@click.option("--host", default=None, metavar="URL", help="Server (default: LOCALLLM_HOST or 127.0.0.1:11434).")
def command(model: str, host: str | None) -> None:
    """Unload a running model."""
    from localllm.client import Client, connect
    from localllm.errors import LocalLLMError
    from localllm.names import parse_name

    name = parse_name(model, allow_path=False).name
    client = connect(host) or Client()
    if not client.is_running(timeout=1.0):
        raise LocalLLMError(f"No server is running at {client.url}, so {name} is not loaded.")
    if not client.unload(name):
        raise LocalLLMError(f"{name} is not running (see `localllm ps`).")
