"""Shared prefix (issue 11): 4 clients with the same ~1,500-token system prompt and different questions. Prompt
tokens evaluated (``localllm_prompt_tokens_total`` delta on ``/metrics``) should be about 1× the system
prompt, not 4×; with each client's TTFT.

    python benchmarks/shared_prefix.py                        # default model, 4 clients, 3 rounds
    python benchmarks/shared_prefix.py --clients 4 --system 1500 --rounds 3 --threads 2

One ``localllm serve`` (``LOCALLLM_NUM_PARALLEL`` = clients; the prompt cache on disk is off, so every reuse
measured is the KV pool's). Each round uses a new system prompt (a nonce in its first line: nothing from an
earlier round can be reused) and runs two arrivals:

* **together**: all clients send at once (``asyncio.gather``);
* **staggered**: one client first, the others once it has its first token (the prefix is in the pool).

``/metrics`` is read before and after each: evaluated, cached (reused from the pool), copied (of those, from
another sequence's cells). Requests: ``/v1/chat/completions`` (official openai client), system + a
one-line question, 16 tokens at temperature 0. Reference: one client alone with a fresh system prompt (the
cold TTFT of a lone request, in the same round).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from typing import Any

import _serve
from _common import default_threads, load_average
from _serve import Localllm, Tokens, med, model_path, stream, system_prompt

QUESTIONS = ["How do I return a damaged item?", "Which rule covers gift cards?", "What is case 1037 about?",
             "Can I change my shipping address?", "How are taxes shown on an invoice?", "Who handles repairs?",
             "What should I say about warranty dates?", "How do discounts combine?"]


def msgs(system: str, q: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": q}]


KEYS = ("localllm_prompt_tokens_total", "localllm_prompt_tokens_cached_total", "localllm_prompt_tokens_copied_total")


async def arrival(srv: Localllm, model: str, system: str, clients: int, staggered: bool, extra: dict[str, Any]
                  ) -> dict[str, Any]:
    before = srv.metrics()
    client = _serve.async_client(srv.url)
    try:
        qs = [msgs(system, QUESTIONS[i % len(QUESTIONS)]) for i in range(clients)]
        if staggered:
            got_first = asyncio.Event()
            first = asyncio.create_task(stream(client, model, messages=qs[0], max_tokens=16, temperature=0,
                                               extra_body=extra, on_first=got_first.set))
            await asyncio.wait_for(got_first.wait(), timeout=600)
            rest = await asyncio.gather(*(stream(client, model, messages=q, max_tokens=16, temperature=0,
                                                 extra_body=extra) for q in qs[1:]))
            rs = [await first, *rest]
        else:
            rs = list(await asyncio.gather(*(stream(client, model, messages=q, max_tokens=16, temperature=0,
                                                    extra_body=extra) for q in qs)))
    finally:
        await client.close()
    after = srv.metrics()
    errs = [r.error for r in rs if r.error]
    if errs:
        raise SystemExit(errs[0])
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in KEYS}
    return {"evaluated": d[KEYS[0]], "cached": d[KEYS[1]], "copied": d[KEYS[2]],
            "prompt_tokens": sum(r.prompt_tokens for r in rs), "ttft_ms": [r.ttft * 1000 for r in rs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--threads", type=int, default=None, help="default: physical cores (the backend's default)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--system", type=int, default=1500, help="system prompt tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-ctx", type=int, default=4096)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    threads = args.threads or default_threads()
    tok = Tokens(model_path(args.model))
    extra = {"num_ctx": args.num_ctx, "options": {"num_thread": threads}}
    print(f"model {args.model}, {threads} threads, {args.clients} clients, ~{args.system}-token system prompt; "
          f"load average at start {load_average()}", flush=True)
    res: dict[str, list[dict[str, Any]]] = {"alone": [], "together": [], "staggered": []}
    with Localllm({"LOCALLLM_NUM_PARALLEL": str(args.clients), "LOCALLLM_PROMPT_CACHE_SIZE": "0"}) as srv:
        try:
            asyncio.run(arrival(srv, args.model, "Be brief.", 1, False, extra))  # load + warm-up
            for k in range(args.rounds):
                order = ("alone", "together", "staggered") if k % 2 == 0 else ("staggered", "together", "alone")
                for kind in order:
                    system = system_prompt(args.system, tok, nonce=uuid.uuid4().hex[:12])
                    n_sys = tok.count(system)
                    r = asyncio.run(arrival(srv, args.model, system, 1 if kind == "alone" else args.clients,
                                            kind == "staggered", extra))
                    r["system_tokens"] = n_sys
                    r["times_system"] = r["evaluated"] / n_sys
                    res[kind].append(r)
                    print(f"round {k + 1} {kind:9}: system {n_sys} tokens; prompt tokens {r['prompt_tokens']}, "
                          f"evaluated {r['evaluated']:.0f} ({r['times_system']:.2f}× the system prompt), cached "
                          f"{r['cached']:.0f} (copied {r['copied']:.0f}); TTFT ms "
                          + ", ".join(f"{t:.0f}" for t in r["ttft_ms"]) + f"   (load {load_average()})", flush=True)
        finally:
            srv.remove_home()
    print(f"\nload average at end: {load_average()}")
    for kind, rs in res.items():
        if not rs:
            continue
        ttfts = [t for r in rs for t in r["ttft_ms"]]
        firsts = [min(r["ttft_ms"]) for r in rs]
        lasts = [max(r["ttft_ms"]) for r in rs]
        print(f"{kind:9}: evaluated / system prompt median {med([r['times_system'] for r in rs]):.2f}× "
              f"(target ≈ 1; 4 clients without sharing: ≈ {args.clients}×); TTFT median {med(ttfts):.0f} ms, "
              f"first {med(firsts):.0f} ms, last {med(lasts):.0f} ms")
    if args.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
