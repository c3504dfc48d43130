"""``localllm list``: installed models as ``ollama list`` prints them (NAME, ID, SIZE, MODIFIED), plus the
weight formats installed (GGUF for llama.cpp, MLX for Apple Silicon).

    $ localllm list
    NAME            ID              SIZE     FORMATS     MODIFIED
    smollm2:135m    b179c9523d0e    98 MB    GGUF+MLX    2 minutes ago

Kept light: no rich, httpx or gguf import (the manifests carry everything shown).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from localllm.api import Installed


def human_size(n: int) -> str:
    """Decimal units as Ollama prints them: ``human_size(98362432) == '98 MB'``."""
    value = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            if unit == "B":
                return f"{n} B"
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
        value /= 1000
    raise AssertionError  # pragma: no cover


def ago(when: datetime, now: datetime | None = None) -> str:
    """Ollama-style relative time.

    >>> from datetime import timedelta
    >>> t = datetime(2025, 1, 1, tzinfo=UTC)
    >>> ago(t, t), ago(t, t + timedelta(seconds=70)), ago(t, t + timedelta(hours=3)), ago(t, t + timedelta(days=40))
    ('Less than a second ago', 'About a minute ago', '3 hours ago', '5 weeks ago')
    """
    now = now or datetime.now(UTC)
    s = max((now - when).total_seconds(), 0)
    if s < 1:
        return "Less than a second ago"
    steps = [(60, "second", 1), (3600, "minute", 60), (86400, "hour", 3600), (86400 * 14, "day", 86400),
             (86400 * 60, "week", 86400 * 7), (86400 * 730, "month", 86400 * 30)]
    for limit, unit, div in steps:
        if s < limit:
            n = int(s // div)
            if n == 1:
                return f"About a{'n' if unit == 'hour' else ''} {unit} ago"
            return f"{n} {unit}s ago"
    return f"{int(s // (86400 * 365))} years ago"


def format_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["    ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def as_json(m: Installed, remote: bool) -> dict[str, Any]:
    """One model of ``list --json``: the store's record in-process, name/digest/size for a server."""
    if remote:
        return {"name": m.name, "digest": m.digest, "size": m.size}
    return {"name": m.name, "digest": m.digest, "path": m.path, "size": m.size,
            "modified": m.modified.isoformat() if m.modified else None, "source": m.source, "local": m.local,
            "quant": m.quant, "catalog": m.catalog, "mlx_path": m.mlx_path, "formats": m.formats,
            "mlx_repo": m.mlx_repo, "mlx_revision": m.mlx_revision}


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
    rows = [head]
    for m in listed:
        when = ago(m.modified) if m.modified else ""
        cells = [m.name, m.short_id, human_size(m.size)] + ([] if models.remote else ["+".join(m.formats)])
        rows.append(cells + [when])
    click.echo(format_table(rows))
