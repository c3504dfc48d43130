"""``localllm cp SRC DST``: give an installed model another name (the file is shared, not copied).

    $ localllm cp smollm2:135m mymodel
    copied 'smollm2:135m' to 'mymodel'
"""

from __future__ import annotations

import click


@click.command("cp", help="Copy a model to a new name.")
@click.argument("src")
@click.argument("dst")
def command(src: str, dst: str) -> None:
    """Install DST as another name for SRC."""
    from localllm.store import Store

    m = Store().copy(src, dst)
    click.echo(f"copied '{src}' to '{m.name}'")
