"""TTFT under load (issue 11): a new short request's time to first token while 3 long streams decode, against
the same request's TTFT on an idle server; and the same for a long prompt (chunked prefill), with the
longest pause the 3 streams see while it is evaluated.

    python benchmarks/ttft_under_load.py                       # default model, 4 slots, 5 rounds
    python benchmarks/ttft_under_load.py --rounds 8 --threads 2 --long-prompt 1000 --streams 3

One ``localllm serve`` (``LOCALLLM_NUM_PARALLEL`` = streams + 1, prompt cache off). Per round, idle and
loaded alternate in order: *idle*: the short request alone (a distinct one-line question through
``/v1/chat/completions``, 8 tokens), then the long-prompt request alone (a distinct ~``--long-prompt``-token
text to summarise); *loaded*: 3 raw-completion streams (distinct story prompts, up to ``--long-tokens``
tokens) are started, and once all three stream (plus half a second), the short request, then the long-prompt
one, are sent; then the 3 streams leave. TTFT = client time from the call to the first content chunk
(official openai client, asyncio). Target: short TTFT loaded / idle ≤ 2 (median over rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import _serve
from _common import default_threads, load_average
from _serve import Localllm, Tokens, med, model_path, pct, story_prompt, stream

PASSAGE = ("The committee met on a grey Tuesday to review the harbour project. Engineers described the new "
           "breakwater, the dredging schedule and the cost of steel; the mayor asked about the fishing fleet, "
           "and a teacher asked whether the old lighthouse would be kept. ")


def short_q(k: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Question {k}: name one colour of the rainbow."}]


def long_q(k: int, tok: Tokens, n: int) -> list[dict[str, str]]:
    text = f"Report {k}. " + PASSAGE
    while tok.count(text) < n:
        text += f"(Paragraph {tok.count(text) // 40}.) " + PASSAGE
    return [{"role": "user", "content": text + "\nSummarise this report in one sentence."}]


async def one_round(url: str, model: str, k: int, tok: Tokens, args: argparse.Namespace, extra: dict[str, Any],
                    loaded_first: bool) -> dict[str, Any]:
    client = _serve.async_client(url)
    out: dict[str, Any] = {}
    try:
        async def idle() -> None:
            s = await stream(client, model, messages=short_q(2 * k), max_tokens=8, temperature=0, extra_body=extra)
            out["idle_short"] = s
            if args.long_prompt:
                out["idle_long"] = await stream(client, model, messages=long_q(2 * k, tok, args.long_prompt),
                                                max_tokens=8, temperature=0, extra_body=extra)

        async def loaded() -> None:
            started = [0]
            flowing = asyncio.Event()
            stop = asyncio.Event()

            def first() -> None:
                started[0] += 1
                if started[0] == args.streams:
                    flowing.set()

            longs = [asyncio.create_task(stream(client, model, prompt=story_prompt(100 * k + i),
                                                max_tokens=args.long_tokens, temperature=0.8, seed=i,
                                                extra_body=extra, keep_times=True, on_first=first, stop=stop))
                     for i in range(args.streams)]
            await asyncio.wait_for(flowing.wait(), timeout=300)
            await asyncio.sleep(0.5)
            s = await stream(client, model, messages=short_q(2 * k + 1), max_tokens=8, temperature=0, extra_body=extra)
            out["loaded_short"] = s
            if args.long_prompt:
                t_send = time.perf_counter()
                lp = await stream(client, model, messages=long_q(2 * k + 1, tok, args.long_prompt), max_tokens=8,
                                  temperature=0, extra_body=extra)
                out["loaded_long"] = lp
                out["window"] = (t_send, t_send + lp.ttft)
            busy_until = time.perf_counter()
            stop.set()
            rs = await asyncio.gather(*longs)
            out["streams"] = rs
            out["still_decoding"] = sum(1 for r in rs if r.last >= busy_until)  # the streams ran past both requests
            t_short0 = s.first - s.ttft
            out["stream_gap_short"] = max((g for r in rs for g in r.gaps(t_short0, s.first)), default=float("nan"))
            if args.long_prompt:
                a, b = out["window"]
                out["stream_gap_long"] = max((g for r in rs for g in r.gaps(a, b)), default=float("nan"))
                out["stream_gap_base"] = med([g for r in rs for g in r.gaps(r.first, t_short0)])

        for part in ((loaded, idle) if loaded_first else (idle, loaded)):
            await part()
    finally:
        await client.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--threads", type=int, default=None, help="default: physical cores (the backend's default)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--streams", type=int, default=3, help="long streams decoding while the new request arrives")
    ap.add_argument("--long-tokens", type=int, default=2000, help="most tokens of each long stream (they are "
                    "stopped once the measured requests have their first token)")
    ap.add_argument("--long-prompt", type=int, default=1000, help="tokens of the long-prompt request (0: skip)")
    ap.add_argument("--num-ctx", type=int, default=4096)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    threads = args.threads or default_threads()
    path = model_path(args.model)
    tok = Tokens(path)
    extra = {"num_ctx": args.num_ctx, "options": {"num_thread": threads}}
    print(f"model {args.model}, {threads} threads, {args.streams} streams + 1 new request, {args.rounds} rounds; "
          f"load average at start {load_average()}", flush=True)
    rounds: list[dict[str, Any]] = []
    with Localllm({"LOCALLLM_NUM_PARALLEL": str(args.streams + 1), "LOCALLLM_PROMPT_CACHE_SIZE": "0"}) as srv:
        try:
            asyncio.run(one_round(srv.url, args.model, 10_000, tok, argparse.Namespace(**{**vars(args),
                        "long_prompt": 0, "long_tokens": 16}), extra, False))  # load + warm-up
            for k in range(args.rounds):
                r = asyncio.run(one_round(srv.url, args.model, k + 1, tok, args, extra, loaded_first=k % 2 == 1))
                errs = [x.error for x in [r["idle_short"], r["loaded_short"], *r["streams"],
                                          *([r["idle_long"], r["loaded_long"]] if args.long_prompt else [])] if x.error]
                if errs:
                    raise SystemExit(f"round {k + 1}: {errs[0]}")
                rounds.append(r)
                i_s, l_s = r["idle_short"].ttft * 1000, r["loaded_short"].ttft * 1000
                line = f"round {k + 1}: short TTFT idle {i_s:7.1f} ms, loaded {l_s:7.1f} ms ({l_s / i_s:.2f}×)"
                if args.long_prompt:
                    line += (f"; {r['idle_long'].prompt_tokens}-token prompt idle {r['idle_long'].ttft * 1000:7.1f} "
                             f"ms, loaded {r['loaded_long'].ttft * 1000:7.1f} ms; streams' step "
                             f"{r['stream_gap_base'] * 1000:.1f} ms, longest pause during it "
                             f"{r['stream_gap_long'] * 1000:.1f} ms")
                print(line + f"   (load {load_average()})", flush=True)
        finally:
            srv.remove_home()
    ratio = [r["loaded_short"].ttft / r["idle_short"].ttft for r in rounds]
    idle = [r["idle_short"].ttft * 1000 for r in rounds]
    loaded = [r["loaded_short"].ttft * 1000 for r in rounds]
    print(f"\nload average at end: {load_average()}")
    print(f"short request TTFT: idle median {med(idle):.1f} ms (p95 {pct(idle, 0.95):.1f}), with {args.streams} "
          f"streams decoding median {med(loaded):.1f} ms (p95 {pct(loaded, 0.95):.1f}); per-round ratio median "
          f"{med(ratio):.2f} [{min(ratio):.2f}–{max(ratio):.2f}] (target ≤ 2)")
    print(f"streams' longest pause while the short request was admitted: median "
          f"{med([r['stream_gap_short'] * 1000 for r in rounds]):.1f} ms")
    out: dict[str, Any] = {"ratio": med(ratio), "idle_ms": idle, "loaded_ms": loaded}
    if args.long_prompt:
        il = [r["idle_long"].ttft * 1000 for r in rounds]
        ll = [r["loaded_long"].ttft * 1000 for r in rounds]
        base = [r["stream_gap_base"] * 1000 for r in rounds]
        pause = [r["stream_gap_long"] * 1000 for r in rounds]
        print(f"{rounds[0]['idle_long'].prompt_tokens}-token prompt TTFT: idle median {med(il):.1f} ms, loaded "
              f"{med(ll):.1f} ms ({med([b / a for a, b in zip(il, ll, strict=True)]):.2f}×); the streams' step "
              f"median {med(base):.1f} ms, their longest pause during its prefill median {med(pause):.1f} ms "
              f"(max {max(pause):.1f})")
        out.update(idle_long_ms=il, loaded_long_ms=ll, stream_step_ms=base, stream_pause_ms=pause)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
