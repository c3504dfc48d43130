"""How the CLI shows things on a terminal, in one place: the tty check, sizes, durations, tables, the pull
progress (a rich bar on a terminal, plain lines otherwise) and the MLX conversion display.

Kept light: nothing heavy is imported before a bar is drawn (``localllm list`` loads this module).

    >>> human_size(98362432), binary_size(3 * 1024**3), go_duration(130_869_000)
    ('98 MB', '3.0 GiB', '130.869ms')
    >>> print(format_table([["NAME", "SIZE"], ["smollm2:135m", "98 MB"]]))
    NAME            SIZE
    smollm2:135m    98 MB
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import IO, TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from localllm.api import Installed, Models, PullProgress
    from localllm.mlxmodels import ConversionProgress


def isatty(stream: object) -> bool:
    """Whether ``stream`` is a terminal; False for a stream without ``isatty`` or a closed one."""
    try:
        return bool(stream.isatty())  # type: ignore[attr-defined]
    except (AttributeError, ValueError):
        return False


# ------------------------------------------------------------------------------------------ sizes and times


def human_size(n: float) -> str:
    """Decimal units as Ollama prints them: ``human_size(98362432) == '98 MB'`` (bytes, or bytes per second)."""
    value = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            if unit == "B":
                return f"{int(n)} B"
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
        value /= 1000
    raise AssertionError  # pragma: no cover


def binary_size(n: int | None) -> str:
    """Memory in binary units, as ``probe`` shows it: GiB from 1 GiB up, else MiB; ``?`` when unknown."""
    if not n:
        return "?"
    return f"{n / 1024**3:.1f} GiB" if n >= 1024**3 else f"{n / 1024**2:.0f} MiB"


def go_duration(ns: int | float) -> str:
    """Format nanoseconds the way Go's ``time.Duration.String`` does (Ollama prints its stats so).

    >>> go_duration(0), go_duration(5_000_000), go_duration(130_869_000), go_duration(1_234_567_891)
    ('0s', '5ms', '130.869ms', '1.234567891s')
    >>> go_duration(62_500_000_000), go_duration(3_600_000_000_000), go_duration(999), go_duration(1500)
    ('1m2.5s', '1h0m0s', '999ns', '1.5µs')
    """
    ns = int(ns)
    if ns == 0:
        return "0s"
    sign = "-" if ns < 0 else ""
    u = abs(ns)

    def frac(value: int, digits: int) -> str:
        whole, rest = divmod(value, 10**digits)
        tail = f"{rest:0{digits}d}".rstrip("0")
        return f"{whole}.{tail}" if tail else str(whole)

    if u < 1_000:
        return f"{sign}{u}ns"
    if u < 1_000_000:
        return f"{sign}{frac(u, 3)}µs"
    if u < 1_000_000_000:
        return f"{sign}{frac(u, 6)}ms"
    hours, rem = divmod(u, 3_600_000_000_000)
    minutes, rem = divmod(rem, 60_000_000_000)
    out = frac(rem, 9) + "s"
    if hours or minutes:
        out = f"{minutes}m" + out
    if hours:
        out = f"{hours}h" + out
    return sign + out


def ago(when: datetime, now: datetime | None = None) -> str:
    """Ollama-style relative time.

    >>> from datetime import timedelta
    >>> t = datetime(2025, 1, 1, tzinfo=UTC)
    >>> ago(t, t), ago(t, t + timedelta(seconds=70)), ago(t, t + timedelta(hours=3)), ago(t, t + timedelta(days=40))
    ('Less than a second ago', 'About a minute ago', '3 hours ago', '5 weeks ago')
    """
    now = now or datetime.now(UTC)
    s = max((now - when).total_seconds(), 0)
    if s < 1:
        return "Less than a second ago"
    steps = [(60, "second", 1), (3600, "minute", 60), (86400, "hour", 3600), (86400 * 14, "day", 86400),
             (86400 * 60, "week", 86400 * 7), (86400 * 730, "month", 86400 * 30)]
    for limit, unit, div in steps:
        if s < limit:
            n = int(s // div)
            if n == 1:
                return f"About a{'n' if unit == 'hour' else ''} {unit} ago"
            return f"{n} {unit}s ago"
    return f"{int(s // (86400 * 365))} years ago"


def format_table(rows: Sequence[Sequence[str]]) -> str:
    """Columns left-aligned, four spaces apart, no trailing blanks (``ollama list`` and ``ollama ps``)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["    ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ pull progress


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
        now = time.monotonic()
        if p.status != self._status:
            self._status, self._last, self._t0, self._c0 = p.status, now, now, p.completed
            self.out.write(p.status + (f" ({human_size(p.total)})" if p.total else "") + "\n")
            self.out.flush()
            return
        done = p.total and p.completed >= p.total
        if p.total and (done or now - self._last >= self.every):
            self._last = now
            speed = (p.completed - self._c0) / max(now - self._t0, 1e-6)
            self.out.write(f"{p.status}: {100 * p.completed / p.total:3.0f}% "
                           f"{human_size(p.completed)}/{human_size(p.total)} {human_size(speed)}/s\n")
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
    return RichProgress(out) if isatty(out) else PlainProgress(out)


def pull_with_progress(models: Models, name: str, out: TextIO | None = None, *, mlx: bool | None = None,
                       mmproj_file: str | None = None) -> Installed:
    """Pull ``name`` showing progress on ``out`` (stderr); returns the installed model. ``mlx``: fetch the
    catalog's MLX weights too (None: the store decides, i.e. on Apple Silicon); ``mmproj_file``: the Hub repo's
    projector file to take."""
    bar = make_progress(out)
    try:
        if mmproj_file:
            return models.pull(name, progress=bar, mlx=mlx, mmproj_file=mmproj_file)
        return models.pull(name, progress=bar, mlx=mlx)
    finally:
        bar.close()


# ------------------------------------------------------------------------------------------ MLX conversion


class ConversionDisplay:
    """Shows MLX conversions on ``err`` (stderr): give it as ``Engine(on_convert=...)``.

    One line when a conversion starts (``converting smollm2:135m to MLX (once, offline)…``); on a terminal
    (``bar=True`` and ``err`` a TTY), a transient rich progress bar over the GGUF's tensor bytes once the
    conversion has run for more than ``delay`` seconds."""

    def __init__(self, err: IO[str] | None = None, *, bar: bool = True, delay: float = 1.0):
        self.err = err or sys.stderr
        self.bar = bar and isatty(self.err)
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
