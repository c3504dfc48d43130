"""MLX backend benchmarks on the default model, converted offline from its GGUF (mlx[cpu] on Linux).

1. Decode tokens/s: localllm's `run` path (engine + MLX backend + the streaming writer of `localllm run`)
   against raw ``mlx_lm.stream_generate`` on the same MLX directory, interleaved (ours, raw, ours, raw...)
   in one process. Greedy, no penalties on both sides; each side's rate is the wall-clock rate between its
   first and its last token, so load and prompt time are left out. Target: ratio >= 0.95.
2. Prefix reuse: a 5-turn chat on a fresh backend; time to first token of turn 5 vs turn 1 (cold).
   Target: <= 1.3.
3. Speculative decoding with a self-draft (adaptive, as loaded by default) vs plain: never more than 5%
   slower (on mlx's CPU backend the controller turns drafting off at load: it cannot pay there).

    python benchmarks/mlx_decode.py                   # 3 rounds of 48 tokens (MLX on CPU is ~7 tok/s)
    python benchmarks/mlx_decode.py --tokens 96 --rounds 5 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from _common import ClockWriter, engine_and_model, mean_std

PROMPT = ("The following is a long, detailed essay about the history of the bicycle, from the first "
          "draisine of 1817 to modern carbon racing frames.\n\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-ctx", type=int, default=2048)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import mlx_lm

    from backends.base import DraftSpec, GenerateRequest, LoadSpec, Sampling, TextChunk
    from backends.mlx import MLXBackend
    from localllm.commands.run import stream_answer
    from localllm.engine import LoadOptions
    from localllm.mlxmodels import convert_installed

    engine, name, _ = engine_and_model(args.model)
    mlx_dir = convert_installed(engine.store.get(name))
    engine.store.set_mlx_path(name, mlx_dir)
    options = LoadOptions(num_ctx=args.num_ctx, draft="none", backend="mlx", kv_cache_type="f16")
    running = engine.load(name, options)
    assert running.backend.name == "mlx", running.backend.name
    sampling = dict(temperature=0.0, repeat_penalty=1.0)

    model, tok = mlx_lm.load(str(mlx_dir))
    raw_ids = tok.encode(PROMPT)

    def ours() -> float:
        req = GenerateRequest(prompt=PROMPT, sampling=Sampling(max_tokens=args.tokens, seed=0, **sampling))
        clock = ClockWriter()
        answer = stream_answer(engine, name, req, options, out=clock)
        n = answer.done.stats.eval_count
        assert clock.first is not None and clock.last is not None
        return (n - 1) / (clock.last - clock.first)

    def raw() -> float:
        first = last = None
        n = 0
        for _ in mlx_lm.stream_generate(model, tok, raw_ids, max_tokens=args.tokens):
            now = time.perf_counter()
            first = first or now
            last = now
            n += 1
        return (n - 1) / (last - first)

    ours_r, raw_r = [], []
    for _ in range(args.rounds):
        ours_r.append(ours())
        raw_r.append(raw())
    ratio = statistics.fmean(ours_r) / statistics.fmean(raw_r)
    engine.close()

    # 2. multi-turn TTFT on a fresh backend (turn 1 is cold)
    b = MLXBackend(LoadSpec(model_path=str(mlx_dir), n_ctx=args.num_ctx))
    msgs = [{"role": "system", "content": "You are a helpful assistant."}]
    questions = ["What is the capital of France?", "And of Italy?", "Which one is bigger?",
                 "Name a river in each.", "Thanks, summarise in one line."]
    ttft, cached = [], []
    for q in questions:
        msgs.append({"role": "user", "content": q})
        t0 = time.perf_counter()
        first = None
        text = ""
        for ev in b.generate(GenerateRequest(messages=msgs, sampling=Sampling(max_tokens=12, **sampling))):
            if isinstance(ev, TextChunk):
                first = first or time.perf_counter()
                text += ev.text
            else:
                cached.append((ev.stats.prompt_cached_tokens, ev.stats.prompt_eval_count))
        ttft.append((first or time.perf_counter()) - t0)
        msgs.append({"role": "assistant", "content": text})
    b.close()

    # 3. self-draft (adaptive) vs plain, same request
    req = GenerateRequest(prompt=PROMPT, sampling=Sampling(max_tokens=args.tokens, **sampling))

    def rate(backend: MLXBackend) -> float:
        times = []
        for ev in backend.generate(req):
            if isinstance(ev, TextChunk):
                times.append((time.perf_counter(), ev.tokens))
        n = sum(k for _, k in times[1:])
        return n / (times[-1][0] - times[0][0])

    plain = MLXBackend(LoadSpec(model_path=str(mlx_dir), n_ctx=args.num_ctx))
    spec = MLXBackend(LoadSpec(model_path=str(mlx_dir), n_ctx=args.num_ctx,
                               draft=DraftSpec(kind="model", path=str(mlx_dir))))
    status = spec.info.extra["draft_status"]
    plain_r, spec_r = [], []
    for _ in range(max(2, args.rounds - 1)):
        plain_r.append(rate(plain))
        spec_r.append(rate(spec))
    plain.close()
    spec.close()

    result = {
        "decode_tok_s": {"ours": ours_r, "raw_mlx_lm": raw_r, "ratio": ratio},
        "ttft_s": ttft, "ttft_turn5_over_turn1": ttft[-1] / ttft[0], "cached_tokens": cached,
        "draft": {"status": status, "plain_tok_s": plain_r, "draft_tok_s": spec_r,
                  "ratio": statistics.fmean(spec_r) / statistics.fmean(plain_r)},
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"decode tok/s   ours {mean_std(ours_r)}   raw mlx_lm.stream_generate {mean_std(raw_r)}   "
          f"ratio {ratio:.3f} (target >= 0.95)")
    print("TTFT per turn  " + "  ".join(f"{t * 1000:.0f}ms" for t in ttft)
          + f"   turn5/turn1 {ttft[-1] / ttft[0]:.2f} (target <= 1.3)")
    print("cached/prompt  " + "  ".join(f"{c}/{p}" for c, p in cached))
    print(f"self-draft     {status}: draft {mean_std(spec_r)} vs plain {mean_std(plain_r)} tok/s, "
          f"ratio {result['draft']['ratio']:.3f} (target >= 0.95)")


if __name__ == "__main__":
    main()
