"""``localllm convert MODEL``: build the MLX version of an installed GGUF model, offline.

A GGUF of an architecture the converter knows becomes an MLX model directory; Q4_0/Q4_1/Q8_0 weights stay
quantized as they are, other quant types are requantized, nothing is downloaded. Afterwards the planner
can pick MLX for that model (``--backend mlx`` forces it). ``--backend mlx`` also converts by itself on
first use; this command does it ahead of time (or again, with ``--force``).

    $ localllm convert smollm2:135m
    /home/me/.local/share/localllm/models/mlx/b179c9523d0e...
    $ localllm run smollm2:135m --backend mlx "Hello"

The conversion shows on stderr as every command shows one (:class:`localllm.cli.display.ConversionDisplay`).
"""

from __future__ import annotations

import time

import click

from localllm.cli.display import ConversionDisplay
from localllm.errors import LocalLLMError


@click.command("convert")
@click.argument("model")
@click.option("--force", is_flag=True, help="Rebuild even if the MLX directory already exists.")
@click.option(
    "--dtype",
    type=click.Choice(["float32", "float16", "bfloat16"]),
    default="float32",
    show_default=True,
    help="Float type of scales and norms (float32 is fastest on CPU; float16 is smaller, for Metal).",
)
def command(model: str, force: bool, dtype: str) -> None:
    """Convert an installed GGUF model to MLX (offline, no download; Q4_0/Q4_1/Q8_0 stay as they are)."""
    from localllm.formats import Weights
    from localllm.mlxmodels import MLX_FORMAT, ConversionProgress, convert_installed, mlx_dir_for
    from localllm.store import Store

    store = Store()
    installed = store.get(model)
    display = ConversionDisplay()
    path = None if force else mlx_dir_for(installed)
    if path is None:
        t0 = time.monotonic()
        display(ConversionProgress(installed.name, "start"))

        def progress(done: int, total: int) -> None:
            display(ConversionProgress(installed.name, "progress", done, total, time.monotonic() - t0))

        try:
            path = convert_installed(installed, force=force, dtype=dtype, progress=progress)
        finally:
            display.close()
    try:
        mlx = MLX_FORMAT.name
        store.set_weights(installed.name, mlx, Weights(mlx, path))  # the planner now sees an MLX build of it
    except LocalLLMError:
        pass  # a local .gguf path has no manifest: the MLX dir is found by its digest (mlx_dir_for)
    click.echo(str(path))
