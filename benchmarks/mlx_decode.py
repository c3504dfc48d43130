"""MLX benchmarks: decode through localllm vs mlx-lm, the GGUF → MLX conversion, agreement with llama.cpp.

1. **Decode tok/s** on the same MLX weights: localllm's `run` path (engine + MLX backend + the streaming
   writer of `localllm run`) against raw ``mlx_lm.stream_generate`` (what ``mlx_lm.generate`` runs), **each
   side in its own process**, called alternately (ours, raw, ours, raw, ...) so a busy machine hits both
   alike. Greedy, no penalties; a side's rate is (tokens - 1) / (last token - first token): load and prompt
   time are left out. Target: ratio >= 0.97.
2. **Conversion** of ``--convert`` models (default gemma3:270m Q4_K_M and the default model), each in a fresh
   process: wall time, peak memory (anonymous and file-backed RSS sampled every 50 ms: the GGUF is
   memory-mapped, its pages are file-backed and reclaimable), time per tensor type, output size vs the
   planner's estimate; then an estimate for a 7B Q4_K_M from those rates.
3. ``--agreement``: gemma3:270m's greedy continuation of 3 prompts, 32 tokens: MLX (policy ``mlx`` and
   ``faithful``) vs llama.cpp on the Q4_K_M file and on the F32 file llama.cpp's quantizer makes from it.
4. ``--runtime``: prefix reuse (TTFT turn 5 / turn 1, target <= 1.3) and the self-draft controller (never
   more than 5% slower than plain) on the MLX backend.

    python benchmarks/mlx_decode.py                        # decode (4 rounds × 48 tokens) + conversions
    python benchmarks/mlx_decode.py --agreement --runtime --json
    python benchmarks/mlx_decode.py --decode-model gemma3:270m --rounds 3

Metal is not available on the build machines (mlx[cpu] on Linux): every figure here is mlx's CPU
backend, ~7 tok/s for a 135M model. On Apple Silicon run the same command; conversions use float16
there (``--dtype float16``), as the planner assumes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import ROOT, ClockWriter, Side, engine_and_model, load_average, mean_std

PROMPT = ("The following is a long, detailed essay about the history of the bicycle, from the first "
          "draisine of 1817 to modern carbon racing frames.\n\n")


# ------------------------------------------------------------------------------------ 1. decode sides


class _Ours:
    """localllm's run path on an MLX directory (the engine loads it with --backend mlx)."""

    def __init__(self, model: str, mlx_dir: str, tokens: int, num_ctx: int):
        from localllm.formats import Weights
        from localllm.loader import LoadOptions

        self.engine, self.name, _ = engine_and_model(model)
        self.engine.store.set_weights(self.name, "mlx", Weights("mlx", Path(mlx_dir)))
        self.options = LoadOptions(num_ctx=num_ctx, draft="none", backend="mlx", kv_cache_type="f16")
        running = self.engine.load(self.name, self.options)
        assert running.backend == "mlx", running.backend
        self.tokens = tokens

    def run(self) -> float:
        from backends.contract.specs import GenerateRequest, Sampling
        from localllm.cli.answer import stream_answer

        req = GenerateRequest(prompt=PROMPT, sampling=Sampling(max_tokens=self.tokens, seed=0, temperature=0.0,
                                                               repeat_penalty=1.0))
        clock = ClockWriter()
        answer = stream_answer(self.engine, self.name, req, self.options, out=clock)
        n = answer.done.stats.eval_count
        assert clock.first is not None and clock.last is not None and n == self.tokens, n
        return (n - 1) / (clock.last - clock.first)

    def close(self) -> None:
        self.engine.close()


class _Raw:
    """mlx_lm.stream_generate on the same directory, greedy (mlx-lm's default sampler)."""

    def __init__(self, mlx_dir: str, tokens: int):
        import mlx_lm

        self.mlx_lm = mlx_lm
        self.model, self.tok = mlx_lm.load(mlx_dir)
        self.ids = self.tok.encode(PROMPT)
        self.tokens = tokens

    def run(self) -> float:
        first = last = 0.0
        n = 0
        for _ in self.mlx_lm.stream_generate(self.model, self.tok, self.ids, max_tokens=self.tokens):
            now = time.perf_counter()
            first = first or now
            last = now
            n += 1
        return (n - 1) / (last - first)


def decode(model: str, rounds: int, tokens: int, num_ctx: int) -> dict[str, Any]:
    from localllm.mlxmodels import convert_installed
    from localllm.store import Store

    installed = Store().ensure(model)
    mlx_dir = str(installed.weights_path("mlx") or convert_installed(installed))
    ours, raw = [], []
    with Side("localllm", _Ours, model=model, mlx_dir=mlx_dir, tokens=tokens, num_ctx=num_ctx) as a, \
            Side("mlx_lm", _Raw, mlx_dir=mlx_dir, tokens=tokens) as b:
        a.call()  # warm-up: first-call graph building on both sides
        b.call()
        for _ in range(rounds):
            ours.append(a.call())
            raw.append(b.call())
    ratio = statistics.fmean(ours) / statistics.fmean(raw)
    per_round = [o / r for o, r in zip(ours, raw, strict=True)]
    return {"model": model, "mlx_dir": mlx_dir, "tokens": tokens, "ours_tok_s": ours, "raw_tok_s": raw,
            "ratio": ratio, "per_round_ratio": per_round}


# ------------------------------------------------------------------------------------ 2. conversion

_CONVERT = r"""
import json, os, sys, threading, time
sys.path.insert(0, {root!r})
import backends.mlx.convert as mc
import mlx.core as mx

phase = ["start"]
peak = {{}}  # phase -> {{anon, file, rss}}
stop = threading.Event()
def sample():
    while not stop.wait(0.05):
        got = {{}}
        with open("/proc/self/status") as f:
            for line in f:
                key = {{"RssAnon": "anon", "RssFile": "file", "VmRSS": "rss"}}.get(line.split(":")[0])
                if key:
                    got[key] = int(line.split()[1]) * 1024
        p = peak.setdefault(phase[0], {{"anon": 0, "file": 0, "rss": 0}})
        for k, v in got.items():
            p[k] = max(p[k], v)
threading.Thread(target=sample, daemon=True).start()
seconds, by_type, info = {{}}, {{}}, {{}}
def timed(name, fn):
    def wrapper(*a, **kw):
        phase[0] = name
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0
    return wrapper
real_tensor = mc._convert_tensor
def tensor(g, t, cfg, dtype, policy="mlx"):
    t0 = time.perf_counter()
    out = real_tensor(g, t, cfg, dtype, policy)
    mx.eval(*out.arrays.values())
    s, b = by_type.get(t.tensor_type.name, (0.0, 0))
    by_type[t.tensor_type.name] = (s + time.perf_counter() - t0, b + int(t.n_bytes))
    return out
mc._convert_tensor = tensor
real_init = mc.GGUFFile.__init__
mc.GGUFFile.__init__ = timed("read GGUF header", real_init)
real_inspect = mc._inspect
def inspect(*a, **kw):
    info["x"] = real_inspect(*a, **kw)
    return info["x"]
mc._inspect = timed("check", inspect)
mc.write_tokenizer = timed("tokenizer", mc.write_tokenizer)
mc._write_weights = timed("weights", mc._write_weights)
t0 = time.perf_counter()
mc.convert_gguf({src!r}, {out!r}, dtype={dtype!r}, policy={policy!r})
wall = time.perf_counter() - t0
time.sleep(0.1)
stop.set()
written = sum(p.stat().st_size for p in mc.Path({out!r}).glob("model*.safetensors"))
allp = {{k: max(v[k] for v in peak.values()) for k in ("anon", "file", "rss")}}
print(json.dumps({{"seconds": wall, "phase_seconds": seconds, "phase_peak": peak, "peak": allp,
                  "by_type": by_type, "written": written, "estimated": info["x"].estimated_bytes,
                  "source": os.path.getsize({src!r}), "policy": info["x"].policy}}))
"""


def convert(model: str, dtype: str, policy: str) -> dict[str, Any]:
    from localllm.store import Store

    src = Store().ensure(model).path
    with tempfile.TemporaryDirectory(prefix="mlx-bench-") as d:
        code = _CONVERT.format(root=str(ROOT), src=str(src), out=str(Path(d) / "out"), dtype=dtype, policy=policy)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"conversion of {model} failed:\n{r.stderr[-3000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    res.update(model=model, dtype=dtype, policy_name=policy)
    return res


# A 7B Q4_K_M (bartowski/Qwen2.5-7B-Instruct-GGUF, 4.68 GB): Q4_K for most projections, Q6_K for half the
# ffn_down / attn_v and the output layer (llama.cpp's Q4_K_M recipe), F32 norms; vocabulary 152k + 151k merges.
SEVEN_B = {"Q4_K": 3.83e9, "Q6_K": 0.84e9, "F32": 0.01e9}
SEVEN_B_PARAMS = 7.62e9
SEVEN_B_VOCAB_ITEMS = 152_064 * 3 + 151_387  # tokens, types, scores-less BPE: + merges


def estimate_7b(conv: dict[str, Any], gemma_vocab_items: int = 262_144 * 3) -> dict[str, Any]:
    """From gemma3:270m's measured rates: tensor time per source byte by type, header and tokenizer time per
    vocabulary item (gguf's reader parses every token), memory per phase."""
    rates = {t: b / s for t, (s, b) in conv["by_type"].items() if s > 0}
    tensor_s = sum(b / rates.get(t, rates.get("Q4_K", 1e8)) for t, b in SEVEN_B.items())
    ph = conv["phase_seconds"]
    per_item = (ph.get("read GGUF header", 0.0) + ph.get("tokenizer", 0.0)) / gemma_vocab_items
    header_s = per_item * SEVEN_B_VOCAB_ITEMS
    # 4-bit g64 + 8-bit g64 with f32 scales/biases (the CPU default): 5 and 9 bits per weight
    q4_params = SEVEN_B["Q4_K"] * 8 / 4.5
    q6_params = SEVEN_B["Q6_K"] * 8 / 6.5625
    out = q4_params * (4 + 64 / 64) / 8 + q6_params * (8 + 64 / 64) / 8
    out_f16 = q4_params * (4 + 32 / 64) / 8 + q6_params * (8 + 32 / 64) / 8
    # anonymous memory in the weights phase: the reader (measured at its peak for gemma, scaled to the 7B's
    # vocabulary) + one shard (<= 1 GiB) + the tensor being requantized (float32 chunks of 16 Mi elements)
    pk = conv["phase_peak"]
    reader = pk.get("read GGUF header", {}).get("anon", 0) * SEVEN_B_VOCAB_ITEMS / gemma_vocab_items
    anon = reader + (1 << 30) + 4 * (1 << 24) * 4
    tok_phase = pk.get("tokenizer", {}).get("anon", 0) * SEVEN_B_VOCAB_ITEMS / gemma_vocab_items
    return {"seconds": tensor_s + header_s, "tensor_seconds": tensor_s, "header_seconds": header_s,
            "peak_anon_tokenizer_phase": tok_phase,
            "out_bytes_f32_scales": out, "out_bytes_f16_scales": out_f16, "peak_anon_bytes": anon,
            "file_backed_bytes": sum(SEVEN_B.values()), "rates_MB_s": {t: r / 1e6 for t, r in rates.items()}}


# ------------------------------------------------------------------------------------ 3. agreement


def agreement() -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    import llama_cpp

    from backends.mlx.convert import convert_gguf
    from localllm.store import Store
    from tests.backends.conftest import derive_gguf
    from tests.backends.test_mlx_convert import agreement as agree
    from tests.backends.test_mlx_convert import llama_greedy, mlx_greedy

    src = Path(Store().ensure("gemma3:270m").path)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="mlx-agree-") as d:
        f32 = Path(d) / "gemma-f32.gguf"
        derive_gguf(src, f32, "f32")
        dirs = {p: convert_gguf(src, Path(d) / p, policy=p) for p in ("mlx", "faithful")}
        vocab = llama_cpp.Llama(str(src), vocab_only=True, verbose=False)
        for prompt in ("The capital of France is", "def fibonacci(n):", "Once upon a time"):
            ids = vocab.tokenize(prompt.encode(), add_bos=True)
            lq, lf = llama_greedy(src, ids, 32), llama_greedy(f32, ids, 32)
            row = {"llama.cpp Q4_K_M vs llama.cpp F32": agree(lq, lf)}
            for p, dd in dirs.items():
                m = mlx_greedy(dd, ids, 32)
                row[f"MLX {p} vs llama.cpp Q4_K_M"] = agree(m, lq)
                row[f"MLX {p} vs llama.cpp F32"] = agree(m, lf)
            out[prompt] = row
        out["sizes"] = {p: sum(f.stat().st_size for f in dd.glob("model*.safetensors")) for p, dd in dirs.items()}
    return out


# ------------------------------------------------------------------------------------ 4. runtime


def runtime(model: str, tokens: int, num_ctx: int) -> dict[str, Any]:
    from backends.contract.events import TextChunk
    from backends.contract.specs import DraftSpec, GenerateRequest, LoadSpec, Sampling
    from backends.core.loop import LoadedModel
    from backends.registry import load
    from localllm.mlxmodels import convert_installed
    from localllm.store import Store

    m = Store().ensure(model)
    mlx_dir = str(m.weights_path("mlx") or convert_installed(m))
    greedy = dict(temperature=0.0, repeat_penalty=1.0)
    b = load("mlx", LoadSpec(model_path=mlx_dir, n_ctx=num_ctx))
    msgs = [{"role": "system", "content": "You are a helpful assistant."}]
    ttft, cached = [], []
    for q in ["What is the capital of France?", "And of Italy?", "Which one is bigger?", "Name a river in each.",
              "Thanks, summarise in one line."]:
        msgs.append({"role": "user", "content": q})
        t0, first, text = time.perf_counter(), None, ""
        for ev in b.generate(GenerateRequest(messages=msgs, sampling=Sampling(max_tokens=12, **greedy))):
            if isinstance(ev, TextChunk):
                first = first or time.perf_counter()
                text += ev.text
            else:
                cached.append((ev.stats.prompt_cached_tokens, ev.stats.prompt_eval_count))
        ttft.append((first or time.perf_counter()) - t0)
        msgs.append({"role": "assistant", "content": text})
    b.close()
    req = GenerateRequest(prompt=PROMPT, sampling=Sampling(max_tokens=tokens, **greedy))

    def rate(backend: LoadedModel) -> float:
        times = [(time.perf_counter(), ev.tokens) for ev in backend.generate(req) if isinstance(ev, TextChunk)]
        return sum(k for _, k in times[1:]) / (times[-1][0] - times[0][0])

    plain = load("mlx", LoadSpec(model_path=mlx_dir, n_ctx=num_ctx))
    spec = load("mlx", LoadSpec(model_path=mlx_dir, n_ctx=num_ctx, draft=DraftSpec(kind="model", path=mlx_dir)))
    plain_r, spec_r = [], []
    for _ in range(2):
        plain_r.append(rate(plain))
        spec_r.append(rate(spec))
    status = spec.controller.state() if spec.controller is not None else None
    plain.close()
    spec.close()
    return {"ttft_s": ttft, "ttft_turn5_over_turn1": ttft[-1] / ttft[0], "cached_tokens": cached,
            "draft": {"status": status, "plain_tok_s": plain_r, "draft_tok_s": spec_r,
                      "ratio": statistics.fmean(spec_r) / statistics.fmean(plain_r)}}


# ------------------------------------------------------------------------------------ main


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decode-model", default="smollm2:135m")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--num-ctx", type=int, default=2048)
    ap.add_argument("--convert", default="gemma3:270m,smollm2:135m", help="models to convert ('' for none)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    ap.add_argument("--policy", default="mlx", choices=["mlx", "faithful", "float"])
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--agreement", action="store_true")
    ap.add_argument("--runtime", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    result: dict[str, Any] = {"load_average_before": load_average(), "cpus": os.cpu_count()}
    if not args.no_decode:
        result["decode"] = decode(args.decode_model, args.rounds, args.tokens, args.num_ctx)
    convs = [convert(m, args.dtype, args.policy) for m in filter(None, args.convert.split(","))]
    result["convert"] = convs
    gem = next((c for c in convs if c["model"] == "gemma3:270m"), None)
    if gem:
        result["estimate_7b_q4_k_m"] = estimate_7b(gem)
    if args.agreement:
        result["agreement"] = agreement()
    if args.runtime:
        result["runtime"] = runtime(args.decode_model, args.tokens, args.num_ctx)
    result["load_average_after"] = load_average()
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"load average before: {result['load_average_before']}")
    if "decode" in result:
        d = result["decode"]
        print(f"decode {d['model']} ({d['tokens']} tokens): localllm {mean_std(d['ours_tok_s'])} tok/s vs "
              f"mlx_lm.stream_generate {mean_std(d['raw_tok_s'])} tok/s, ratio {d['ratio']:.3f} "
              f"(per round {', '.join(f'{r:.2f}' for r in d['per_round_ratio'])}; target >= 0.97)")
    for c in convs:
        rates = ", ".join(f"{t} {b / s / 1e6:.0f} MB/s" for t, (s, b) in sorted(c["by_type"].items()) if s)
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in c["phase_seconds"].items())
        print(f"convert {c['model']} ({_gb(c['source'])} GGUF, {c['dtype']}, policy {c['policy_name']}): "
              f"{c['seconds']:.1f} s ({phases}), peak RSS {_gb(c['peak']['rss'])} "
              f"(anonymous {_gb(c['peak']['anon'])}, file-backed {_gb(c['peak']['file'])}), wrote "
              f"{_gb(c['written'])} (estimate {_gb(c['estimated'])}); {rates}")
    if gem:
        e = result["estimate_7b_q4_k_m"]
        print(f"estimate, 7B Q4_K_M on this machine: {e['seconds'] / 60:.1f} min ({e['tensor_seconds']:.0f} s "
              f"tensors + {e['header_seconds']:.0f} s header and tokenizer), output "
              f"{_gb(e['out_bytes_f32_scales'])} with f32 scales / {_gb(e['out_bytes_f16_scales'])} with f16, "
              f"anonymous memory ~{_gb(e['peak_anon_bytes'])} + up to {_gb(e['file_backed_bytes'])} of the "
              f"mapped GGUF (file-backed, reclaimable)")
    if "agreement" in result:
        for prompt, row in result["agreement"].items():
            if prompt != "sizes":
                print(f"agreement {prompt!r}: " + ", ".join(f"{k} {v}/32" for k, v in row.items()))
        print("sizes " + ", ".join(f"{k} {_gb(v)}" for k, v in result["agreement"]["sizes"].items()))
    if "runtime" in result:
        r = result["runtime"]
        print("TTFT per turn  " + "  ".join(f"{t * 1000:.0f}ms" for t in r["ttft_s"])
              + f"   turn5/turn1 {r['ttft_turn5_over_turn1']:.2f} (target <= 1.3)")
        print(f"self-draft {r['draft']['status']}: ratio {r['draft']['ratio']:.3f} (target >= 0.95)")
    print(f"load average after: {result['load_average_after']}")


if __name__ == "__main__":
    main()
