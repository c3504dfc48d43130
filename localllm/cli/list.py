"""``localllm list``: installed models as ``ollama list`` prints them (NAME, ID, SIZE, MODIFIED), plus the
weight formats installed (GGUF for llama.cpp, MLX for Apple Silicon).

    $ localllm list
    NAME            ID              SIZE     FORMATS     MODIFIED
    smollm2:135m    b179c9523d0e    98 MB    GGUF+MLX    2 minutes ago

A model made with ``localllm create`` adds a FROM column: the model it was made from. An embedding or reranking
model adds a KIND column (``embedding``, ``rerank``; ``chat`` for the others).

``--catalog`` lists the catalog instead, with each model's family, download size, capabilities, mixture of
experts (total-active parameters) and the fit verdict for this machine (``≈``: estimated from the size)::

    $ localllm list --catalog
    NAME              FAMILY    SIZE     CAPABILITIES            MOE        FIT          INSTALLED
    qwen3.6:35b-a3b   qwen3.6   22 GB    thinking,tools,vision   35b-a3b    ≈ CPU

Kept light: no rich, httpx or gguf import (the manifests carry everything shown).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

from localllm.cli.display import ago, format_table, human_size

if TYPE_CHECKING:
    from localllm.api import CatalogItem, Installed


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


def catalog_json(c: CatalogItem) -> dict[str, Any]:
    """One entry of ``list --catalog --json``."""
    return {"name": c.name, "family": c.family, "params": c.params, "size": c.size,
            "capabilities": c.capabilities, "think_levels": c.think_levels, "moe": c.moe or None,
            "mtp": c.mtp or None, "split_parts": c.split_parts, "draft": c.draft, "installed": c.installed,
            "fit": {"verdict": c.fit.verdict, "text": c.fit.text, "estimated": c.fit.estimated},
            "description": c.description}


def list_catalog(json_out: bool, host: str | None) -> None:
    """The catalog with this machine's fit verdicts (in-process only: the verdict is about this machine)."""
    if host:
        raise click.ClickException("list --catalog runs in-process (the fit verdict is this machine's); drop --host.")
    from localllm.engine import Engine
    from localllm.local import LocalAdvisor

    items = LocalAdvisor(Engine()).catalog()
    if json_out:
        click.echo(json.dumps([catalog_json(c) for c in items], indent=2, ensure_ascii=False))
        return
    rows = [["NAME", "FAMILY", "SIZE", "CAPABILITIES", "MOE", "FIT", "INSTALLED"]]
    for c in items:
        rows.append([c.name, c.family, human_size(c.size), c.capability_text() or "-", c.moe or "-", c.fit.text,
                     "yes" if c.installed else ""])
    click.echo(format_table(rows))


@click.command("list", help="List installed models (--catalog: the catalog, with fit verdicts for this machine).")
@click.option("--json", "json_out", is_flag=True, help="Machine-readable output.")
@click.option("--catalog", "catalog", is_flag=True,
              help="List the catalog: family, size, capabilities, experts and whether each fits this machine.")
@click.option("--host", default=None, metavar="URL",
              help="Talk to a localllm or Ollama server there instead of in-process.")
def command(json_out: bool, catalog: bool, host: str | None) -> None:
    """List installed models, newest first."""
    from localllm.session import open_models

    if catalog:
        list_catalog(json_out, host)
        return

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
        # a projector shows as "+mmproj" in-process ("+mmproj(audio)" with an audio encoder); a server's list says
        # "vision" / "audio" in its capabilities
        media = [c for c in ("vision", "audio") if c in m.capabilities]
        tag = "mmproj" if media == ["vision"] else f"mmproj({'+'.join(media)})"
        formats = m.formats + ([tag] if m.projector_path else [])
        cells = [m.name, m.short_id, human_size(m.size)] + ([] if models.remote else ["+".join(formats)])
        rows.append(cells + [when] + ([kind or "chat"] if any(kinds) else []) + ([m.base or ""] if derived else []))
    click.echo(format_table(rows))
