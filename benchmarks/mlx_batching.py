"""MLX slots (issue 11): B concurrent requests through localllm's MLX backend, batched (one pass per step over
mlx-lm's ``BatchKVCache``) and taking turns (one pass per sequence), against mlx-lm's own
``batch_generate`` (its ``BatchGenerator``) on the same weights and prompts.

    python benchmarks/mlx_batching.py                      # B = 1,4; 2 rounds; 32 generated tokens
    python benchmarks/mlx_batching.py --batches 1,4,8 --gen 64 --rounds 3

Each side lives in its own process (``_common.Side``), called in turn each round. Every stream generates
``--gen`` tokens (end-of-generation tokens are banned, as in ``batching.py``), greedy. Total tok/s = (prompt
+ generated tokens) / wall time from the first request to the last token. On the build machines this is
mlx's CPU backend, where a quantized matrix product costs nearly the same per row at any batch size, so
batching gains little here; on Apple Silicon decoding is memory-bound and a batch costs about one pass.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from _common import Side, engine_and_model, load_average, run_together
from _serve import med, story_prompt


def _mlx_dir(model: str) -> str:
    from localllm.mlxmodels import convert_installed

    engine, name, _ = engine_and_model(model)
    try:
        return str(convert_installed(engine.store.get(name)))
    finally:
        engine.close()


class Ours:
    """localllm's MLX backend on its decode loop, ``batched`` or taking turns."""

    def __init__(self, model: str, slots: int, batched: bool):
        from backends.contract.specs import LoadSpec, Tuning
        from backends.mlx.source import MLXSource
        from backends.registry import load

        self.m = load("mlx", LoadSpec(model_path=_mlx_dir(model), n_ctx=1024, slots=slots,
                                      tuning=Tuning(batch=batched)))
        src = self.m.source
        assert isinstance(src, MLXSource)
        self.src = src
        self.eog = [t for t in range(self.m.info.n_vocab) if src.is_eog(t)]

    def run(self, prompts: list[str], gen: int) -> dict[str, Any]:
        from backends.contract.events import Done
        from backends.contract.specs import GenerateRequest, Sampling

        counts = [(0, 0)] * len(prompts)

        def work(i: int) -> None:
            req = GenerateRequest(prompt=prompts[i], sampling=Sampling(
                temperature=0.0, repeat_penalty=1.0, max_tokens=gen, logit_bias={t: -100.0 for t in self.eog}))
            for ev in self.m.generate(req):
                if isinstance(ev, Done):
                    counts[i] = (ev.stats.prompt_eval_count, ev.stats.eval_count)

        wall = run_together(work, len(prompts))
        return {"total": sum(a + b for a, b in counts) / wall, "generated": sum(b for _, b in counts),
                "batched_steps": self.src.batched_steps}


class MlxLm:
    """mlx-lm's ``batch_generate`` (``BatchGenerator``) on the same weights."""

    def __init__(self, model: str):
        import mlx_lm

        self.model, self.tok = mlx_lm.load(_mlx_dir(model))

    def run(self, prompts: list[str], gen: int) -> dict[str, Any]:
        import mlx.core as mx
        from mlx_lm.generate import batch_generate

        ids = [list(self.tok.encode(p)) for p in prompts]
        eos = mx.array(list(self.tok.eos_token_ids))

        def no_eos(_tokens: Any, logits: Any) -> Any:
            return logits.at[..., eos].add(-100.0)

        t0 = time.perf_counter()
        r = batch_generate(self.model, self.tok, ids, max_tokens=gen, logits_processors=[no_eos],
                           return_token_ids=True)
        wall = time.perf_counter() - t0
        generated = sum(len(t) for t in r.token_ids)
        return {"total": (sum(len(i) for i in ids) + generated) / wall, "generated": generated}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    slots = max(batches)
    print(f"model {args.model} on MLX ({args.gen} tokens per stream); load average {load_average()}", flush=True)
    sides = {"batched": Side("localllm batched", Ours, model=args.model, slots=slots, batched=True),
             "turns": Side("localllm taking turns", Ours, model=args.model, slots=slots, batched=False),
             "mlx_lm": Side("mlx-lm batch_generate", MlxLm, model=args.model)}
    res: dict[str, dict[int, list[float]]] = {k: {b: [] for b in batches} for k in sides}
    serial = 0
    try:
        for k in range(args.rounds):
            for b in batches:
                prompts = []
                for _ in range(b):
                    serial += 1
                    prompts.append(story_prompt(serial))
                order = list(sides) if k % 2 == 0 else list(reversed(sides))
                line = []
                for name in order:
                    out = sides[name].call("run", prompts=prompts, gen=args.gen)
                    res[name][b].append(out["total"])
                    line.append(f"{name} {out['total']:.1f}")
                print(f"round {k + 1} B={b}: " + ", ".join(line) + f" tok/s   (load {load_average()})", flush=True)
    finally:
        for s in sides.values():
            s.close()
    print("\n  B   batched   taking turns   mlx-lm batch_generate   batched / mlx-lm   batched / turns")
    for b in batches:
        m = {k: med(res[k][b]) for k in res}
        print(f"{b:>3}   {m['batched']:>7.1f}   {m['turns']:>12.1f}   {m['mlx_lm']:>21.1f}   "
              f"{m['batched'] / m['mlx_lm']:>16.3f}   {m['batched'] / m['turns']:>15.3f}")
    if args.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
