"""``localllm ps``: the models a server holds in memory, as ``ollama ps`` prints them.

    $ localllm ps
    NAME            ID              SIZE      PROCESSOR    CONTEXT    SLOTS    PROMPT CACHE    UNTIL
    smollm2:135m    b179c9523d0e    474 MB    100% CPU     4096       1/4      2 (97 MB)       4 minutes from now

SLOTS: requests decoding now / requests that can decode together. PROMPT CACHE: saved prompt prefixes
on disk for the model (restored by a later process instead of evaluated again).

Models live in a server (``localllm serve``); ``localllm run`` loads them only for its own run, so
without a server nothing is loaded.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from localllm.api import Loaded


@click.command("ps")
@click.option("--host", default=None, metavar="URL", help="Server to ask (default: LOCALLLM_HOST or 127.0.0.1:11434).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def command(host: str | None, as_json: bool) -> None:
    """List loaded models."""
    from localllm.cli.display import format_table, human_size
    from localllm.client import Client, connect

    client = connect(host) or Client()
    if not client.is_running(timeout=1.0):
        click.echo(f"No server is running at {client.url}, so no model is loaded "
                   "(start one with `localllm serve`).", err=True)
        if as_json:
            click.echo("[]")
        return
    models = client.ps()
    if as_json:
        click.echo(json.dumps([{"name": m.name, "id": m.short_id, "size": m.size, "size_vram": m.size_vram,
                                "processor": m.processor, "context": m.context_length,
                                "slots": m.slots, "slots_busy": m.slots_busy, "batched": m.batched,
                                "drafting": m.drafting,
                                "prompt_cache": {"entries": m.prompt_cache_entries, "bytes": m.prompt_cache_bytes},
                                "expires_at": m.expires_at.isoformat() if m.expires_at else None,
                                "until": m.until, "n_cpu_moe": m.n_cpu_moe,
                                "devices": [{"name": d.name, "description": d.description, "size": d.size,
                                             "estimate": d.estimate} for d in m.devices]} for m in models],
                               indent=2))
        return
    rows = [("NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "SLOTS", "PROMPT CACHE", "UNTIL")]

    def slots(m: Loaded) -> str:
        if not m.slots:
            return "-"
        return f"{m.slots_busy}/{m.slots}" + ("" if m.batched or m.slots < 2 else " (taking turns)")

    rows += [(m.name, m.short_id, human_size(m.size), m.processor, str(m.context_length), slots(m),
              f"{m.prompt_cache_entries} ({human_size(m.prompt_cache_bytes)})" if m.prompt_cache_entries else "-",
              m.until) for m in models]
    click.echo(format_table(rows))
    for m in models:  # speculative decoding: the draft, and whether it drafts now (or why not)
        if m.drafting:
            click.echo(f"{m.name} drafting: {m.drafting}")
    for m in models:  # several llama.cpp devices: what each holds (allocated, and the planner's estimate)
        if m.devices:
            click.echo(f"{m.name} on " + ", ".join(
                f"{d.name}" + (f" ({d.description})" if d.description else "") + f" {human_size(d.size)}"
                + (f" (estimated {human_size(d.estimate)})" if d.estimate else "") for d in m.devices))
        if m.n_cpu_moe:  # a mixture of experts placed across the device and RAM
            where = m.experts_placement
            click.echo(f"{m.name}: {where}" if "offloaded" in where else
                       f"{m.name}: experts of the first {m.n_cpu_moe} layers in RAM, the rest of the model on the "
                       "device")
