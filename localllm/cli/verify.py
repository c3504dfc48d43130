"""``localllm verify [MODEL...]``: hash every file of the installed models again (all of them, or those named) and
say which are damaged; exit 1 when one is.

    $ localllm verify
    ok       smollm2:135m
    Error: qwen2.5:0.5b: its weights file /.../blobs/sha256-7f2a... is corrupt: its bytes no longer hash to
    sha256:7f2a5d6e0c1b...; run `localllm pull qwen2.5:0.5b` to fetch it again.

A file several names share is read once. Local ``.gguf`` files used in place have no recorded digest (nothing to
verify). In-process only: the files are this machine's.
"""

from __future__ import annotations

import click


@click.command("verify", help="Check installed models' files against their sha256 digests.")
@click.argument("names", nargs=-1)
@click.pass_context
def command(ctx: click.Context, names: tuple[str, ...]) -> None:
    """Hash the files of NAMES (default: every installed model) again."""
    from pathlib import Path

    from localllm.errors import LocalLLMError
    from localllm.store import Store

    store = Store()
    todo = list(names) or store.installed_names()
    if not todo:
        click.echo("no models installed")
        return
    hashed: dict[Path, str] = {}
    failed = False
    for name in todo:
        try:
            checks = store.verify(name, hashed=hashed)
        except LocalLLMError as e:
            click.echo(f"Error: {e}", err=True)
            failed = True
            continue
        bad = [c for c in checks if not c.ok]
        for c in bad:
            click.echo(f"Error: {c.sentence()}", err=True)
        if bad:
            failed = True
        else:
            click.echo(f"ok       {checks[0].model if checks else name}")
    if failed:
        ctx.exit(1)
