"""llama.cpp's own tools (``llama-bench``, ``llama-batched-bench``, ``llama-quantize``, ``llama-mtmd-cli``,
``llama-server``), built from the
llama-cpp-python sdist the project pins, so the ceilings we measure against run the very llama.cpp our backend
links.

    python benchmarks/llama_tools.py                         # build if missing (idempotent), print the paths
    python benchmarks/llama_tools.py --target llama-quantize # only that one (and what it links)
    python benchmarks/llama_tools.py --rebuild               # configure and build again

Where: ``$LOCALLLM_BENCH_TOOLS`` if set, else ``~/.cache/localllm-bench/llama.cpp-<version>/`` (outside the
repository: neither the sdist nor the binaries are ever committed). Steps, each skipped when its result is
already there: ``pip download --no-binary :all: --no-deps llama-cpp-python==<version>`` into ``sdist/``,
unpack it, ``cmake`` in ``vendor/llama.cpp`` (Release, CPU, ``-DLLAMA_CURL=OFF``, static, plus ``$CMAKE_ARGS``
as llama-cpp-python's own build takes them: the README's no-AMX flags give the ceiling the same build), build only the
targets asked for (all of :data:`TARGETS` by default; :func:`tool` builds the one it needs) with ``-j2`` under
``nice -n 10`` (the machine is shared). A lock file keeps two benchmark
scripts from building at once. The version is the installed llama-cpp-python's (else the pinned one).

Benchmark scripts call :func:`tool` for a binary's path, :func:`llama_bench` and :func:`llama_batched_bench`
for parsed results (``import llama_tools`` from a script in ``benchmarks/``).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

PINNED = "0.3.36"
TARGETS = ("llama-bench", "llama-batched-bench", "llama-quantize", "llama-mtmd-cli", "llama-server")


def version() -> str:
    """The llama-cpp-python version the tools are built from: the installed one, else the project's pin."""
    try:
        from importlib.metadata import version as dist_version

        return dist_version("llama-cpp-python")
    except Exception:  # noqa: BLE001 - not installed: the pin
        return PINNED


def home(ver: str | None = None) -> Path:
    env = os.environ.get("LOCALLLM_BENCH_TOOLS")
    base = Path(env) if env else Path.home() / ".cache" / "localllm-bench" / f"llama.cpp-{ver or version()}"
    return base.expanduser()


def _log(msg: str) -> None:
    print(f"[llama_tools] {msg}", file=sys.stderr, flush=True)


def _run(cmd: list[str], cwd: Path | None = None) -> None:
    _log(" ".join(cmd))
    subprocess.run(cmd, cwd=cwd, check=True)


def _sdist(root: Path, ver: str) -> Path:
    d = root / "sdist"
    d.mkdir(parents=True, exist_ok=True)
    found = sorted(d.glob(f"llama_cpp_python-{ver}.tar.gz"))
    if found:
        return found[0]
    _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
          f"llama-cpp-python=={ver}", "-d", str(d)])
    found = sorted(d.glob(f"llama_cpp_python-{ver}.tar.gz"))
    if not found:
        raise SystemExit(f"pip download left no llama_cpp_python-{ver}.tar.gz in {d}")
    return found[0]


def _source(root: Path, ver: str) -> Path:
    src = root / f"llama_cpp_python-{ver}" / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").exists():
        return src
    archive = _sdist(root, ver)
    _log(f"unpacking {archive.name}")
    with tarfile.open(archive) as tf:
        tf.extractall(root, filter="data")
    if not (src / "CMakeLists.txt").exists():
        raise SystemExit(f"{archive.name} has no vendor/llama.cpp")
    return src


def build(rebuild: bool = False, targets: tuple[str, ...] = TARGETS) -> dict[str, Path]:
    """Build ``targets`` (if needed) and return {target: path}. Idempotent; safe to call from several
    processes."""
    ver = version()
    root = home(ver)
    root.mkdir(parents=True, exist_ok=True)
    bin_dir = root / "build" / "bin"
    paths = {t: bin_dir / t for t in targets}
    if not rebuild and all(p.exists() and os.access(p, os.X_OK) for p in paths.values()):
        return paths
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building: wait for it, then re-check
        if not rebuild and all(p.exists() for p in paths.values()):
            return paths
        src = _source(root, ver)
        bdir = root / "build"
        if rebuild and bdir.exists():
            shutil.rmtree(bdir)
        nice = ["nice", "-n", "10"] if shutil.which("nice") else []
        if not (bdir / "CMakeCache.txt").exists():
            gen = ["-G", "Ninja"] if shutil.which("ninja") else []
            _run([*nice, "cmake", "-S", str(src), "-B", str(bdir), *gen, "-DCMAKE_BUILD_TYPE=Release",
                  "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF",
                  "-DLLAMA_BUILD_TESTS=OFF", *shlex.split(os.environ.get("CMAKE_ARGS", ""))])
        _run([*nice, "cmake", "--build", str(bdir), "--config", "Release", "-j2", "--target", *targets])
        missing = [str(p) for p in paths.values() if not p.exists()]
        if missing:
            raise SystemExit(f"the build finished without {', '.join(missing)}")
    return paths


def tool(name: str) -> Path:
    """Path of a llama.cpp tool (one of :data:`TARGETS`), built on first use (only it)."""
    if name not in TARGETS:
        raise ValueError(f"unknown tool {name!r}; one of {TARGETS}")
    return build(targets=(name,))[name]


def llama_bench(model: Path | str, *, threads: int, flash_attn: str = "auto", n_prompt: int = 512,
                n_gen: int = 128, reps: int = 5, extra: list[str] | None = None) -> list[dict[str, Any]]:
    """Run ``llama-bench`` (pp``n_prompt`` and tg``n_gen`` tests) and return its JSON records.

    Each record has ``n_prompt``, ``n_gen``, ``avg_ts`` / ``stddev_ts`` (tokens/s) and ``samples_ts``.
    ``flash_attn``: "auto" (llama.cpp's default), "on" or "off" (llama-bench's ``-fa``).
    """
    cmd = [str(tool("llama-bench")), "-m", str(model), "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen),
           "-r", str(reps), "-fa", flash_attn, "-o", "json", *(extra or [])]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def llama_batched_bench(model: Path | str, *, threads: int, n_prompt: int = 32, n_gen: int = 128,
                        parallel: tuple[int, ...] = (1, 4, 8), n_ctx: int = 4096, flash_attn: str = "auto",
                        extra: list[str] | None = None) -> list[dict[str, Any]]:
    """Run ``llama-batched-bench`` (``parallel`` sequences of ``n_prompt`` + ``n_gen`` tokens, one unified KV
    cache of ``n_ctx`` cells) and return its JSONL records: ``pl`` (sequences), ``speed_tg`` (total generated
    tokens/s), ``speed_pp``, ``speed`` (all tokens/s), ``t_pp`` / ``t_tg`` (s)."""
    cmd = [str(tool("llama-batched-bench")), "-m", str(model), "-t", str(threads), "-c", str(n_ctx),
           "-npp", str(n_prompt), "-ntg", str(n_gen), "-npl", ",".join(map(str, parallel)), "-fa", flash_attn,
           "--output-format", "jsonl", *(extra or [])]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rebuild", action="store_true")
    ap.add_argument("--target", action="append", choices=TARGETS, help="build only this one (repeatable)")
    args = ap.parse_args()
    for name, path in build(rebuild=args.rebuild, targets=tuple(args.target or TARGETS)).items():
        print(f"{name}\t{path}")


if __name__ == "__main__":
    main()
