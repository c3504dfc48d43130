"""Prompt cache on disk (issue 13): a ~2,000-token system prompt through ``/api/chat`` on the default model.

    python benchmarks/prompt_cache.py                          # 3 rounds, f16 / q8_0 / q4_0 sizes
    python benchmarks/prompt_cache.py --rounds 3 --system 2000 --threads 2 --kv f16,q8_0,q4_0
    python benchmarks/prompt_cache.py --backend mlx --system 600 --rounds 1 --write-reps 1   # mlx[cpu] is slow

Three measures, each server a ``localllm serve`` process in a fresh home (``LOCALLLM_HOME``: an empty prompt
cache; the installed models are read in place):

1. **Restart** (per round): process 1 answers system prompt A as its first request (cold, *load included*:
   the model loads for it) and then system prompt B (cold, *load excluded*), and is stopped (its entries are
   finished on the way out); process 2, in the same home, answers A first (restored, load included) and then B
   (restored, load excluded). TTFT = client time from the call to the first content chunk; the restored
   tokens are read from ``/metrics`` (``localllm_prompt_tokens_restored_total``). Target: restored / cold
   ≤ 0.10 with the load excluded.
2. **The request that writes the entry** vs the same request with the cache off: two servers side by side,
   one with the cache on, one with ``LOCALLLM_PROMPT_CACHE_SIZE=0``, each request a new system prompt (a
   nonce), order alternating; total request time (the state copy is taken on the loop thread right after the
   final event; the file is written in the background, and the next request waits until it is on disk so that
   the write does not land in the other server's time). Target: on / off ≤ 1.05.
3. **Bytes on disk per 1,000 tokens** for each ``LOCALLLM_KV_CACHE_TYPE`` in ``--kv``: file size (header +
   state) / the entry's token count.

Requests: system + "Summarise rule 3 in one sentence.", ``num_predict`` 8 (``--predict``), temperature 0.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from _common import default_threads, load_average
from _serve import Localllm, Tokens, med, model_path, system_prompt


def chat(url: str, model: str, system: str, opts: dict[str, Any]) -> dict[str, Any]:
    """One streamed ``/api/chat``: TTFT, total time and the final stats."""
    body = {"model": model, "stream": True, "options": opts,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "Summarise rule 3 in one sentence."}]}
    t0 = time.perf_counter()
    first = None
    last: dict[str, Any] = {}
    with httpx.stream("POST", url + "/api/chat", json=body, timeout=1200) as r:
        if r.status_code != 200:
            raise SystemExit(f"/api/chat answered {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line:
                continue
            obj = json.loads(line)
            if "error" in obj:
                raise SystemExit(f"/api/chat error: {obj['error']}")
            if first is None and (obj.get("message") or {}).get("content"):
                first = time.perf_counter()
            if obj.get("done"):
                last = obj
    end = time.perf_counter()
    return {"ttft": (first or end) - t0, "total": end - t0, "prompt_eval_count": last.get("prompt_eval_count"),
            "load_ms": (last.get("load_duration") or 0) / 1e6}


def entries(home: Path) -> list[tuple[int, int]]:
    """(tokens, bytes on disk) of every prompt-cache entry under ``home``."""
    out = []
    for p in sorted((home / "data" / "prompt-cache").rglob("*.kv")):
        with open(p, "rb") as f:
            head = json.loads(f.readline())
        out.append((len(head["tokens"]), p.stat().st_size))
    return out


def wait_entries(home: Path, n: int, timeout: float = 60) -> float:
    """Seconds until at least ``n`` entries are on disk."""
    t0 = time.perf_counter()
    while len(entries(home)) < n and time.perf_counter() - t0 < timeout:
        time.sleep(0.05)
    return time.perf_counter() - t0


def restored(srv: Localllm) -> float:
    return srv.metrics().get("localllm_prompt_tokens_restored_total", 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--threads", type=int, default=None, help="default: physical cores (the backend's default)")
    ap.add_argument("--system", type=int, default=2000, help="system prompt tokens")
    ap.add_argument("--rounds", type=int, default=3, help="restart rounds (measure 1)")
    ap.add_argument("--write-reps", type=int, default=4, help="request pairs for measure 2 (0: skip)")
    ap.add_argument("--kv", default="f16,q8_0,q4_0", help="KV types for measure 3 ('' to skip)")
    ap.add_argument("--predict", type=int, default=8)
    ap.add_argument("--num-ctx", type=int, default=4096)
    ap.add_argument("--backend", default=None, help="LOCALLLM_BACKEND for the servers (default: the probe's pick)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.backend:
        os.environ["LOCALLLM_BACKEND"] = args.backend  # the servers inherit it
    threads = args.threads or default_threads()
    tok = Tokens(model_path(args.model))
    opts = {"num_ctx": args.num_ctx, "num_thread": threads, "num_predict": args.predict, "temperature": 0}
    m = args.model

    def sysp() -> str:
        return system_prompt(args.system, tok, nonce=uuid.uuid4().hex[:12])

    backend = args.backend or "the default backend"
    print(f"model {m} on {backend}, {threads} threads, ~{args.system}-token system prompt; load average at start "
          f"{load_average()}", flush=True)
    out: dict[str, Any] = {"restart": [], "write": [], "sizes": {}}
    for k in range(args.rounds):  # ---------------------------------------------------------------- 1. restart
        a, b = sysp(), sysp()
        p1 = Localllm()
        home = p1.home
        assert home is not None
        try:
            cold_a = chat(p1.url, m, a, opts)
            cold_b = chat(p1.url, m, b, opts)
            wait_entries(home, 2)
        finally:
            p1.close()
        saved = entries(home)
        p2 = Localllm(home=home)
        try:
            warm_a = chat(p2.url, m, a, opts)
            r_a = restored(p2)
            warm_b = chat(p2.url, m, b, opts)
            r_b = restored(p2) - r_a
        finally:
            p2.close()
            p2.remove_home()
        row = {"cold_incl": cold_a["ttft"], "cold_excl": cold_b["ttft"], "warm_incl": warm_a["ttft"],
               "warm_excl": warm_b["ttft"], "prompt_tokens": cold_b["prompt_eval_count"], "restored_a": r_a,
               "restored_b": r_b, "entries": saved, "load_ms_cold": cold_a["load_ms"],
               "load_ms_warm": warm_a["load_ms"]}
        out["restart"].append(row)
        print(f"round {k + 1}: {row['prompt_tokens']} prompt tokens; cold TTFT {row['cold_excl'] * 1000:.0f} ms "
              f"(with load {row['cold_incl'] * 1000:.0f}), after a restart {row['warm_excl'] * 1000:.0f} ms (with load "
              f"{row['warm_incl'] * 1000:.0f}), restored {r_a:.0f} + {r_b:.0f} tokens; ratio "
              f"{row['warm_excl'] / row['cold_excl']:.3f} (with load {row['warm_incl'] / row['cold_incl']:.3f}); "
              f"entries {saved}   (load {load_average()})", flush=True)

    if args.write_reps:  # ------------------------------------------------------------------- 2. write cost
        on, off = Localllm(), Localllm({"LOCALLLM_PROMPT_CACHE_SIZE": "0"})
        assert on.home is not None
        try:
            for s in (on, off):
                chat(s.url, m, "Be brief.", opts)  # load
            for k in range(args.write_reps):
                text = sysp()
                order = (on, off) if k % 2 == 0 else (off, on)
                res = {}
                for s in order:
                    n0 = len(entries(on.home))
                    res[s is on] = chat(s.url, m, text, opts)
                    if s is on:
                        res["disk"] = wait_entries(on.home, n0 + 1)
                rr = {"on": res[True]["total"], "off": res[False]["total"], "on_ttft": res[True]["ttft"],
                      "off_ttft": res[False]["ttft"], "to_disk": res["disk"]}
                out["write"].append(rr)
                print(f"write {k + 1}: cache on {rr['on'] * 1000:.0f} ms (TTFT {rr['on_ttft'] * 1000:.0f}), off "
                      f"{rr['off'] * 1000:.0f} ms (TTFT {rr['off_ttft'] * 1000:.0f}): {rr['on'] / rr['off']:.3f}; "
                      f"entry on disk {rr['to_disk'] * 1000:.0f} ms after the answer   (load {load_average()})",
                      flush=True)
        finally:
            for s in (on, off):
                s.close()
                s.remove_home()

    for kv in [x for x in args.kv.split(",") if x]:  # --------------------------------------------- 3. sizes
        srv = Localllm({"LOCALLLM_KV_CACHE_TYPE": kv})
        assert srv.home is not None
        try:
            chat(srv.url, m, sysp(), opts)
            wait_entries(srv.home, 1)
        finally:
            srv.close()
        es = entries(srv.home)
        srv.remove_home()
        out["sizes"][kv] = es
        per = [b / t * 1000 for t, b in es]
        print(f"{kv}: entries (tokens, bytes) {es}: {med(per) / 1e6:.2f} MB per 1,000 tokens", flush=True)

    print(f"\nload average at end: {load_average()}")
    rs = out["restart"]
    if rs:
        ce, we = [r["cold_excl"] for r in rs], [r["warm_excl"] for r in rs]
        ci, wi = [r["cold_incl"] for r in rs], [r["warm_incl"] for r in rs]
        ratio = [w / c for w, c in zip(we, ce, strict=True)]
        ratio_i = [w / c for w, c in zip(wi, ci, strict=True)]
        print(f"TTFT, {rs[0]['prompt_tokens']} prompt tokens: cold {med(ce) * 1000:.0f} ms, after a restart "
              f"{med(we) * 1000:.0f} ms: {med(ratio):.3f} [{min(ratio):.3f}–{max(ratio):.3f}] of cold, load excluded "
              f"(target ≤ 0.10); load included: cold {med(ci) * 1000:.0f} ms, restored {med(wi) * 1000:.0f} ms: "
              f"{med(ratio_i):.3f}")
    if out["write"]:
        w = [r["on"] / r["off"] for r in out["write"]]
        after = [((r["on"] - r["on_ttft"]) - (r["off"] - r["off_ttft"])) * 1000 for r in out["write"]]
        print(f"writing request / cache off: {med(w):.3f} [{min(w):.3f}–{max(w):.3f}] (target ≤ 1.05); entry on disk "
              f"median {med([r['to_disk'] for r in out['write']]) * 1000:.0f} ms after the answer; time after the "
              f"first token, on − off: median {med(after):.0f} ms [{min(after):.0f}–{max(after):.0f}] (the state "
              f"copy follows the final event: about 0 when the answer does not wait for it)")
    for kv, es in out["sizes"].items():
        print(f"bytes on disk per 1,000 tokens, {kv}: {med([b / t * 1000 for t, b in es]) / 1e6:.2f} MB")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
