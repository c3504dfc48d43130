"""``localllm quantize SRC TYPE [DST]``: the short form of ``create --quantize`` (no Modelfile).

    $ localllm quantize ./model-f16.gguf q4_K_M mymodel        # a local F16/F32 GGUF, installed as mymodel
    $ localllm quantize mymodel-f32 q8_0                        # installed as mymodel-f32-q8_0

The source's F32/F16/BF16 weights go through llama.cpp's quantizer (the one ``llama-quantize`` runs) into a new
blob, renamed into the store only when whole; what the source model adds (system prompt, parameters) carries
over. Progress goes to stderr: a bar on a terminal (the output's bytes against the size llama.cpp plans for it),
plain percentage lines when piped; the last line (stdout) gives the new model's type and size.
"""

from __future__ import annotations

import sys

import click


@click.command("quantize", help="Quantize an F32/F16 model (q4_K_M, q8_0, ...).")
@click.argument("src")
@click.argument("type_name", metavar="TYPE")
@click.argument("dst", required=False)
@click.option("--requantize", is_flag=True, help="Allow a source that is already quantized (costs quality).")
@click.option("--host", default=None, metavar="URL",
              help="Talk to a localllm or Ollama server there instead of in-process.")
def command(src: str, type_name: str, dst: str | None, requantize: bool, host: str | None) -> None:
    """Quantize SRC (an installed model or a local .gguf) to TYPE, installed as DST (default: SRC-type).

    \b
    Examples:
      localllm quantize ./model-f16.gguf q4_K_M mymodel
      localllm quantize mymodel-f32 q8_0
    """
    from pathlib import Path

    from localllm.cli.display import human_size, make_progress
    from localllm.modelfile import Modelfile
    from localllm.names import parse_name
    from localllm.session import open_models

    ref = parse_name(src, allow_path=True)
    if ref.kind == "path":
        src = str(Path(src).expanduser().resolve())
        dst = dst or Path(src).stem.lower().replace(".", "-") + f"-{type_name.lower()}"
    else:
        dst = dst or f"{ref.name}-{type_name.lower()}"
    parse_name(dst, allow_path=False)
    bar = make_progress(sys.stderr)  # a bar on a terminal, plain percentage lines when piped
    models = open_models(host)
    try:
        made = models.create(dst, Modelfile(from_=src), progress=bar, quantize=type_name, requantize=requantize)
    finally:
        models.close()
        bar.close()
    click.echo(f"created '{made.name}' ({made.quantization or type_name.upper()}, {human_size(made.size)})")
