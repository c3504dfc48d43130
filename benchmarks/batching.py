"""Continuous batching (issue 11): B concurrent official-openai-client streams against ``localllm serve`` vs
llama.cpp's ``llama-batched-bench`` on the same GGUF file and threads, and one stream vs ``llama-bench``.

    python benchmarks/batching.py                          # default model, B = 1,4,8, 3 rounds
    python benchmarks/batching.py --rounds 5 --threads 2 --batches 1,4,8 --json

Per round (the order of the two sides alternates from round to round, each side in its own process):

* ``llama-batched-bench -npp 32 -ntg 128 -npl 1,4,8 -fa auto -t T -c 4096`` (its defaults: one KV stream per
  sequence; ``--kvu`` adds a run with its unified KV cache, the layout our pool uses): total tokens/s S =
  (prompt + generated tokens) / time;
* ``localllm serve`` (``LOCALLLM_NUM_PARALLEL`` = the largest B, so slots >= B; one server for the whole
  run): B streams through ``/v1/completions`` at once, each a distinct raw 32-token prompt (nothing shared,
  nothing cached from an earlier round) and ``max_tokens`` 128 at temperature 0.8, the end-of-generation tokens
  kept out with ``logit_bias`` -100 so that every stream runs its 128 tokens as llama.cpp's tools do
  (``--allow-eos``: streams may stop early and count their real tokens); total tokens/s = (prompt +
  completion tokens, from each stream's usage) / wall time from the first request sent to the last stream's end;
* ``llama-bench -n 128 -p 0 -fa auto -r 1``: tg128, the single-stream ceiling, beside our B = 1 stream's
  decode rate (its tokens after the first / the time between the first and the last);
* with ``--in-process``, the same B requests straight into the engine (``Engine.generate`` from B threads,
  no HTTP, no client: the decode loop's own rate) in a third process, to tell the loop's cost from the
  server's and the clients'.

Targets: total ≥ 0.9× llama-batched-bench at B = 4, ≥ 0.85× at B = 8; one stream's decode ≥ 0.97× tg128.
The clients run in this process (asyncio, one connection per stream), so on a 2-core machine they compete
with the server like a real client on the same machine would.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import _serve
from _common import Side, default_threads, engine_and_model, load_average, run_together
from _serve import Localllm, Tokens, med, model_path, story_prompt, stream


def batched_bench(path: Any, threads: int, batches: list[int], prompt: int, gen: int,
                  unified: bool) -> dict[int, float]:
    import llama_tools

    recs = llama_tools.llama_batched_bench(path, threads=threads, n_prompt=prompt, n_gen=gen, parallel=tuple(batches),
                                           n_ctx=4096, flash_attn="auto", extra=["-kvu"] if unified else None)
    return {int(r["pl"]): float(r["speed"]) for r in recs}


def tg(path: Any, threads: int, gen: int) -> float:
    import llama_tools

    recs = llama_tools.llama_bench(path, threads=threads, flash_attn="auto", n_prompt=0, n_gen=gen, reps=1)
    return float(recs[0]["avg_ts"])


async def ours_round(url: str, model: str, prompts: list[str], gen: int, extra: dict[str, Any]) -> dict[str, Any]:
    client = _serve.async_client(url)
    try:
        t0 = time.perf_counter()
        rs = await asyncio.gather(*(stream(client, model, prompt=p, max_tokens=gen, temperature=0.8, seed=1000 + i,
                                           extra_body=extra) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - t0
    finally:
        await client.close()
    errors = [r.error for r in rs if r.error]
    ptoks = sum(r.prompt_tokens for r in rs)
    ctoks = sum(r.completion_tokens for r in rs)
    return {"total": (ptoks + ctoks) / wall, "wall": wall, "prompt_tokens": ptoks, "completion_tokens": ctoks,
            "errors": errors, "decode": med([r.decode_rate for r in rs]), "ttft": med([r.ttft for r in rs]),
            "short": sum(1 for r in rs if r.completion_tokens < gen)}


class InProc:
    """The engine and its decode loop without the server: B threads each consume ``Engine.generate``."""

    def __init__(self, model: str, threads: int, num_ctx: int, slots: int):
        from localllm.loader import LoadOptions

        self.engine, self.name, _ = engine_and_model(model)
        self.options = LoadOptions(num_ctx=num_ctx, num_thread=threads, num_parallel=slots)
        self.engine.load(self.name, self.options)
        self.run(["Hello there", "Once upon a time"], 8)  # warm-up, as the server gets

    def run(self, prompts: list[str], gen: int, logit_bias: dict[int, float] | None = None) -> dict[str, Any]:
        from localllm.api import Done, GenerateRequest, Sampling

        counts: list[tuple[int, int]] = [(0, 0)] * len(prompts)

        def work(i: int) -> None:
            req = GenerateRequest(prompt=prompts[i], sampling=Sampling(max_tokens=gen, temperature=0.8, seed=1000 + i,
                                                              logit_bias=dict(logit_bias or {})))
            for ev in self.engine.generate(self.name, req, self.options):
                if isinstance(ev, Done):
                    counts[i] = (ev.stats.prompt_eval_count, ev.stats.eval_count)

        wall = run_together(work, len(prompts))
        return {"total": sum(a + b for a, b in counts) / wall, "short": sum(1 for _, b in counts if b < gen)}

    def close(self) -> None:
        self.engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--threads", type=int, default=None, help="default: physical cores (the backend's default)")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per stream")
    ap.add_argument("--gen", type=int, default=128, help="generated tokens per stream")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-ctx", type=int, default=2048, help="context per sequence of localllm's slots")
    ap.add_argument("--kvu", action="store_true", help="also run llama-batched-bench with -kvu (unified KV)")
    ap.add_argument("--in-process", action="store_true", help="also run the B requests through the engine "
                    "in-process (no server, no clients), a third side")
    ap.add_argument("--allow-eos", action="store_true", help="let streams end at an end-of-generation token (by "
                    "default logit_bias -100 keeps them out, so every stream runs --gen tokens like llama.cpp's tools)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    threads = args.threads or default_threads()
    batches = [int(b) for b in args.batches.split(",")]
    path = model_path(args.model)
    tok = Tokens(path)
    import llama_tools

    llama_tools.build()
    print(f"model {args.model} ({path.name}), {threads} threads, B = {batches}, {args.prompt}+{args.gen} tokens; "
          f"load average at start {load_average()}", flush=True)
    extra: dict[str, Any] = {"num_ctx": args.num_ctx, "options": {"num_thread": threads}}
    bias = {} if args.allow_eos else {t: -100.0 for t in tok.eog()}
    if bias:
        extra["logit_bias"] = {str(t): b for t, b in bias.items()}
    res: dict[str, Any] = {"ref": {b: [] for b in batches}, "kvu": {b: [] for b in batches},
                           "ours": {b: [] for b in batches}, "inproc": {b: [] for b in batches}, "tg": [],
                           "decode1": [], "load": []}
    serial = [0]

    def prompts(b: int) -> list[str]:
        out = []
        for _ in range(b):
            serial[0] += 1
            out.append(tok.exact(story_prompt(serial[0]), args.prompt))
        return out

    inproc = (Side("in-process engine", InProc, model=args.model, threads=threads, num_ctx=args.num_ctx,
                   slots=max(batches)) if args.in_process else None)
    with Localllm({"LOCALLLM_NUM_PARALLEL": str(max(batches)), "LOCALLLM_PROMPT_CACHE_SIZE": "0"}) as srv:
        try:
            warm = asyncio.run(ours_round(srv.url, args.model, prompts(2), 16, extra))  # load + warm up
            if warm["errors"]:
                raise SystemExit(f"warm-up failed: {warm['errors'][0]}")
            for rnd in range(args.rounds):
                def run_ref() -> None:
                    for b, v in batched_bench(path, threads, batches, args.prompt, args.gen, False).items():
                        res["ref"][b].append(v)
                    if args.kvu:
                        for b, v in batched_bench(path, threads, batches, args.prompt, args.gen, True).items():
                            res["kvu"][b].append(v)
                    res["tg"].append(tg(path, threads, args.gen))

                def run_ours() -> None:
                    for b in batches:
                        r = asyncio.run(ours_round(srv.url, args.model, prompts(b), args.gen, extra))
                        if r["errors"]:
                            print(f"  B={b}: {len(r['errors'])} errors, first: {r['errors'][0]}")
                        if r["short"]:
                            print(f"  B={b}: {r['short']} streams stopped before {args.gen} tokens (real counts used)")
                        res["ours"][b].append(r["total"])
                        if b == 1:
                            res["decode1"].append(r["decode"])

                def run_inproc() -> None:
                    assert inproc is not None
                    for b in batches:
                        r = inproc.call("run", prompts=prompts(b), gen=args.gen, logit_bias=bias)
                        res["inproc"][b].append(r["total"])

                sides = [run_ref, run_ours] + ([run_inproc] if inproc is not None else [])
                for side in (sides if rnd % 2 == 0 else sides[::-1]):
                    side()
                res["load"].append(load_average())
                line = "  ".join(f"B={b}: ours {res['ours'][b][-1]:.1f} / ref {res['ref'][b][-1]:.1f} = "
                                 f"{res['ours'][b][-1] / res['ref'][b][-1]:.3f}"
                                 + (f" (in-process {res['inproc'][b][-1]:.1f})" if inproc is not None else "")
                                 for b in batches)
                if res["decode1"]:
                    line += (f"   1-stream decode {res['decode1'][-1]:.1f} / tg{args.gen} {res['tg'][-1]:.1f} = "
                             f"{res['decode1'][-1] / res['tg'][-1]:.3f}")
                print(f"round {rnd + 1}: {line}   (load {res['load'][-1]})", flush=True)
        finally:
            srv.remove_home()
            if inproc is not None:
                inproc.close()

    print(f"\nload average at end: {load_average()}")
    print(f"{'B':>3} {'localllm tok/s':>16} {'batched-bench S':>16} {'ratio (median of rounds)':>26} target"
          + (f" {'bb -kvu':>9} {'ours/kvu':>9}" if args.kvu else ""))
    out: dict[str, Any] = {"threads": threads, "model": args.model, "rounds": args.rounds, "per_round": res}
    targets = {4: 0.9, 8: 0.85}
    for b in batches:
        ratios = [o / r for o, r in zip(res["ours"][b], res["ref"][b], strict=True)]
        line = (f"{b:>3} {med(res['ours'][b]):>16.1f} {med(res['ref'][b]):>16.1f} "
                f"{med(ratios):>12.3f} [{min(ratios):.3f}–{max(ratios):.3f}] {targets.get(b, ''):>6}")
        if args.kvu:
            kr = [o / r for o, r in zip(res["ours"][b], res["kvu"][b], strict=True)]
            line += f" {med(res['kvu'][b]):>9.1f} {med(kr):>9.3f}"
        if inproc is not None:
            ir = [o / r for o, r in zip(res["inproc"][b], res["ref"][b], strict=True)]
            line += f"   in-process engine {med(res['inproc'][b]):.1f} tok/s = {med(ir):.3f}× batched-bench"
        print(line)
        out[f"ratio_{b}"] = med(ratios)
    if 1 in batches:
        r1 = [d / t for d, t in zip(res["decode1"], res["tg"], strict=True)]
        print(f"one stream: decode {med(res['decode1']):.1f} tok/s vs llama-bench tg{args.gen} (fa auto) "
              f"{med(res['tg']):.1f}: ratio {med(r1):.3f} [{min(r1):.3f}–{max(r1):.3f}] (target 0.97)")
        out["ratio_tg"] = med(r1)
    print("old one-slot server (issue 11, quoted, not rerun): 139 / 139 / 135 tok/s at B = 1 / 4 / 8 "
          "vs batched-bench 182 / 239 / 307")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
