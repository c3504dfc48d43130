"""Shared helpers of the benchmark scripts (not part of the package; run from the repository root)."""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def engine_and_model(model: str) -> tuple[Any, str, Path]:
    """(Engine, installed name, GGUF path) for ``model`` (an alias is pulled if missing, a path is read in place)."""
    from localllm.cli.answer import ensure_model
    from localllm.engine import Engine
    from localllm.local import LocalModels

    engine = Engine(keep_alive=float("inf"))
    installed = ensure_model(LocalModels(engine.store), model)
    assert installed.path is not None
    return engine, installed.name, Path(installed.path)


def derived_model(src: Path, ftype: str) -> Path:
    """``src`` requantized to ``ftype`` ("F32", "F16", "Q8_0") with llama.cpp's quantizer, cached under the
    localllm cache dir (same vocabulary, so a real target/draft pair)."""
    import llama_cpp

    from localllm.config import paths

    out_dir = paths().cache / "bench"
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / f"{src.stem}.{ftype}.gguf"
    if dst.exists() and dst.stat().st_size > 0:
        return dst
    codes = {"F32": llama_cpp.LLAMA_FTYPE_ALL_F32, "F16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
             "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = codes[ftype]
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    tmp = dst.with_suffix(".part")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize failed ({rc}) for {src} -> {ftype}")
    tmp.replace(dst)
    return dst


class ClockWriter(io.StringIO):
    """A stdout stand-in that remembers when the first and the last text arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.first: float | None = None
        self.last: float | None = None

    def write(self, s: str) -> int:
        now = time.perf_counter()
        if s:
            if self.first is None:
                self.first = now
            self.last = now
        return super().write(s)


def mean_std(values: list[float]) -> str:
    if not values:
        return "n/a"
    m = statistics.fmean(values)
    s = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{m:.2f} ± {s:.2f}"


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def spread(values: list[float]) -> str:
    """median [min–max] of a list of figures."""
    if not values:
        return "n/a"
    return f"{statistics.median(values):.3f} [{min(values):.3f}–{max(values):.3f}]"


def run_together(work: Callable[[int], None], n: int) -> float:
    """Run ``work(0) .. work(n-1)`` on ``n`` threads at once; the wall time from the first start to the last end."""
    import threading

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def default_threads() -> int:
    """The backend's default thread count (physical cores), so both sides of a comparison get the same."""
    from backends.llamacpp.checks import physical_cores

    return physical_cores()


# ------------------------------------------------------------------------------------------ sides


def _side_main(conn: Any, factory: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """Child process: build the side, then answer (method, kwargs) calls until told to stop (None)."""
    try:
        obj = factory(**kwargs)
        conn.send(("ok", None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send(("err", traceback.format_exc()))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the parent is gone
            msg = None
        if msg is None:
            break
        method, kw = msg
        try:
            conn.send(("ok", getattr(obj, method)(**kw)))
        except BaseException:  # noqa: BLE001 - reported to the parent
            conn.send(("err", traceback.format_exc()))
    close = getattr(obj, "close", None)
    if close is not None:
        close()
    try:
        conn.send(("ok", None))
    except OSError:
        pass


class Side:
    """One side of a comparison in its own, freshly spawned process.

    Two threads that drive llama.cpp in one process slow each other down (each calling thread gets its own
    OpenMP team; a team left spinning starves the other: measured raw ``Llama.generate`` at 78 tok/s beside
    our stack in one process against 160 tok/s in its own). So every side of a benchmark lives in its own
    interpreter, and the caller alternates calls between sides (A B A B ...) so that the load of a shared
    machine hits both alike. ``factory(**kwargs)`` runs in the child (it must be a module-level function of
    the calling script or of this module) and returns an object whose methods ``side.call(name, ...)`` runs
    there, on the child's main thread; results come back pickled.
    """

    def __init__(self, label: str, factory: Callable[..., Any], **kwargs: Any):
        self.label = label
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_side_main, args=(child, factory, kwargs), name=label, daemon=True)
        self._proc.start()
        child.close()
        self._answer()

    def _answer(self) -> Any:
        try:
            status, value = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise SystemExit(f"{self.label}: the benchmark process exited ({self._proc.exitcode})") from None
        if status == "err":
            raise SystemExit(f"{self.label} failed:\n{value}")
        return value

    def call(self, method: str = "run", **kwargs: Any) -> Any:
        self._conn.send((method, kwargs))
        return self._answer()

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(None)
                self._answer()
            except (OSError, EOFError, SystemExit):
                pass
            self._proc.join(30)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(5)
        self._conn.close()

    def __enter__(self) -> Side:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.1f} / {five:.1f} / {fifteen:.1f} (1/5/15 min, {os.cpu_count()} CPUs)"
