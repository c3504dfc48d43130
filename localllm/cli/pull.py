"""``localllm pull NAME``: download a model (resumable, sha256-verified), like ``ollama pull``.

    $ localllm pull smollm2:135m
    $ localllm pull qwen2.5:7b-q8_0
    $ localllm pull hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M
    $ localllm pull llama3.2:1b --mlx      # also its MLX weights (the default on Apple Silicon)

On a terminal the progress is a rich bar (bytes, speed, ETA) on stderr; otherwise plain lines.
Interrupting it keeps the partial download: the next pull resumes from there.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, TextIO

import click

if TYPE_CHECKING:
    from rich.progress import TaskID

    from localllm.api import Installed, Models, PullProgress


class PlainProgress:
    """Progress as plain lines: one per phase, and one every few seconds while bytes flow."""

    def __init__(self, out: TextIO, every: float = 2.0):
        self.out = out
        self.every = every
        self._status: str | None = None
        self._last = 0.0
        self._t0 = time.monotonic()
        self._c0 = 0

    def __call__(self, p: PullProgress) -> None:
        from localllm.download import fmt_bytes

        now = time.monotonic()
        if p.status != self._status:
            self._status, self._last, self._t0, self._c0 = p.status, now, now, p.completed
            self.out.write(p.status + (f" ({fmt_bytes(p.total)})" if p.total else "") + "\n")
            self.out.flush()
            return
        done = p.total and p.completed >= p.total
        if p.total and (done or now - self._last >= self.every):
            self._last = now
            speed = (p.completed - self._c0) / max(now - self._t0, 1e-6)
            self.out.write(f"{p.status}: {100 * p.completed / p.total:3.0f}% "
                           f"{fmt_bytes(p.completed)}/{fmt_bytes(p.total)} {fmt_bytes(speed)}/s\n")
            self.out.flush()

    def close(self) -> None:
        pass


class RichProgress:
    """A rich progress bar per phase: description, bar, bytes, speed, ETA."""

    def __init__(self, out: TextIO):
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.progress = Progress(
            TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
            TimeRemainingColumn(), console=Console(file=out), transient=False,
        )
        self.progress.start()
        self._task: TaskID | None = None
        self._status: str | None = None

    def __call__(self, p: PullProgress) -> None:
        if p.status != self._status:
            self._status = p.status
            if self._task is not None:
                self.progress.stop_task(self._task)
                self._task = None
            if not p.total:  # a phase without bytes ("pulling manifest", "success"): a plain line
                self.progress.console.print(p.status, highlight=False, markup=False)
                return
            self._task = self.progress.add_task(p.status, total=p.total, completed=p.completed)
            return
        if self._task is not None:
            self.progress.update(self._task, completed=p.completed, total=p.total or None)

    def close(self) -> None:
        self.progress.stop()


def make_progress(out: TextIO | None = None) -> PlainProgress | RichProgress:
    out = out or sys.stderr
    return RichProgress(out) if out.isatty() else PlainProgress(out)


def pull_with_progress(models: Models, name: str, out: TextIO | None = None, *, mlx: bool | None = None
                       ) -> Installed:
    """Pull ``name`` showing progress on ``out`` (stderr); returns the installed model. ``mlx``: fetch the
    catalog's MLX weights too (None: the store decides, i.e. on Apple Silicon)."""
    bar = make_progress(out)
    try:
        return models.pull(name, progress=bar, mlx=mlx)
    finally:
        bar.close()


@click.command("pull", help="Download a model (resumable, sha256-verified).")
@click.argument("name")
@click.option("--quiet", "-q", is_flag=True, help="No progress output.")
@click.option("--mlx/--no-mlx", default=None,
              help="Also fetch the catalog's MLX weights (default: on Apple Silicon only).")
@click.option("--host", default=None, metavar="URL",
              help="Talk to a localllm or Ollama server there instead of in-process.")
def command(name: str, quiet: bool, mlx: bool | None, host: str | None) -> None:
    """Download NAME: an alias (smollm2:135m, qwen2.5:7b-q8_0) or hf.co/user/repo[:QUANT]."""
    from localllm.names import parse_name
    from localllm.session import open_models

    parse_name(name, allow_path=False)  # a bad name is one sentence before anything is asked of a server
    models = open_models(host)
    try:
        model = models.pull(name, mlx=mlx) if quiet else pull_with_progress(models, name, mlx=mlx)
    except KeyboardInterrupt:
        click.echo("\nInterrupted; the partial download is kept and the next pull resumes it.", err=True)
        sys.exit(130)
    finally:
        models.close()
    if models.remote:
        click.echo(f"success: {name} ({model.short_id})")
    elif not quiet:
        click.echo(f"success: {model.name} ({model.short_id}, {' + '.join(model.formats)})")
