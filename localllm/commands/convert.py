"""``localllm convert MODEL``: build the MLX version of an installed GGUF model, offline.

Any llama-architecture GGUF whose tensors are Q4_0, Q4_1, Q8_0 or float (with a byte-level BPE
vocabulary) becomes an MLX model directory; the quantized weights stay quantized, nothing is
downloaded. Afterwards the planner can pick MLX for that model (``--backend mlx`` forces it).

    $ localllm convert smollm2:135m
    /home/me/.local/share/localllm/models/mlx/b179c9523d0e...
    $ localllm run smollm2:135m --backend mlx "Hello"
"""

from __future__ import annotations

import click

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
    """Convert an installed GGUF model to MLX (Q4_0/Q4_1/Q8_0 stay quantized; no download)."""
    from localllm.mlxmodels import convert_installed
    from localllm.store import Store

    store = Store()
    installed = store.get(model)
    path = convert_installed(installed, force=force, dtype=dtype)
    try:
        store.set_mlx_path(installed.name, path)  # the planner now sees an MLX build of this model
    except LocalLLMError:
        pass  # a local .gguf path has no manifest: the MLX dir is found by its digest (mlx_dir_for)
    click.echo(str(path))
