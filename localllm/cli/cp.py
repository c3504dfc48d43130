"""``localllm cp SRC DST``: give an installed model another name (the file is shared, not copied).

    $ localllm cp smollm2:135m mymodel
    copied 'smollm2:135m' to 'mymodel'
"""

from __future__ import annotations

import click


@click.command("cp", help="Copy a model to a new name.")
@click.argument("src")
@click.argument("dst")
@click.option("--host", default=None, metavar="URL",
              help="Talk to a localllm or Ollama server there instead of in-process.")
def command(src: str, dst: str, host: str | None) -> None:
    """Install DST as another name for SRC."""
    from localllm.session import open_models

    models = open_models(host)
    try:
        copied = models.copy(src, dst)
    finally:
        models.close()
    click.echo(f"copied '{src}' to '{copied}'")
