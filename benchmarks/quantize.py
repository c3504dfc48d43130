"""``create --quantize`` (issue 23) against llama.cpp's own ``llama-quantize`` on the same F32 file.

    python benchmarks/quantize.py                                  # q4_K_M and q8_0; llama-quantize built here
    python benchmarks/quantize.py --types q8_0 --llama-quantize ~/llama.cpp/build/bin/llama-quantize
    python benchmarks/quantize.py --no-llama-quantize             # ours only

The F32 variant is the default model requantized to F32 (cached, :func:`_common.derived_model`). For each type,
in a fresh home, timed on the wall clock with the same thread count:

* ``localllm create --quantize``: ``Store.create(..., quantize=TYPE)`` FROM the F32 file, the whole path: the
  F32 file's import into the blobs (copy + sha256), llama.cpp's plan (dry run), the binding's
  ``llama_model_quantize`` with the progress poller, the result's sha256, the rename, the manifest;
* ``llama_model_quantize`` alone (the same call, no store around it): what the quantizer itself costs here;
* ``llama-quantize`` (``--llama-quantize PATH``, ``$LLAMA_QUANTIZE``, else built from the pinned sdist by
  :mod:`llama_tools`), as a process.

Printed: the times, the output sizes, whether the files are byte-identical (sha256), and, where they are not,
how many of 32 greedy tokens of one prompt agree (the tensors that differ are named).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import derived_model, engine_and_model  # noqa: I001 - run from benchmarks/ or the root

PROMPT = "Write about the sea."


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def greedy(engine: Any, path: Path, n: int = 32) -> list[str]:
    """The greedy tokens of :data:`PROMPT` on the GGUF at ``path`` (a chat turn, temperature 0)."""
    from localllm.api import GenerateRequest, Sampling, TextChunk

    req = GenerateRequest(messages=[{"role": "user", "content": PROMPT}],
                          sampling=Sampling(temperature=0.0, max_tokens=n), logprobs=True)
    out: list[str] = []
    for ev in engine.generate(str(path), req):
        if isinstance(ev, TextChunk):
            out += [lp.token for lp in ev.logprobs or []]
    return out


def differing_tensors(a: Path, b: Path) -> list[str]:
    """Names of the tensors whose bytes differ between two GGUFs of the same tensor table."""
    from backends.gguf_header import read_header

    ha, hb = read_header(a), read_header(b)
    tb = {t.name: t for t in hb.tensors}
    out = []
    with open(a, "rb") as fa, open(b, "rb") as fb:
        for t in ha.tensors:
            u = tb.get(t.name)
            if u is None or (t.type, t.n_bytes) != (u.type, u.n_bytes):
                out.append(t.name)
                continue
            fa.seek(t.offset)
            fb.seek(u.offset)
            if fa.read(t.n_bytes) != fb.read(u.n_bytes):
                out.append(t.name)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--types", default="q4_K_M,q8_0", help="comma-separated quantization types")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--llama-quantize", default=os.environ.get("LLAMA_QUANTIZE") or shutil.which("llama-quantize"))
    ap.add_argument("--no-llama-quantize", action="store_true", help="time ours only")
    args = ap.parse_args()

    from backends.llamacpp.quantize import quantize

    theirs_bin: str | None = None
    if not args.no_llama_quantize:
        if args.llama_quantize:
            theirs_bin = args.llama_quantize
        else:
            import llama_tools

            theirs_bin = str(llama_tools.tool("llama-quantize"))  # before anything is timed: minutes of both cores

    engine, _, path = engine_and_model(args.model)
    f32 = derived_model(path, "F32")
    print(f"source: {f32.name}, {f32.stat().st_size:,} bytes; {args.threads} threads")
    with tempfile.TemporaryDirectory(prefix="bench-quantize-") as tmp:
        from localllm.config import Paths
        from localllm.modelfile import Modelfile
        from localllm.store import Store

        root = Path(tmp)
        for type_name in [t.strip() for t in args.types.split(",") if t.strip()]:
            key = type_name.upper()
            home = root / key
            store = Store(paths=Paths(data=home / "data", cache=home / "cache", config=home / "config",
                                      models=home / "data" / "models"))
            t0 = time.perf_counter()
            ours = store.create(f"bench-{type_name.lower()}", Modelfile(from_=str(f32)), quantize=type_name)
            ours_s = time.perf_counter() - t0
            bare = root / f"bare-{key}.gguf"
            t0 = time.perf_counter()
            quantize(f32, bare, type_name, n_threads=args.threads)
            bare_s = time.perf_counter() - t0
            print(f"{key}: localllm create --quantize {ours_s:.2f} s (the F32 import included), "
                  f"llama_model_quantize alone {bare_s:.2f} s, {ours.size:,} bytes, "
                  f"sha256 {ours.weights_digest.removeprefix('sha256:')[:16]}")
            if theirs_bin is None:
                continue
            out = root / f"llama-quantize-{key}.gguf"
            t0 = time.perf_counter()
            subprocess.run([theirs_bin, str(f32), str(out), key, str(args.threads)], check=True, capture_output=True)
            theirs_s = time.perf_counter() - t0
            same = sha256(out) == ours.weights_digest.removeprefix("sha256:")
            line = (f"{key}: llama-quantize {theirs_s:.2f} s, {out.stat().st_size:,} bytes, "
                    f"identical file: {'yes' if same else 'no'}")
            if not same:
                differ = differing_tensors(ours.path, out)
                a, b = greedy(engine, ours.path), greedy(engine, out)
                agree = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                line += (f" ({len(differ)} tensors differ: {', '.join(differ[:4])}{', ...' if len(differ) > 4 else ''}"
                         f"; greedy tokens agreeing: {agree} of {len(a)})")
            print(line)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
