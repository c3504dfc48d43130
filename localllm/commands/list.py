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

import click


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


@click.command("list", help="List installed models.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--host", default=None, metavar="URL",
              help="Talk to a localllm or Ollama server there instead of in-process.")
def command(as_json: bool, host: str | None) -> None:
    """List installed models, newest first."""
    import os

    if host or os.environ.get("LOCALLLM_HOST", "").strip():
        from localllm.client import connect

        client = connect(host)
        if client is not None:
            with client:
                remote = client.list()
            if as_json:
                click.echo(json.dumps([{"name": m.name, "digest": m.digest, "size": m.size} for m in remote], indent=2))
                return
            rows = [["NAME", "ID", "SIZE", "MODIFIED"]]
            rows += [[m.name, m.short_id, human_size(m.size), ago(m.modified) if m.modified else ""] for m in remote]
            click.echo(format_table(rows))
            return
    from localllm.store import Store

    models = Store().list()
    if as_json:
        click.echo(json.dumps([{k: v for k, v in m.as_dict().items() if k != "info"} for m in models], indent=2))
        return
    rows = [["NAME", "ID", "SIZE", "FORMATS", "MODIFIED"]]
    rows += [[m.name, m.short_id, human_size(m.size), "+".join(m.formats), ago(m.modified)] for m in models]
    click.echo(format_table(rows))
