"""``localllm show NAME``: a model's details, like ``ollama show``.

    $ localllm show smollm2:135m
    $ localllm show ./model.gguf --template      # a local file is read in place
    $ localllm show smollm2:135m --json
    $ localllm show terse --modelfile          # a Modelfile that recreates it (`localllm create`)

Shows architecture, parameters, context length, quantization, the chat template (first lines unless
``--template``), capabilities (completion, tools, thinking), license, and where the file is. With
``--host`` the server's ``/api/show`` answers (no file section but the digest).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from localllm.api import Installed

TEMPLATE_LINES = 6


def details(m: Installed) -> dict[str, Any]:
    """What ``show --json`` prints: the model's facts in one flat dict."""
    return {
        "name": m.name,
        "architecture": m.architecture or None,
        "parameters": m.parameters,
        "parameters_label": m.parameter_label or None,
        "context_length": m.context_length or None,
        "embedding_length": m.embedding_length or None,
        "layers": m.n_layers or None,
        "vocab_size": m.vocab_size or None,
        "quantization": m.quantization or None,
        "chat_template": m.chat_template,
        "license": m.license,
        "capabilities": m.capabilities,
        "mtp_layers": m.mtp_layers,
        "path": m.path,
        "digest": m.digest,
        "weights_digest": m.weights_digest,
        "size": m.size,
        "source": m.source,
        "local": m.local,
        "draft": m.draft,
        "mlx_path": m.mlx_path,
        "formats": m.formats,
        "mlx_source": m.mlx_source,
        "template_note": m.template_note,
        "base": m.base,
        "system": m.system,
        "modelfile": m.modelfile,
        "projector": {"path": m.projector_path, "digest": m.projector_digest, "size": m.projector_size}
        if m.projector_path else None,
    }


def render(d: dict[str, Any], full_template: bool) -> str:
    from localllm.cli.display import human_size
    from localllm.ggufinfo import MTP_HEAD_ARCH

    out = ["  Model"]
    rows = [("architecture", d["architecture"]), ("parameters", d["parameters_label"]),
            ("context length", d["context_length"]), ("embedding length", d["embedding_length"]),
            ("quantization", d["quantization"])]
    out += [f"    {k:<20}{v}" for k, v in rows if v is not None]
    if d.get("mtp_layers"):  # multi-token prediction: llama.cpp's --spec-type draft-mtp reads these
        out.append(f"    {'MTP layers':<20}{d['mtp_layers']} (self-speculation: drafted from by default on llama.cpp; "
                   "--draft none: off)")
    if d["architecture"] == MTP_HEAD_ARCH:
        out.append(f"    {'MTP head':<20}a drafter for its model's multi-token prediction, not a chat model")
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
    if d.get("system"):
        out += ["", "  System"] + ["    " + line for line in d["system"].splitlines()]
    if d.get("base"):
        out += ["", "  Made from", f"    {d['base']}"]
    if d["capabilities"]:
        out += ["", "  Capabilities"] + [f"    {c}" for c in d["capabilities"]]
    out += ["", "  License", f"    {d['license'] or 'unknown'}"]
    if d["path"]:  # in-process: the file itself
        out += ["", "  File", f"    {'path':<20}{d['path']}", f"    {'size':<20}{human_size(d['size'])}",
                f"    {'digest':<20}{d['weights_digest'] or d['digest']}", f"    {'source':<20}{d['source']}"]
        if d["weights_digest"] and d["weights_digest"] != d["digest"]:  # a created model: its own, over the file's
            out.append(f"    {'model digest':<20}{d['digest']}")
        out.append(f"    {'formats':<20}{', '.join(d['formats'])}")
    elif d["digest"]:
        out += ["", "  File", f"    {'size':<20}{human_size(d['size'])}", f"    {'digest':<20}{d['digest']}"]
    if d["draft"]:
        out.append(f"    {'suggested draft':<20}{d['draft']}")
    if d["projector"]:
        p = d["projector"]
        kinds = ", ".join(c for c in ("vision", "audio") if c in d["capabilities"]) or "vision"
        out += ["", f"  Projector ({kinds})", f"    {'path':<20}{p['path']}",
                f"    {'size':<20}{human_size(p['size'])}", f"    {'digest':<20}{p['digest']}"]
    if d["mlx_path"]:
        out += ["", "  MLX", f"    {'path':<20}{d['mlx_path']}", f"    {'source':<20}{d['mlx_source']}"]
    return "\n".join(out)


@click.command("show", help="Show a model's details.")
@click.argument("name")
@click.option("--template", "full_template", is_flag=True, help="Print the whole chat template.")
@click.option("--modelfile", "modelfile", is_flag=True, help="Print a Modelfile that recreates the model.")
@click.option("--system", "system", is_flag=True, help="Print the model's system prompt (a created model's).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--host", default=None, metavar="URL",
              help="Talk to a localllm or Ollama server there instead of in-process.")
def command(name: str, full_template: bool, modelfile: bool, system: bool, as_json: bool, host: str | None) -> None:
    """Show NAME: an installed model or a local .gguf file."""
    from localllm.session import open_models

    models = open_models(host)
    try:
        d = details(models.show(name))
    finally:
        models.close()
    if modelfile:
        click.echo(d["modelfile"] or f"FROM {d['name']}", nl=not (d["modelfile"] or "").endswith("\n"))
    elif system:
        click.echo(d["system"] or "")
    elif as_json:
        click.echo(json.dumps(d, indent=2))
    else:
        click.echo(render(d, full_template))
