"""``localllm chat [MODEL] [--host URL]``: the terminal app (chat + model manager + hardware view)."""

from __future__ import annotations

import click


@click.command("chat")
@click.argument("model", required=False)
@click.option("--host", default=None, metavar="URL",
              help="Talk to a localllm or Ollama server at URL instead of running models in-process.")
def command(model: str | None, host: str | None) -> None:
    """Open the terminal app: chat with streaming answers and saved history, pull and delete models,
    see what this machine can run.

    \b
    Keys: Enter sends, Ctrl+J adds a newline, Esc stops an answer, F1 lists every key,
    F2 chat, F3 models, F4 hardware, Ctrl+P the command palette, Ctrl+Q quits.
    Remap keys in the config file's [keymap] table (ids are listed by F1).
    """
    from localllm.tui.app import run

    run(model=model, host=host)  # with --host, an unreachable server is one sentence before the app opens
