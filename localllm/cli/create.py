"""``localllm create NAME -f Modelfile``: a model of one's own from a Modelfile, like ``ollama create``.

    $ cat Modelfile
    FROM smollm2:135m
    SYSTEM You answer in one short sentence.
    PARAMETER temperature 0
    PARAMETER stop "<|im_end|>"
    MESSAGE user Is Paris in France?
    MESSAGE assistant Yes.
    $ localllm create terse -f Modelfile
    $ echo 'FROM ./my-model.f16.gguf' | localllm create mine -f -
    $ localllm show terse --modelfile      # the Modelfile that recreates it
    $ echo 'FROM ./my-model.f16.gguf' | localllm create mine -f - --quantize q4_K_M

The new model stores only what it adds (parameters, system prompt, template, messages) and shares its base's
weights; ``rm`` of the base keeps them while a derived model uses them. A relative ``FROM`` or ``ADAPTER`` path
is read from the Modelfile's directory (from the current one with ``-f -``). ``ADAPTER PATH [SCALE]`` applies a
LoRA GGUF (checked against the base's tensor shapes here, not at the first run); ``PROJECTOR PATH`` gives the
model its vision or audio projector (``mmproj`` GGUF; with ``--host`` it is uploaded as a blob first). Status
lines go to stderr, as Ollama's do; ``--quantize`` shows a progress bar there on a terminal (plain percentage
lines when piped), and the last line gives the new model's type and size.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click


@click.command("create", help="Create a model from a Modelfile.")
@click.argument("name")
@click.option("-f", "--file", "file", default="Modelfile", metavar="PATH",
              help="The Modelfile ('-' reads it from stdin; default: ./Modelfile).")
@click.option("--quantize", "-q", "quantize", default=None, metavar="TYPE",
              help="Quantize the FROM model's F32/F16 weights to TYPE (q4_K_M, q5_K_M, q8_0, ...: llama.cpp's "
                   "types) and make those the new model's own.")
@click.option("--requantize", is_flag=True,
              help="With --quantize: allow a FROM model that is already quantized (costs quality).")
@click.option("--quiet", is_flag=True, help="No status lines.")
@click.option("--host", default=None, metavar="URL",
              help="Talk to a localllm or Ollama server there instead of in-process.")
def command(name: str, file: str, quantize: str | None, requantize: bool, quiet: bool, host: str | None) -> None:
    """Create NAME from the Modelfile FILE.

    \b
    Examples:
      localllm create terse -f Modelfile
      echo 'FROM ./model-f16.gguf' | localllm create mine -f - --quantize q4_K_M
      echo 'FROM smollm2:135m
      SYSTEM Answer like a pirate.' | localllm create pirate -f -
    """
    from localllm.cli.display import human_size, make_progress
    from localllm.errors import LocalLLMError
    from localllm.modelfile import parse
    from localllm.names import parse_name
    from localllm.session import open_models
    from localllm.store import PullProgress

    parse_name(name, allow_path=False)
    if file == "-":
        text, where = sys.stdin.read(), Path.cwd()
    else:
        path = Path(file).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise LocalLLMError(f"There is no Modelfile at {file}; give one with -f PATH (or -f - for stdin)."
                                ) from None
        except (OSError, UnicodeDecodeError) as e:
            raise LocalLLMError(f"Could not read the Modelfile {file}: {e}.") from None
        where = path.resolve().parent
    mf = parse(text)
    if parse_name(mf.from_, allow_path=True).kind == "path":
        src = Path(mf.from_).expanduser()
        mf.from_ = str(src if src.is_absolute() else where / src)
    from localllm.modelfile import split_adapter

    for i, a in enumerate(mf.adapters):  # a relative ADAPTER path is the Modelfile's directory's too
        apath, scale = split_adapter(a)
        if not apath.startswith("sha256") and not Path(apath).expanduser().is_absolute():
            mf.adapters[i] = f"{where / apath} {scale:g}"
    if mf.projector and not mf.projector.startswith("sha256") and not Path(mf.projector).expanduser().is_absolute():
        mf.projector = str(where / mf.projector)  # PROJECTOR: relative to the Modelfile's directory too

    last = [""]
    bar = None if quiet else make_progress(sys.stderr)  # a bar on a terminal (quantizing), else plain lines

    def progress(p: PullProgress) -> None:
        last[0] = p.status
        if bar is not None:
            bar(p)

    models = open_models(host)
    try:
        made = models.create(name, mf, progress=progress, quantize=quantize, requantize=requantize)
    finally:
        models.close()
        if bar is not None:
            bar.close()
    if not quiet and last[0] != "success":
        click.echo("success", err=True)
    size = f" ({made.quantization or quantize.upper()}, {human_size(made.size)})" if quantize else ""
    if not models.remote and made.base:
        click.echo(f"created '{made.name}' from '{made.base}'{size}")
    else:
        click.echo(f"created '{made.name}'{size}")
