"""``localllm convert MODEL``: build the MLX version of an installed GGUF model, offline.

A GGUF of an architecture the converter knows becomes an MLX model directory; Q4_0/Q4_1/Q8_0 weights stay
quantized as they are, other quant types are requantized, nothing is downloaded. Afterwards the planner
can pick MLX for that model (``--backend mlx`` forces it). ``--backend mlx`` also converts by itself on
first use; this command does it ahead of time (or again, with ``--force``).

    $ localllm convert smollm2:135m
    /home/me/.local/share/localllm/models/mlx/b179c9523d0e...
    $ localllm run smollm2:135m --backend mlx "Hello"

:class:`ConversionDisplay` is how every command shows a conversion on stderr: one line when it starts
(``converting smollm2:135m to MLX (once, offline)…``) and, on a terminal, a progress bar once it has taken
more than a second.
"""

from __future__ import annotations

import sys
import time
from typing import IO, TYPE_CHECKING

import click

from localllm.errors import LocalLLMError

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from localllm.mlxmodels import ConversionProgress


class ConversionDisplay:
    """Shows MLX conversions on ``err`` (stderr): give it as ``Engine(on_convert=...)``.

    One line when a conversion starts; on a terminal (``bar=True`` and ``err`` a TTY), a transient rich
    progress bar over the GGUF's tensor bytes once the conversion has run for more than ``delay`` seconds."""

    def __init__(self, err: IO[str] | None = None, *, bar: bool = True, delay: float = 1.0):
        self.err = err or sys.stderr
        self.bar = bar and _isatty(self.err)
        self.delay = delay
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def __call__(self, event: ConversionProgress) -> None:
        if event.stage == "start":
            self.err.write(f"converting {event.name} to MLX (once, offline)…\n")
            self.err.flush()
        elif event.stage == "progress":
            if self._progress is None and self.bar and event.seconds > self.delay and event.total:
                self._start(event.name, event.total)
            if self._progress is not None and self._task is not None:
                self._progress.update(self._task, completed=event.done, total=event.total or None)
        else:
            self.close()

    def _start(self, name: str, total: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                  TimeElapsedColumn(), console=Console(file=self.err), transient=True)
        self._progress.start()
        self._task = self._progress.add_task(f"converting {name}", total=total)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _isatty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


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
    from localllm.mlxmodels import ConversionProgress, convert_installed, mlx_dir_for
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
        store.set_mlx_path(installed.name, path)  # the planner now sees an MLX build of this model
    except LocalLLMError:
        pass  # a local .gguf path has no manifest: the MLX dir is found by its digest (mlx_dir_for)
    click.echo(str(path))
