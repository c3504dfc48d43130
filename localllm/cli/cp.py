"""``localllm cp SRC DST``: give an installed model another name (the file is shared, not copied).

    $ localllm cp smollm2:135m mymodel
    copied 'smollm2:135m' to 'mymodel'
    $ localllm cp smollm2:135m mymodel
    Error: mymodel exists already; remove it first, or copy with --force to replace it.

A DST that is installed already is refused unless ``--force`` replaces it (Ollama's ``cp`` and ``/api/copy``
replace it silently; the REST route here still does, for its clients).
"""

from __future__ import annotations

import click


@click.command("cp", help="Copy a model to a new name.")
@click.argument("src")
@click.argument("dst")
@click.option("--force", "-f", is_flag=True, help="Replace DST if it is installed already.")
@click.option("--host", default=None, metavar="URL",
              help="Talk to a localllm or Ollama server there instead of in-process.")
def command(src: str, dst: str, force: bool, host: str | None) -> None:
    """Install DST as another name for SRC."""
    from localllm.session import open_models

    models = open_models(host)
    try:
        copied = models.copy(src, dst, force=force)
    finally:
        models.close()
    click.echo(f"copied '{src}' to '{copied}'")
