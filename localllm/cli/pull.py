"""``localllm pull NAME``: download a model (resumable, sha256-verified), like ``ollama pull``.

    $ localllm pull smollm2:135m
    $ localllm pull qwen2.5:7b-q8_0
    $ localllm pull hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M
    $ localllm pull llama3.2:1b --mlx      # also its MLX weights (the default on Apple Silicon)
    $ localllm pull mymodel:latest --mmproj ./mmproj-model-f16.gguf   # give it a vision projector
    $ localllm pull hf.co/ggml-org/gemma-3-4b-it-GGUF --mmproj mmproj-model-f32.gguf  # not the repo's F16 one

On a terminal the progress is a rich bar (bytes, speed, ETA) on stderr; otherwise plain lines.
Interrupting it keeps the partial download: the next pull resumes from there.
"""

from __future__ import annotations

import sys

import click

from localllm.cli.display import pull_with_progress


@click.command("pull", help="Download a model (resumable, sha256-verified).")
@click.argument("name")
@click.option("--quiet", "-q", is_flag=True, help="No progress output.")
@click.option("--mlx/--no-mlx", default=None,
              help="Also fetch the catalog's MLX weights (default: on Apple Silicon only).")
@click.option("--mmproj", default=None, metavar="PATH|FILE",
              help="Attach this projector file (mmproj GGUF) to the model: it then takes images and/or audio; for an "
                   "hf.co name, the repo's projector FILE to take instead of its F16 one.")
@click.option("--host", default=None, metavar="URL",
              help="Talk to a localllm or Ollama server there instead of in-process.")
def command(name: str, quiet: bool, mlx: bool | None, mmproj: str | None, host: str | None) -> None:
    """Download NAME: an alias (smollm2:135m, qwen2.5:7b-q8_0) or hf.co/user/repo[:QUANT]."""
    from localllm.names import parse_name
    from localllm.session import open_models

    parse_name(name, allow_path=False)  # a bad name is one sentence before anything is asked of a server
    models = open_models(host)
    try:
        from pathlib import Path

        # --mmproj: a local projector file to attach, or (hf.co names) the repo's projector file to take
        repo_file = mmproj if mmproj and name.startswith("hf.co/") and not Path(mmproj).is_file() else None
        if repo_file:
            model = models.pull(name, mlx=mlx, mmproj_file=repo_file) if quiet else pull_with_progress(
                models, name, mlx=mlx, mmproj_file=repo_file)
        else:
            have = None
            if mmproj:  # attaching a local projector to an installed model (a created one too): nothing to pull
                from localllm.errors import ModelNotFoundError

                try:
                    have = models.show(name)
                except ModelNotFoundError:
                    have = None
            model = have if have is not None else (
                models.pull(name, mlx=mlx) if quiet else pull_with_progress(models, name, mlx=mlx))
        if mmproj and not repo_file:
            model = models.set_projector(model.name, mmproj)
    except KeyboardInterrupt:
        click.echo("\nInterrupted; the partial download is kept and the next pull resumes it.", err=True)
        sys.exit(130)
    finally:
        models.close()
    if mmproj and not quiet:
        kinds = "+".join(c for c in ("vision", "audio") if c in model.capabilities) or "vision"
        click.echo(f"{kinds} projector: {model.projector_path} ({model.projector_size:,} bytes)")
    if models.remote:
        click.echo(f"success: {name} ({model.short_id})")
    elif not quiet:
        click.echo(f"success: {model.name} ({model.short_id}, {' + '.join(model.formats)})")
