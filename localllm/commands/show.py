"""``localllm show NAME``: a model's details, like ``ollama show``.

    $ localllm show smollm2:135m
    $ localllm show ./model.gguf --template      # a local file is read in place
    $ localllm show smollm2:135m --json

Shows architecture, parameters, context length, quantization, the chat template (first lines unless
``--template``), license, and where the file is.
"""

from __future__ import annotations

import json
from typing import Any

import click

TEMPLATE_LINES = 6


def _license(m: Any) -> str | None:
    lic = m.info.get("license")
    if not lic and m.catalog is not None:
        lic = m.catalog.license
    return lic


def details(m: Any) -> dict[str, Any]:
    """What ``show --json`` prints: the model's facts in one flat dict."""
    info = m.info
    params = int(info.get("parameters") or 0)
    return {
        "name": m.name,
        "architecture": info.get("architecture"),
        "parameters": params,
        "parameters_label": f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.1f}M",
        "context_length": info.get("context_length"),
        "embedding_length": info.get("n_embd"),
        "layers": info.get("n_layers"),
        "vocab_size": info.get("vocab_size"),
        "quantization": info.get("file_type"),
        "chat_template": info.get("chat_template"),
        "license": _license(m),
        "path": str(m.path),
        "digest": m.digest,
        "size": m.size,
        "source": m.source,
        "local": m.local,
        "draft": m.catalog.draft if m.catalog else None,
        "mlx_path": str(m.mlx_path) if m.mlx_path else None,
        "formats": list(getattr(m, "formats", ["GGUF"])),
        "mlx_source": getattr(m, "mlx_source", None),
        "template_note": m.catalog.template_note if m.catalog else None,
    }


def render(d: dict[str, Any], full_template: bool) -> str:
    from localllm.commands.list import human_size

    out = ["  Model"]
    rows = [("architecture", d["architecture"]), ("parameters", d["parameters_label"]),
            ("context length", d["context_length"]), ("embedding length", d["embedding_length"]),
            ("quantization", d["quantization"])]
    out += [f"    {k:<20}{v}" for k, v in rows if v is not None]
    out += ["", "  Chat template"]
    tpl = d["chat_template"]
    if not tpl:
        out.append("    (none: a base model; chat gives nothing useful, use raw completion)")
    else:
        lines = tpl.splitlines()
        shown = lines if full_template else lines[:TEMPLATE_LINES]
        out += ["    " + line for line in shown]
        if len(shown) < len(lines):
            out.append(f"    … {len(lines) - len(shown)} more lines (--template shows all)")
    out += ["", "  License", f"    {d['license'] or 'unknown'}"]
    out += ["", "  File", f"    {'path':<20}{d['path']}", f"    {'size':<20}{human_size(d['size'])}",
            f"    {'digest':<20}{d['digest']}", f"    {'source':<20}{d['source']}"]
    out.append(f"    {'formats':<20}{', '.join(d['formats'])}")
    if d["draft"]:
        out.append(f"    {'suggested draft':<20}{d['draft']}")
    if d["mlx_path"]:
        out += ["", "  MLX", f"    {'path':<20}{d['mlx_path']}", f"    {'source':<20}{d['mlx_source']}"]
    return "\n".join(out)


@click.command("show", help="Show a model's details.")
@click.argument("name")
@click.option("--template", "full_template", is_flag=True, help="Print the whole chat template.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def command(name: str, full_template: bool, as_json: bool) -> None:
    """Show NAME: an installed model or a local .gguf file."""
    from localllm.store import Store

    m = Store().get(name)
    d = details(m)
    if as_json:
        click.echo(json.dumps(d, indent=2))
    else:
        click.echo(render(d, full_template))
