"""``localllm rm NAME...``: remove models; a file no other name uses is deleted.

    $ localllm rm smollm2:135m
    deleted 'smollm2:135m'

Every name is tried; the exit code is 1 if any of them failed.
"""

from __future__ import annotations

import click


@click.command("rm", help="Remove models.")
@click.argument("names", nargs=-1, required=True)
@click.option("--host", default=None, metavar="URL",
              help="Talk to a localllm or Ollama server there instead of in-process.")
@click.pass_context
def command(ctx: click.Context, names: tuple[str, ...], host: str | None) -> None:
    """Remove NAMES (local files given by path are never deleted)."""
    from localllm.errors import LocalLLMError
    from localllm.session import open_models

    models = open_models(host)
    failed = False
    try:
        for name in names:
            try:
                removed = models.remove(name)
            except LocalLLMError as e:
                click.echo(f"Error: {e}", err=True)
                failed = True
            else:
                click.echo(f"deleted '{removed}'")
    finally:
        models.close()
    if failed:
        ctx.exit(1)
