"""Speculative decoding vs plain decoding at temperature 0, through the engine (the `localllm run` path).

* target F32 (the default model requantized with llama.cpp's quantizer) with the Q4_1 default model as
  draft (same vocabulary), and with n-gram (prompt-lookup) drafting;
* target Q4_1 with n-gram drafting (quantized kernels are not batch-invariant, so agreement with plain
  decoding is reported rather than assumed).

The prompt asks the model to repeat a text with small edits, so the answer repeats the prompt (the case
n-gram drafting is for). For each variant: tokens/s (backend stats and wall clock), speed-up over
plain, acceptance rate, and whether the text is identical to plain decoding (else the first
differing character).

    python benchmarks/speculative.py --num-draft 8 --tokens 200 --rounds 3

Reference: llama.cpp's own speculative example on the F32/Q4_1 pair, 2 threads, greedy, 8 draft tokens:
54.8 tok/s against 50.3 tok/s plain (1.09x, 98% accepted). N-gram on repeated text: aim >= 1.5x.
"""

from __future__ import annotations

import argparse
import json
import statistics

from _common import ClockWriter, derived_model, engine_and_model, mean_std

TEXT = (
    "The quick brown fox jumps over the lazy dog. Every morning the fox runs through the forest, past the old "
    "mill and the river, until it reaches the meadow where the dog sleeps in the sun. The dog never wakes up, "
    "and the fox never stops running. Farmers in the village say that this has happened every day for years, "
    "and that nobody knows why the fox is in such a hurry or why the dog is so tired."
)
PROMPT = f"Repeat the following text exactly, but replace the word 'fox' with 'cat':\n\n{TEXT}"


def common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2:135m", help="the Q4_1 default model (name or path)")
    ap.add_argument("--num-draft", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from localllm.commands.run import stream_answer
    from localllm.engine import GenerateRequest, LoadOptions, Sampling

    engine, name, q4_path = engine_and_model(args.model)
    f32_path = derived_model(q4_path, "F32")
    sampling = Sampling(temperature=0.0, seed=0, max_tokens=args.tokens, repeat_penalty=1.0)
    request = GenerateRequest(messages=[{"role": "user", "content": PROMPT}], sampling=sampling)

    def measure(target: str, draft: str) -> dict:
        options = LoadOptions(num_ctx=2048, draft=draft, num_draft=args.num_draft, num_thread=args.threads)
        for running in engine.ps():
            engine.unload(running.name)
        engine.load(target, options)
        stream_answer(engine, target, GenerateRequest(prompt="Hello", sampling=Sampling(max_tokens=4)), options)
        rates, walls, text, prop, acc = [], [], "", 0, 0
        for _ in range(args.rounds):
            clock = ClockWriter()
            ans = stream_answer(engine, target, request, options, out=clock)
            s = ans.done.stats
            rates.append(s.eval_rate)
            walls.append((s.eval_count - 1) / (clock.last - clock.first) if clock.last and clock.first else 0.0)
            text, prop, acc = ans.text, prop + s.draft_proposed, acc + s.draft_accepted
        return {"target": target, "draft": draft, "rates": rates, "walls": walls, "text": text,
                "eval_count": s.eval_count, "proposed": prop, "accepted": acc}

    targets = [("F32", str(f32_path), [("none", "none"), ("Q4_1 draft", str(q4_path)), ("ngram", "ngram")]),
               ("Q4_1", str(q4_path), [("none", "none"), ("ngram", "ngram")])]
    report = []
    for label, target, drafts in targets:
        plain = None
        for dlabel, draft in drafts:
            r = measure(target, draft)
            if plain is None:
                plain = r
            speed = statistics.fmean(r["rates"]) / statistics.fmean(plain["rates"])
            same = r["text"] == plain["text"]
            agree = common_prefix(r["text"], plain["text"])
            accept = r["accepted"] / r["proposed"] if r["proposed"] else None
            row = {"target": label, "draft": dlabel, "tok_s": statistics.fmean(r["rates"]),
                   "wall_tok_s": statistics.fmean(r["walls"]), "speedup": speed, "acceptance": accept,
                   "identical": same, "agree_chars": agree, "chars": len(plain["text"]),
                   "tokens": r["eval_count"]}
            report.append(row)
            acc_s = f"{accept:.0%}" if accept is not None else "  - "
            verdict = "identical" if same else f"first {agree}/{len(plain['text'])} chars agree"
            print(f"{label:5} {dlabel:11} {mean_std(r['rates']):>16} tok/s  (wall {mean_std(r['walls'])})  "
                  f"x{speed:.2f}  accepted {acc_s:>4}  "
                  f"{verdict}", flush=True)
    if args.json:
        print(json.dumps(report))
    engine.close()


if __name__ == "__main__":
    main()
