"""Speculative decoding vs plain decoding at temperature 0, through the engine (the `localllm run` path).

* target F32 (the default model requantized with llama.cpp's quantizer) with the Q4_1 default model as
  draft (same vocabulary), and with n-gram (prompt-lookup) drafting;
* target Q4_1 with n-gram drafting (quantized kernels are not batch-invariant, so agreement with plain
  decoding is reported rather than assumed), and with itself as the draft model: every drafted token costs
  as much as a plain step, so that draft can never pay; it shows the controller's back-off.

Every variant (plain included) is loaded once in its own process, and the rounds alternate between them
(plain, draft, n-gram, plain, ..., the order rotating each round) so that the load of a shared machine hits
all alike; a variant's speed-up is the median of its per-round ratios to plain in the same round, with the
spread (min–max) of those ratios and the ratio of medians beside it. Two figures that another job's load
disturbs less: tokens per second of the process's CPU time (with one thread, the work done), and the
controller's own accounting (each drafting step against the plain steps it interleaves, same seconds).
The adaptive controller keeps its state for as long as the model is loaded, as in `localllm serve`;
round 1 is the first request after loading (the controller has not measured anything yet) and is also
shown on its own.

The prompt asks the model to repeat a text with small edits, so the answer repeats the prompt (the case
n-gram drafting is for). ``--prompt story`` asks for a free story instead (nothing to copy: n-gram drafting
cannot pay, which is where the controller's back-off shows).

    python benchmarks/speculative.py --num-draft 8 --tokens 200 --rounds 5
    python benchmarks/speculative.py --only f32 --rounds 7 --threads 2
    python benchmarks/speculative.py --only q4 --prompt story --rounds 7

Targets: never more than 5% slower than plain (README); model draft > 1x where it can pay; n-gram >= 1.5x
on repeated text. Reference: llama.cpp's speculative example on the F32/Q4_1 pair, 2 threads, greedy,
8 draft tokens: 54.8 tok/s against 50.3 tok/s plain (1.09x, 98% accepted).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from _common import ClockWriter, Side, default_threads, derived_model, engine_and_model, load_average, spread

TEXT = (
    "The quick brown fox jumps over the lazy dog. Every morning the fox runs through the forest, past the old "
    "mill and the river, until it reaches the meadow where the dog sleeps in the sun. The dog never wakes up, "
    "and the fox never stops running. Farmers in the village say that this has happened every day for years, "
    "and that nobody knows why the fox is in such a hurry or why the dog is so tired."
)
PROMPTS = {
    "repeat": f"Repeat the following text exactly, but replace the word 'fox' with 'cat':\n\n{TEXT}",
    "story": "Write a long story about a dragon who learns to bake bread.",
}


def common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Variant:
    """One loaded target (+ draft) in its own process; ``run`` answers the benchmark request once."""

    def __init__(self, model: str, target: str, draft: str, num_draft: int, threads: int, prompt: str,
                 tokens: int):
        from localllm.api import GenerateRequest, Sampling
        from localllm.cli.answer import stream_answer
        from localllm.loader import LoadOptions

        self.engine, _, _ = engine_and_model(model)
        self.target = target
        self.options = LoadOptions(num_ctx=2048, draft=draft, num_draft=num_draft, num_thread=threads)
        self.running = self.engine.load(target, self.options)
        sampling = Sampling(temperature=0.0, seed=0, max_tokens=tokens, repeat_penalty=1.0)
        self.request = GenerateRequest(messages=[{"role": "user", "content": PROMPTS[prompt]}], sampling=sampling)
        warm = GenerateRequest(prompt="Hello", sampling=Sampling(max_tokens=4))
        stream_answer(self.engine, target, warm, self.options)

    def run(self) -> dict[str, Any]:
        from localllm.cli.answer import stream_answer

        clock = ClockWriter()
        cpu0 = time.process_time()
        ans = stream_answer(self.engine, self.target, self.request, self.options, out=clock)
        cpu = time.process_time() - cpu0
        s = ans.done.stats
        wall = (s.eval_count - 1) / (clock.last - clock.first) if clock.last and clock.first else 0.0
        ctl = self.running.model.controller  # the decode loop's speculative-decoding controller (None: plain)
        return {"rate": s.eval_rate, "wall": wall, "cpu_rate": s.eval_count / cpu if cpu > 0 else 0.0,
                "text": ans.text, "tokens": s.eval_count,
                "proposed": s.draft_proposed, "accepted": s.draft_accepted,
                "controller": ctl.state() if ctl is not None else None}

    def close(self) -> None:
        self.engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2:135m", help="the Q4_1 default model (name or path)")
    ap.add_argument("--num-draft", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="default: physical cores (the backend's default)")
    ap.add_argument("--prompt", choices=sorted(PROMPTS), default="repeat")
    ap.add_argument("--only", choices=["f32", "q4"], default=None, help="one target only")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    threads = args.threads or default_threads()

    _engine, _name, q4_path = engine_and_model(args.model)
    del _engine
    f32_path = derived_model(q4_path, "F32")
    groups = [("F32", str(f32_path), [("none", "none"), ("Q4_1 draft", str(q4_path)), ("ngram", "ngram")]),
              ("Q4_1", str(q4_path), [("none", "none"), ("ngram", "ngram"), ("self-draft", str(q4_path))])]
    if args.only:
        groups = [g for g in groups if g[0].lower().startswith(args.only[:2])]
    print(f"load average at start: {load_average()}; {threads} threads, {args.tokens} tokens, prompt "
          f"{args.prompt!r}, num_draft {args.num_draft}, {args.rounds} rounds", flush=True)
    report = []
    for label, target, drafts in groups:
        sides = {}
        try:
            for dlabel, draft in drafts:
                sides[dlabel] = Side(f"{label}/{dlabel}", Variant, model=args.model, target=target, draft=draft,
                                     num_draft=args.num_draft, threads=threads, prompt=args.prompt,
                                     tokens=args.tokens)
            runs: dict[str, list[dict[str, Any]]] = {k: [] for k in sides}
            order = list(sides)
            for r in range(args.rounds):
                rot = order[r % len(order):] + order[: r % len(order)]
                for dlabel in rot:
                    runs[dlabel].append(sides[dlabel].call("run"))
                print(f"{label} round {r + 1}: " + "   ".join(
                    f"{d} {runs[d][-1]['wall']:6.1f}" for d in order) + " tok/s (wall)", flush=True)
        finally:
            for side in sides.values():
                side.close()
        plain = runs["none"]
        for dlabel, rs in runs.items():
            walls = [x["wall"] for x in rs]
            ratios = [x["wall"] / p["wall"] for x, p in zip(rs, plain, strict=True)]
            stats_ratios = [x["rate"] / p["rate"] for x, p in zip(rs, plain, strict=True)]
            cpu_ratios = [x["cpu_rate"] / p["cpu_rate"] for x, p in zip(rs, plain, strict=True)]
            later = ratios[1:] or ratios
            prop = sum(x["proposed"] for x in rs)
            acc = sum(x["accepted"] for x in rs)
            same = all(x["text"] == plain[0]["text"] for x in rs)
            agree = min(common_prefix(x["text"], plain[0]["text"]) for x in rs)
            row = {"target": label, "draft": dlabel, "wall_tok_s": walls, "stats_tok_s": [x["rate"] for x in rs],
                   "ratios": ratios, "stats_ratios": stats_ratios, "cpu_ratios": cpu_ratios,
                   "speedup_median": statistics.median(ratios),
                   "speedup_of_medians": statistics.median(walls) / statistics.median(x["wall"] for x in plain),
                   "acceptance": acc / prop if prop else None, "proposed": prop, "identical": same,
                   "agree_chars": agree, "chars": len(plain[0]["text"]), "controller": rs[-1]["controller"]}
            report.append(row)
            acc_s = f"{acc / prop:.0%}" if prop else "  - "
            verdict = "identical" if same else f"first {agree}/{len(plain[0]['text'])} chars agree"
            print(f"{label:5} {dlabel:11} median {statistics.median(walls):6.1f} tok/s   x{spread(ratios)} "
                  f"(round 1 x{ratios[0]:.2f}, later rounds x{statistics.median(later):.3f}, ratio of medians "
                  f"x{row['speedup_of_medians']:.3f})   proposed {prop:5d} accepted {acc_s:>4}   {verdict}",
                  flush=True)
            if rs[-1]["controller"]:
                ctl = rs[-1]["controller"]
                print(f"      per CPU second (tokens / process CPU time): x{spread(cpu_ratios)}; by the controller's "
                      f"own accounting: drafting steps made {ctl['drafted_tokens']} tokens and cost "
                      f"{ctl['cost_vs_plain']} against plain decoding")
                print(f"      controller after the last round: {ctl}")
    print(f"load average at end: {load_average()}")
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
