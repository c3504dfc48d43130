"""MTP drafting (a GGUF's own multi-token-prediction layers) vs plain decoding, greedy, on made Qwen3.5 hybrids
with an MTP block (``tests/made_qwen35.py``, F32, 4 trunk layers + 1 MTP block, hidden size 64):

* ``random``: random MTP weights, its drafts are (almost) never accepted: MTP cannot pay, so this measures what
  it costs — by default (the adaptive guard) and forced on (``draft_always``: every step drafts);
* ``echo``: an MTP block that proposes the token it read, beside a trunk that tends to repeat it: drafts are
  accepted in part, as a trained head's are.

Each variant (plain, MTP by default, MTP forced) is loaded once in its own process (``_common.Side``) and the
rounds alternate between them; 1 stream (one request) and N streams (N requests at once, each its own slot: the
MTP drafts of all streams are made in one MTP evaluation and verified in the shared batch). Reported: tokens/s
(wall, all streams), the median per-round ratio to plain, the acceptance, whether the greedy text is identical
to plain, and the guard's reaction time (decode steps and tokens until it first switched drafting off).

    LOCALLLM_HOME=... python benchmarks/mtp.py --rounds 5 --tokens 256 --threads 1 --cpus 1
    python benchmarks/mtp.py --only random --streams 4

Targets: by default never slower than 0.95x plain over a model's life (README); MTP forced shows the cost of
one drafting step when nothing is accepted. The made model is tiny, so a drafting step's fixed costs (one more
llama.cpp evaluation per drafted token, in Python) weigh far more than on a real Qwen3.5, whose trunk is 64
layers beside its one MTP block.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from _common import Side, default_threads, engine_and_model, load_average, spread

PROMPTS = ["The capital of France is", "Once upon a time there was", "def fibonacci(n):", "1, 2, 3, 4, 5,"]


def made_model(kind: str, src: Path) -> Path:
    from localllm.config import paths
    from tests.made_qwen35 import write_qwen35

    out = paths().cache / "bench" / f"qwen35-mtp-{kind}-f32.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        write_qwen35(src, out, mtp=1, f32=True, echo=kind == "echo")
    return out


class Variant:
    """One loaded model in its own process; ``run`` answers ``streams`` requests at once."""

    def __init__(self, path: str, mode: str, threads: int, tokens: int, slots: int, cpus: list[int] | None = None):
        if cpus:  # before any thread starts: the decode thread and llama.cpp's inherit it
            os.sched_setaffinity(0, cpus)
        from backends.contract.specs import DraftSpec, LoadSpec, Tuning
        from backends.core.loop import LoadedModel
        from backends.llamacpp.source import LlamaCppSource

        draft = None if mode == "plain" else DraftSpec("mtp", auto=False)
        self.model = LoadedModel(LlamaCppSource, LoadSpec(path, n_ctx=1024, slots=slots, n_threads=threads,
                                                          draft=draft, tuning=Tuning(draft_always=mode == "forced")))
        self.tokens = tokens
        self.run(1, warm=True)

    def run(self, streams: int, warm: bool = False) -> dict[str, Any]:
        from backends.contract.events import Done, TextChunk
        from backends.contract.specs import GenerateRequest, Sampling

        texts: list[str] = [""] * streams
        dones: list[Any] = [None] * streams
        n = 4 if warm else self.tokens

        def one(i: int) -> None:
            req = GenerateRequest(prompt=PROMPTS[i % len(PROMPTS)],
                                  sampling=Sampling(temperature=0.0, max_tokens=n, repeat_penalty=1.0))
            for ev in self.model.generate(req):
                if isinstance(ev, TextChunk):
                    texts[i] += ev.text
                elif isinstance(ev, Done):
                    dones[i] = ev

        t0 = time.perf_counter()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        toks = sum(d.stats.eval_count for d in dones)
        ctl = self.model.controller if streams == 1 else self.model.wide_controllers.get(streams)
        return {"tok_s": toks / wall, "texts": texts, "tokens": toks,
                "proposed": sum(d.stats.draft_proposed for d in dones),
                "accepted": sum(d.stats.draft_accepted for d in dones),
                "controller": ctl.state() if ctl is not None else None}

    def close(self) -> None:
        self.model.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2:135m", help="the default model (its tokenizer is the made model's)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per stream per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--streams", type=int, default=4, help="the concurrent case (1 stream is always measured)")
    ap.add_argument("--threads", type=int, default=None, help="default: physical cores (the backend's default)")
    ap.add_argument("--only", choices=["random", "echo"], default=None)
    ap.add_argument("--cpus", default=None,
                    help="pin every side's process to these CPUs (e.g. 1 or 0,1): where the OS places a process "
                         "moves its speed by about 5%% on this tiny model, more than the differences measured")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    threads = args.threads or default_threads()
    cpus = [int(c) for c in args.cpus.split(",")] if args.cpus else None
    _engine, _name, src = engine_and_model(args.model)
    _engine.close()
    kinds = [args.only] if args.only else ["random", "echo"]
    print(f"load average at start: {load_average()}; {threads} threads, {args.tokens} tokens a stream, "
          f"{args.rounds} rounds{f', pinned to CPUs {cpus}' if cpus else ''}", flush=True)
    report = []
    for kind in kinds:
        path = str(made_model(kind, src))
        for streams in (1, args.streams):
            sides: dict[str, Side] = {}
            try:
                for mode in ("plain", "default", "forced"):
                    sides[mode] = Side(f"{kind}/{mode}/{streams}", Variant, path=path, mode=mode, threads=threads,
                                       tokens=args.tokens, slots=max(streams, 1), cpus=cpus)
                runs: dict[str, list[dict[str, Any]]] = {k: [] for k in sides}
                order = list(sides)
                for r in range(args.rounds):
                    rot = order[r % len(order):] + order[: r % len(order)]
                    for mode in rot:
                        runs[mode].append(sides[mode].call("run", streams=streams))
                    print(f"{kind} x{streams} round {r + 1}: " + "   ".join(
                        f"{m} {runs[m][-1]['tok_s']:6.1f}" for m in order) + " tok/s", flush=True)
            finally:
                for side in sides.values():
                    side.close()
            plain = runs["plain"]
            for mode, rs in runs.items():
                ratios = [x["tok_s"] / p["tok_s"] for x, p in zip(rs, plain, strict=True)]
                prop, acc = sum(x["proposed"] for x in rs), sum(x["accepted"] for x in rs)
                same = all(x["texts"] == plain[0]["texts"] for x in rs)
                ctl = rs[-1]["controller"]
                row = {"model": kind, "streams": streams, "mode": mode, "tok_s": [x["tok_s"] for x in rs],
                       "ratios": ratios, "ratio_median": statistics.median(ratios), "proposed": prop,
                       "acceptance": acc / prop if prop else None, "identical": same, "controller": ctl}
                report.append(row)
                acc_s = f"{acc / prop:.0%}" if prop else "-"
                print(f"{kind:6} x{streams} {mode:7} median {statistics.median(row['tok_s']):7.1f} tok/s  "
                      f"x{spread(ratios)} of plain (median x{row['ratio_median']:.3f}, round 1 x{ratios[0]:.2f})  "
                      f"proposed {prop:5d} accepted {acc_s:>4}  {'identical' if same else 'DIFFERENT TEXT'}",
                      flush=True)
                if ctl:
                    print(f"        guard: first off at {ctl['first_off']}; probes {ctl['probes']} "
                          f"(lost {ctl['lost_probes']}); drafted {ctl['drafted_tokens']} tokens; cost by its own "
                          f"accounting {ctl['cost_vs_plain']}; mode now {ctl['mode']}", flush=True)
    print(f"load average at end: {load_average()}")
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
