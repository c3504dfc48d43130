"""A mixture of experts on a device too small for it: the planner's MoE placement (every layer on the device, the
experts of the first N layers in RAM, llama.cpp's ``--n-cpu-moe N``) against the whole-layer split it made before
(as many whole layers as fit, the rest on the CPU), on an RPC worker on loopback capped by LOCALLLM_DEVICE_MEMORY;
prompt and decode tokens/s through localllm, and through a raw llama.cpp loop over the binding with the same
placement (devices, layers, tensor overrides: llama.cpp's own figure for that placement), each in its own process.

    python benchmarks/moe_placement.py [--layers 8] [--cap 200MiB] [--pp 64] [--tg 32] [--rounds 2]

The model is made (random F32 weights, the default model's tokenizer: ``tests/support_memory.make_moe``, a
gpt-oss of 8 experts a layer, 2 used). The worker runs with 1 thread, the local side with ``--threads``.
Where ``llama-bench`` is built with RPC (``benchmarks/llama_tools.py`` under ``CMAKE_ARGS=-DGGML_RPC=on``, as
``.ci/run`` builds it), each round also runs it against the same worker with the same placement
(``--rpc ... -ngl N -ncmoe M``): llama.cpp's own ceiling for each side; without RPC it is skipped and the raw
loop is the comparison. llama-bench also runs on the made model on the CPU (``-ngl 0``) and on the default model
(tg128) as the machine's yardstick. Absolute figures on loopback mean little (every op crosses a socket); the
ratios are the point.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_tools  # noqa: E402
from _common import ROOT, load_average, median  # noqa: E402
from _serve import rpc_workers  # noqa: E402

# one side: load as asked, one warm-up answer, then a pp-token prompt and tg tokens greedy; prints the rates
_OURS = textwrap.dedent("""
    import json, os, sys
    from localllm import devices
    if os.environ.get("RPC"):
        devices.use_workers(os.environ["RPC"])
    from localllm.api import Done, GenerateRequest, Sampling
    from localllm.engine import Engine
    from localllm.loader import LoadOptions
    e = Engine()
    mode = os.environ["MODE"]
    opts = LoadOptions(num_ctx=512, num_parallel=1, num_thread=int(os.environ["THREADS"]),
                       num_gpu=0 if mode == "cpu" else None, num_cpu_moe=0 if mode == "layers" else None)
    rm = e.load(os.environ["MODEL"], opts)
    pp, tg = int(os.environ["PP"]), int(os.environ["TG"])
    def once(n_prompt, n_gen):
        text = " ".join(["the"] * n_prompt)  # about n_prompt tokens
        req = GenerateRequest(prompt=text, sampling=Sampling(temperature=0, max_tokens=n_gen, seed=1, stop=[]))
        return next(ev for ev in rm.model.generate(req) if isinstance(ev, Done)).stats
    once(8, 4)
    s = once(pp, tg)
    print(json.dumps({"pp_tps": s.prompt_eval_rate, "tg_tps": s.eval_rate, "pp": s.prompt_eval_count,
                      "tg": s.eval_count, "ngl": rm.plan.n_gpu_layers, "n_cpu_moe": rm.plan.n_cpu_moe,
                      "verdict": rm.plan.verdict_text, "devices": [d.name for d in rm.plan.devices],
                      "split": rm.plan.tensor_split}))
    e.close()
    os._exit(0)
""")

# the same placement, raw: llama.cpp through the binding, our tensor-override module for the experts
_RAW = textwrap.dedent("""
    import ctypes, json, os, sys, time
    import llama_cpp, numpy as np
    from backends.llamacpp import devices as ggml_devices
    from backends.llamacpp.tensor_overrides import experts_on_cpu
    llama_cpp.llama_backend_init()
    ggml_devices.add_worker(os.environ["RPC"])
    mp = llama_cpp.llama_model_default_params()
    mp.n_gpu_layers = int(os.environ["NGL"])
    dev = (ctypes.c_void_p * 2)(ggml_devices.device_handle("RPC0"), None)
    mp.devices = ctypes.cast(dev, ctypes.c_void_p)
    keep = experts_on_cpu(mp, int(os.environ["NCMOE"]))
    model = llama_cpp.llama_model_load_from_file(os.environ["MODEL"].encode(), mp)
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = 512, 512, 512
    cp.n_threads = cp.n_threads_batch = int(os.environ["THREADS"])
    ctx = llama_cpp.llama_init_from_model(model, cp)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    mem = llama_cpp.llama_get_memory(ctx)
    def run(n_prompt, n_gen):
        llama_cpp.llama_memory_clear(mem, True)
        ids = (llama_cpp.llama_token * n_prompt)(*[100 + (i * 37) % 4000 for i in range(n_prompt)])
        t0 = time.perf_counter()
        assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(ids, n_prompt)) == 0
        llama_cpp.llama_synchronize(ctx)  # llama_decode returns before the graph has run
        t1 = time.perf_counter()
        for _ in range(n_gen):
            row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            tok = (llama_cpp.llama_token * 1)(int(row.argmax()))
            assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(tok, 1)) == 0
        llama_cpp.llama_synchronize(ctx)
        t2 = time.perf_counter()
        return n_prompt / (t1 - t0), n_gen / (t2 - t1)
    run(8, 4)
    pp, tg = run(int(os.environ["PP"]), int(os.environ["TG"]))
    print(json.dumps({"pp_tps": pp, "tg_tps": tg}))
    os._exit(0)
""")


def _side(script: str, **env: str) -> dict:
    e = dict(os.environ, LOCALLLM_PROMPT_CACHE_SIZE="0", PYTHONPATH=str(ROOT), **env)
    out = subprocess.run([sys.executable, "-c", script], env=e, capture_output=True, text=True, cwd=ROOT,
                         timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"a side failed: {out.stderr[-2000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _bench_side(model: Path, rpc: str, ours: dict, args: argparse.Namespace) -> dict:
    """llama-bench on the worker with our side's placement (``-ngl N -ncmoe M``): pp and tg tokens/s."""
    got = llama_tools.llama_bench(model, threads=args.threads, n_prompt=args.pp, n_gen=args.tg, reps=2,
                                  extra=["--rpc", rpc, "-ngl", str(ours["ngl"]), "-ncmoe", str(ours["n_cpu_moe"])])
    rate = {("pp" if r["n_prompt"] else "tg"): r["avg_ts"] for r in got}
    return {"pp_tps": rate["pp"], "tg_tps": rate["tg"], "ngl": ours["ngl"], "n_cpu_moe": ours["n_cpu_moe"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--cap", default="200MiB", help="LOCALLLM_DEVICE_MEMORY for the worker's device")
    ap.add_argument("--pp", type=int, default=64)
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from localllm.cli.answer import ensure_model
    from localllm.local import LocalModels
    from localllm.store import Store
    from tests.support_memory import make_moe

    default = ensure_model(LocalModels(Store()), "smollm2:135m").path
    model = make_moe(Path(default), Path.home() / ".cache" / "localllm-bench" / f"moe-bench-{args.layers}l.gguf",
                     dims={"FF": 1024, "experts": 8, "layers": args.layers})
    print(f"model {model} ({model.stat().st_size / 2**20:.0f} MiB, {args.layers} layers of 8 experts, 2 used), "
          f"cap {args.cap}, pp {args.pp}, tg {args.tg}, threads {args.threads}, load {load_average()}")
    bench_rpc = "--rpc" in subprocess.run([str(llama_tools.tool("llama-bench")), "--help"], capture_output=True,
                                          text=True).stdout
    if not bench_rpc:
        print("llama-bench has no RPC here (build it with CMAKE_ARGS=-DGGML_RPC=on): its side is skipped")
    workers, rpc = rpc_workers(1)
    env = {"MODEL": str(model), "RPC": rpc, "LOCALLLM_DEVICE_MEMORY": f"RPC0={args.cap}", "PP": str(args.pp),
           "TG": str(args.tg), "THREADS": str(args.threads)}
    rows: dict[str, list[dict]] = {}
    try:
        for _ in range(args.rounds):
            for mode in ("moe", "layers"):
                ours = _side(_OURS, MODE=mode, **env)
                rows.setdefault(f"ours {mode}", []).append(ours)
                raw = _side(_RAW, NGL=str(ours["ngl"]), NCMOE=str(ours["n_cpu_moe"]), **env)
                rows.setdefault(f"raw {mode}", []).append(raw | {k: ours[k] for k in ("ngl", "n_cpu_moe")})
                if bench_rpc:
                    rows.setdefault(f"llama-bench {mode}", []).append(_bench_side(model, rpc, ours, args))
            rows.setdefault("ours cpu", []).append(_side(_OURS, MODE="cpu", **{**env, "RPC": ""}))
    finally:
        workers[0].kill()
    print(f"{'side':14} {'placement':34} {'pp tok/s':>9} {'tg tok/s':>9}  (ours: prompt of "
          f"{rows['ours moe'][0]['pp']} tokens, {rows['ours moe'][0]['tg']} generated)")
    for label, runs in rows.items():
        r0 = runs[0]
        where = ("CPU only" if "cpu" in label else
                 f"ngl {r0['ngl']}, experts of {r0['n_cpu_moe']} layers in RAM")
        print(f"{label:14} {where:34} {median([r['pp_tps'] for r in runs]):9.1f} "
              f"{median([r['tg_tps'] for r in runs]):9.1f}")
    med = {k: (median([r["pp_tps"] for r in v]), median([r["tg_tps"] for r in v])) for k, v in rows.items()}
    moe, lay = med["ours moe"], med["ours layers"]
    rmoe, rlay = med["raw moe"], med["raw layers"]
    print(f"MoE placement vs whole-layer split, ours: pp {moe[0] / lay[0]:.2f}x, tg {moe[1] / lay[1]:.2f}x; "
          f"raw: pp {rmoe[0] / rlay[0]:.2f}x, tg {rmoe[1] / rlay[1]:.2f}x")
    print(f"ours / raw: moe tg {med['ours moe'][1] / med['raw moe'][1]:.2f}, layers tg "
          f"{med['ours layers'][1] / med['raw layers'][1]:.2f}")
    if bench_rpc:
        bmoe, blay = med["llama-bench moe"], med["llama-bench layers"]
        print(f"llama-bench: MoE placement vs whole-layer split pp {bmoe[0] / blay[0]:.2f}x, "
              f"tg {bmoe[1] / blay[1]:.2f}x;"
              f" ours / llama-bench: moe pp {moe[0] / bmoe[0]:.2f} tg {moe[1] / bmoe[1]:.2f}, layers pp "
              f"{lay[0] / blay[0]:.2f} tg {lay[1] / blay[1]:.2f}")
    for name, path, extra in (("llama-bench made MoE, CPU", model, ["-ngl", "0"]),
                              ("llama-bench smollm2 Q4_1", Path(default), [])):
        ref = llama_tools.llama_bench(path, threads=args.threads, n_prompt=args.pp, n_gen=128 if "smollm2" in name
                                      else args.tg, reps=3, extra=extra)
        print(f"{name}: " + ", ".join(f"{'pp' if r['n_prompt'] else 'tg'}{r['n_prompt'] or r['n_gen']} "
                                      f"{r['avg_ts']:.1f} tok/s" for r in ref))


if __name__ == "__main__":
    main()
