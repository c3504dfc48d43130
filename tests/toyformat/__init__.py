"""A backend with a weights format of its own, as a plugin would add one: this package and one line,
``register_format(ToyFormat(), TOY_BACKEND)`` (``tests/test_formats.py`` runs it).

The "toy" format is a directory holding the model's GGUF as ``model.gguf`` beside a ``toy.json``; a catalog entry
names where to fetch it (``weights = { toy = "<folder>[@revision]" }``; here a local folder stands for a hub) and
the ``toy`` backend loads it (llama.cpp's source, opening the GGUF inside the directory).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from backends.contract.specs import LoadSpec
from backends.descriptor import Backend
from backends.llamacpp.source import LlamaCppSource
from localllm.catalog import CatalogEntry
from localllm.errors import LocalLLMError, SourceUnavailable
from localllm.formats import Fetched, PlanWeights

NAME = "toy"


class ToyFormat:
    name: str = NAME
    label: str = "TOY"
    converts_from: str | None = None  # fetched only

    def source(self, entry: CatalogEntry) -> tuple[str, str | None] | None:
        return entry.weights.get(NAME)

    def fetch_unasked(self) -> bool:
        return True

    def fetch(self, repo: str, revision: str | None, *, models: Path, staging: Path,
              on_start: Callable[[str, int], None], on_bytes: Callable[[int], None],
              cancel: threading.Event | None) -> Fetched:
        src = Path(repo)
        if not (src / "toy.json").is_file():
            raise SourceUnavailable(f"{repo} holds no toy weights.")
        rev = revision or json.loads((src / "toy.json").read_text())["revision"]
        files = sorted(p for p in src.iterdir() if p.is_file())
        total = sum(p.stat().st_size for p in files)
        on_start(rev, total)
        tmp = staging / f"toy-{rev}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for p in files:
            shutil.copyfile(p, tmp / p.name)
            on_bytes(p.stat().st_size)
        target = models / NAME / f"{src.name}-{rev}"
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, target)  # whole, or not at all
        return Fetched(target, rev, total, len(files))

    def find(self, models: Path, digest: str) -> Path | None:
        return None  # nothing is converted to toy weights

    def size(self, path: Path) -> int:
        return sum(p.stat().st_size for p in path.iterdir() if p.is_file())

    def for_plan(self, model: Any, hw: Any, backend: str) -> PlanWeights:
        w = model.weights_of(NAME)
        if w is None:
            return PlanWeights(why_not="no toy weights are installed")
        return PlanWeights(installed=True, weights_bytes=self.size(w.path), source=w.source)

    def convert(self, model: Any, device: str, progress: Callable[[int, int], None] | None) -> Path:
        raise LocalLLMError("Toy weights are fetched, not converted.")


class ToySource(LlamaCppSource):
    """llama.cpp's source, loading the GGUF inside a toy directory."""

    name = NAME
    loaded_from: list[str] = []

    def __init__(self, spec: LoadSpec):
        type(self).loaded_from.append(spec.model_path)
        super().__init__(replace(spec, model_path=str(Path(spec.model_path) / "model.gguf")))


TOY_BACKEND = Backend(name=NAME, label="Toy", source=f"{__name__}:ToySource", weights=NAME, memory="unified",
                      install="(registered by the tests)", priority=95)
