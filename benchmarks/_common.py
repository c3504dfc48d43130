"""Shared helpers of the benchmark scripts (not part of the package; run from the repository root)."""

from __future__ import annotations

import io
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def engine_and_model(model: str) -> tuple[Any, str, Path]:
    """(Engine, installed name, GGUF path) for ``model`` (an alias is pulled if missing, a path is read in place)."""
    from localllm.commands.run import ensure_model
    from localllm.engine import Engine

    engine = Engine(keep_alive=float("inf"))
    installed = ensure_model(engine.store, model)
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
