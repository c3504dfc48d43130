"""localllm serve beside llama.cpp's ``llama-server`` (each in its own process, the same GGUF file, threads and
slots, the official openai client): the next turn of a long conversation sent as soon as the previous one ends
(what an agent does), and decode throughput with 1 and 4 concurrent clients. Rounds alternate the servers'
order; ``llama-bench`` (tg128) runs beside, for the machine's speed.

    python benchmarks/next_turn.py                          # 3k-token prefix, B=1 and B=4, 2 rounds
    python benchmarks/next_turn.py --prefix 8000 --clients ""  --rounds 2
    python benchmarks/next_turn.py --before /tmp/old-checkout   # an earlier commit's code served beside
    python benchmarks/next_turn.py --answer 64 --ours-fa-on --llama-fa-off    # both flash-attention settings
    python benchmarks/next_turn.py --ours-unified --slots 8 --clients 1,4,8   # both KV layouts

Per round and server: a fresh system prompt of ``--prefix`` tokens (a nonce: nothing cached from an earlier
round), turn 1 (cold, ``--answer`` tokens), then turn 2 at once (turn 1's answer and a short new question):
the time to first token of each and the decode rate after it (tokens after the first over their time: decoding
deep in the context; EOG kept out so that each answer is ``--answer`` tokens), client-measured. Throughput:
``B`` clients each stream one ``--tokens``-token answer (EOG tokens kept out by ``logit_bias``, distinct
prompts), completion tokens over wall time.
``llama-server`` is built by ``python benchmarks/llama_tools.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from _common import default_threads
from _serve import (
    LlamaServer,
    Localllm,
    Tokens,
    async_client,
    load_avg,
    med,
    model_path,
    story_prompt,
    stream,
    system_prompt,
)

QUESTION = "Which rule covers refunds? One sentence."
FOLLOW_UP = "And which one covers shipping? One sentence."


async def _turn(client: Any, model: str, messages: list[dict[str, str]], answer: int,
                extra: dict[str, Any]) -> tuple[float, float, str]:
    """(TTFT, decode tok/s after the first token, answer text) of one streamed chat turn (EOG kept out by the
    caller's ``logit_bias``, so that the answer is ``answer`` tokens deep in the context)."""
    t0 = time.perf_counter()
    ttft = float("nan")
    parts: list[str] = []
    s = await client.chat.completions.create(model=model, messages=messages, max_tokens=answer, temperature=0.0,
                                             seed=1, stream=True, extra_body=extra)
    async for ch in s:
        for c in ch.choices:
            if c.delta.content:
                if ttft != ttft:
                    ttft = time.perf_counter() - t0
                parts.append(c.delta.content)
    rest = time.perf_counter() - t0 - ttft
    return ttft, (len(parts) - 1) / rest if len(parts) > 1 and rest > 0 else float("nan"), "".join(parts)


async def turns(url: str, model: str, system: str, answer: int, extra: dict[str, Any]) -> dict[str, float]:
    """Turn 1's and turn 2's TTFT and decode rate, turn 2 sent as soon as turn 1's stream ends."""
    client = async_client(url)
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]
    nan = float("nan")
    t1, d1, t2, d2 = nan, nan, nan, nan
    try:
        t1, d1, text = await _turn(client, model, msgs, answer, extra)
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": FOLLOW_UP}]
        t2, d2, _ = await _turn(client, model, msgs, answer, extra)
    except Exception as e:  # noqa: BLE001 - said, and the round goes on (nan in the figures)
        print(f"{url}: turn {'1' if t1 != t1 else '2'} failed: {type(e).__name__}: {e} ({e.__cause__!r})",
              file=sys.stderr)
    await client.close()
    return {"turn1_ttft_s": t1, "turn2_ttft_s": t2, "turn1_decode_tok_s": d1, "turn2_decode_tok_s": d2}


async def throughput(url: str, model: str, clients: int, tokens: int, bias: dict[str, int], extra: dict[str, Any],
                     salt: int) -> float:
    client = async_client(url)
    t0 = time.perf_counter()
    rs = await asyncio.gather(*[stream(client, model, prompt=story_prompt(salt * 16 + i), max_tokens=tokens,
                                       temperature=0.0, extra_body={"logit_bias": bias, **extra})
                                for i in range(clients)])
    wall = time.perf_counter() - t0
    await client.close()
    errors = [r.error for r in rs if r.error]
    if errors:
        raise SystemExit(f"{url}: {errors[0]}")
    return sum(r.completion_tokens or r.chunks for r in rs) / wall


def _tg(records: list[dict[str, Any]]) -> str:
    return ", ".join(f"{'pp' if r['n_prompt'] else 'tg'}{r['n_prompt'] or r['n_gen']} {r['avg_ts']:.1f} ± "
                     f"{r['stddev_ts']:.1f}" for r in records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--prefix", type=int, default=3000, help="system prompt tokens")
    ap.add_argument("--answer", type=int, default=16, help="tokens per turn")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clients", default="1,4", help="concurrent clients for throughput ('' = none)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-bench", action="store_true", help="skip llama-bench")
    ap.add_argument("--before", type=Path, default=None,
                    help="another checkout of localllm served beside (\"before\"), e.g. an earlier commit's")
    ap.add_argument("--llama-fa-off", action="store_true",
                    help="a second llama-server beside, with -fa off (what localllm loads on the CPU)")
    ap.add_argument("--ours-fa-on", action="store_true",
                    help="a second localllm beside, with LOCALLLM_FLASH_ATTENTION=on (the default is off on the CPU)")
    ap.add_argument("--ours-unified", action="store_true",
                    help="a second localllm beside, with LOCALLLM_KV_UNIFIED=1 (one KV pool, not a stream per slot)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import llama_tools

    threads = args.threads or default_threads()
    gguf = model_path(args.model)
    tok = Tokens(gguf)
    n_ctx = max(2048, ((args.prefix + 2 * args.answer + 200) // 1024 + 1) * 1024)
    bias = {str(t): -100 for t in tok.eog()}
    binary = llama_tools.home() / "build" / "bin" / "llama-server"
    if not binary.exists():
        raise SystemExit(f"llama-server is not built ({binary}): python benchmarks/llama_tools.py")
    out: dict[str, Any] = {"prefix_tokens": args.prefix, "threads": threads, "slots": args.slots, "n_ctx": n_ctx,
                           "load_before": load_avg(), "localllm": {}, "llama-server": {}}
    if not args.no_bench:
        out["llama_bench_before"] = _tg(llama_tools.llama_bench(gguf, threads=threads, reps=3))
    clients = [int(c) for c in args.clients.split(",") if c.strip()]
    env = {"LOCALLLM_NUM_PARALLEL": str(args.slots)}
    ours_extra = {"num_ctx": n_ctx, "options": {"num_thread": threads}}
    with contextlib.ExitStack() as stack:
        ours = stack.enter_context(Localllm(env=env))
        theirs = stack.enter_context(LlamaServer(binary, gguf, threads, n_ctx, args.slots))
        sides = {"localllm": (ours.url, ours_extra), "llama-server": (theirs.url, {"cache_prompt": True})}
        if args.llama_fa_off:
            off = stack.enter_context(LlamaServer(binary, gguf, threads, n_ctx, args.slots, ("-fa", "off")))
            sides["llama-fa-off"] = (off.url, {"cache_prompt": True})
            out["llama-fa-off"] = {}
        if args.ours_fa_on:
            on_ = stack.enter_context(Localllm(env={**env, "LOCALLLM_FLASH_ATTENTION": "on"}))
            sides["localllm-fa-on"] = (on_.url, ours_extra)
            out["localllm-fa-on"] = {}
        if args.ours_unified:
            uni = stack.enter_context(Localllm(env={**env, "LOCALLLM_KV_UNIFIED": "1"}))
            sides["localllm-unified"] = (uni.url, ours_extra)
            out["localllm-unified"] = {}
        if args.before is not None:
            old = stack.enter_context(Localllm(env=env, root=args.before.resolve()))
            sides["before"] = (old.url, ours_extra)
            out["before"] = {}
        for url, extra in sides.values():  # warm-up: the model loaded, the first requests' costs paid
            asyncio.run(throughput(url, args.model, 1, 8, bias, extra, salt=99))
        for rnd in range(args.rounds):
            order = list(sides)[rnd % len(sides):] + list(sides)[:rnd % len(sides)]
            for name in order:
                url, extra = sides[name]
                system = system_prompt(args.prefix, tok, nonce=f"round {rnd} {name} {os.getpid()}")
                row = out[name].setdefault("turns", [])
                row.append(asyncio.run(turns(url, args.model, system, args.answer, {"logit_bias": bias, **extra})))
                for b in clients:
                    rate = asyncio.run(throughput(url, args.model, b, args.tokens, bias, extra, salt=rnd * 8 + b))
                    out[name].setdefault(f"B{b}_tok_s", []).append(rate)
    out["load_after"] = load_avg()
    if not args.no_bench:
        out["llama_bench_after"] = _tg(llama_tools.llama_bench(gguf, threads=threads, reps=3))
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"{args.prefix:,}-token prefix, {threads} threads, {args.slots} slots, n_ctx {n_ctx}/slot; load "
          f"{out['load_before']} -> {out['load_after']}")
    for k in ("llama_bench_before", "llama_bench_after"):
        if k in out:
            print(f"{k}: {out[k]}")
    mine = ["localllm"] + [k for k in ("before", "llama-fa-off", "localllm-fa-on", "localllm-unified")
                         if k in out]
    theirs_t = out["llama-server"]["turns"]
    for side in mine:
        for key in ("turn1_ttft_s", "turn2_ttft_s", "turn1_decode_tok_s", "turn2_decode_tok_s"):
            a = [r[key] for r in out[side]["turns"]]
            ref = [r[key] for r in theirs_t]
            print(f"{key:18} {side:12}{' / '.join(f'{x:.3f}' for x in a)}   llama-server "
                  f"{' / '.join(f'{x:.3f}' for x in ref)}   ratio (median) {med(a) / med(ref):.2f}")
        for c in clients:
            a, t = out[side][f"B{c}_tok_s"], out["llama-server"][f"B{c}_tok_s"]
            ratios = " / ".join(f"{x / y:.2f}" for x, y in zip(a, t, strict=True))
            print(f"B={c} tok/s          {side:12}{' / '.join(f'{x:.1f}' for x in a)}   llama-server "
                  f"{' / '.join(f'{x:.1f}' for x in t)}   ratios {ratios}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
