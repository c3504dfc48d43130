"""``create --quantize`` (issue 23) against llama.cpp's own ``llama-quantize`` on the same F32 file.

    python benchmarks/quantize.py                                  # q4_K_M of the default model's F32 variant
    python benchmarks/quantize.py --type q8_0 --llama-quantize ~/llama.cpp/build/bin/llama-quantize

The F32 variant is the default model requantized to F32 (cached, :func:`_common.derived_model`). Each run
makes ``TYPE`` of it twice in a fresh home: through ``Store.create(..., quantize=TYPE)`` (our path: the
binding's ``llama_model_quantize``, the sha256, the rename into the blobs, the manifest) and, when a
``llama-quantize`` binary is given (``--llama-quantize`` or ``$LLAMA_QUANTIZE``), through it with the same thread
count. Printed: wall time, output size, and whether the two files are byte-identical (their sha256).
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

from _common import derived_model, engine_and_model  # noqa: I001 - run from benchmarks/ or the root


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--type", default="q4_K_M")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--llama-quantize", default=os.environ.get("LLAMA_QUANTIZE") or shutil.which("llama-quantize"))
    args = ap.parse_args()

    engine, _, path = engine_and_model(args.model)
    engine.close()
    f32 = derived_model(path, "F32")
    with tempfile.TemporaryDirectory(prefix="bench-quantize-") as tmp:
        from localllm.config import Paths
        from localllm.modelfile import Modelfile
        from localllm.store import Store

        root = Path(tmp)
        store = Store(paths=Paths(data=root / "data", cache=root / "cache", config=root / "config",
                                  models=root / "data" / "models"))
        t0 = time.perf_counter()
        ours = store.create("bench-q", Modelfile(from_=str(f32)), quantize=args.type)
        ours_s = time.perf_counter() - t0
        print(f"localllm create --quantize {args.type}: {ours_s:.1f} s (import of the F32 file included), "
              f"{ours.size:,} bytes, sha256 {ours.digest.removeprefix('sha256:')[:16]}")
        if not args.llama_quantize:
            print("llama-quantize: not found (give --llama-quantize PATH or set LLAMA_QUANTIZE)")
            return 0
        out = Path(tmp) / "llama-quantize.gguf"
        t0 = time.perf_counter()
        subprocess.run([args.llama_quantize, str(f32), str(out), args.type.upper(), str(args.threads)],
                       check=True, capture_output=True)
        theirs_s = time.perf_counter() - t0
        same = sha256(out) == ours.digest.removeprefix("sha256:")
        print(f"llama-quantize {args.type.upper()}: {theirs_s:.1f} s, {out.stat().st_size:,} bytes, "
              f"identical file: {'yes' if same else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
