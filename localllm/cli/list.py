"""``localllm list``: installed models as ``ollama list`` prints them (NAME, ID, SIZE, MODIFIED), plus the
weight formats installed (GGUF for llama.cpp, MLX for Apple Silicon).

    $ localllm list
    NAME            ID              SIZE     FORMATS     MODIFIED
    smollm2:135m    b179c9523d0e    98 MB    GGUF+MLX    2 minutes ago

A model made with ``localllm create`` adds a FROM column: the model it was made from. An embedding or reranking
model adds a KIND column (``embedding``, ``rerank``; ``chat`` for the others).

Kept light: no rich, httpx or gguf import (the manifests carry everything shown).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

from localllm.cli.display import ago, format_table, human_size

if TYPE_CHECKING:
    from localllm.api import Installed


def as_json(m: Installed, remote: bool) -> dict[str, Any]:
    """One model of ``list --json``: the store's record in-process, name/digest/size for a server."""
    if remote:
        return {"name": m.name, "digest": m.digest, "size": m.size}
    return {"name": m.name, "digest": m.digest, "path": m.path, "size": m.size,
            "modified": m.modified.isoformat() if m.modified else None, "source": m.source, "local": m.local,
            "quant": m.quant, "catalog": m.catalog, "mlx_path": m.mlx_path, "formats": m.formats,
            "mlx_repo": m.mlx_repo, "mlx_revision": m.mlx_revision, "base": m.base,
            "projector": {"path": m.projector_path, "digest": m.projector_digest, "size": m.projector_size}
            if m.projector_path else None}


@click.command("list", help="List installed models.")
@click.option("--json", "json_out", is_flag=True, help="Machine-readable output.")
@click.option("--host", default=None, metavar="URL",
              help="Talk to a localllm or Ollama server there instead of in-process.")
def command(json_out: bool, host: str | None) -> None:
    """List installed models, newest first."""
    from localllm.session import open_models

    models = open_models(host)
    try:
        listed = models.list()
    finally:
        models.close()
    if json_out:
        click.echo(json.dumps([as_json(m, models.remote) for m in listed], indent=2))
        return
    # a server's list has no formats column (Ollama's has none)
    head = ["NAME", "ID", "SIZE", "MODIFIED"] if models.remote else ["NAME", "ID", "SIZE", "FORMATS", "MODIFIED"]
    derived = any(m.base for m in listed)  # a FROM column only when some model was made with `create`
    kinds = [m.kind for m in listed]  # a KIND column only when some model embeds or reranks
    rows = [head + (["KIND"] if any(kinds) else []) + (["FROM"] if derived else [])]
    for m, kind in zip(listed, kinds, strict=True):
        when = ago(m.modified) if m.modified else ""
        # a vision projector shows as "+mmproj" in-process; a server's list says "vision" in its capabilities
        formats = m.formats + (["mmproj"] if m.projector_path else [])
        cells = [m.name, m.short_id, human_size(m.size)] + ([] if models.remote else ["+".join(formats)])
        rows.append(cells + [when] + ([kind or "chat"] if any(kinds) else []) + ([m.base or ""] if derived else []))
    click.echo(format_table(rows))
