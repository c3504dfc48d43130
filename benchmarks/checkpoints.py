"""Prompt tokens evaluated per turn on memory that cannot drop its tail (a hybrid's recurrent state, a sliding
window), localllm's checkpoints beside llama-server's context checkpoints, on the same GGUF and settings.

A chat with a long system prompt (~1,500 tokens), played as a client would: turn 1, the exact same request
again (repeat), turn 2 (history + answer + question), a regenerate of turn 2, an edit of the first user turn
(the prompt diverges right after the system prompt), then an agent-style session (the same long prefix, small
tool results appended turn after turn). For each turn: prompt tokens, tokens evaluated (not reused) and the
prompt-processing time each engine reports (ours: ``prompt_eval_duration``; llama-server: ``timings.prompt_ms``).

    python benchmarks/checkpoints.py                          # the made hybrid of the test cache
    python benchmarks/checkpoints.py --model swa              # the made gemma3 with a 32-token window
    python benchmarks/checkpoints.py --model PATH.gguf --raw  # plain-text prompts (gemma3:270m: no template)

Both engines run one slot, ``--threads`` threads, greedy, the same context; llama-server with its defaults
otherwise (``--ctx-checkpoints``, ``--cache-reuse`` off), built by ``benchmarks/llama_tools.py``. Answers are fixed
text in the history (each engine's own answer would make the histories differ), so both see the same messages.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SYSTEM = "You are the archivist of a small museum. " + " ".join(
    f"Room {i} holds the {w} collection of {n} pieces; answer questions about it with the catalogue number, the "
    f"case and the donor's name, and never guess a number you do not know."
    for i, (w, n) in enumerate([(w, 10 + 7 * k) for k, w in enumerate(
        "coin map clock glass shell stamp lamp key fan bell mask doll kite comb pipe bowl ring seal vase cup "
        "pen harp drum flag".split())])) * 2
A1 = "The clocks are in room 2, cases 4 to 9; catalogue numbers start at C-200."
A2 = "The maps are in room 1, donated by the Ortelius family."
TOOL = "Tool result {k}: lookup(room={k}) returned 3 cases, 12 pieces, last audit {k} March."


def scenario() -> list[tuple[str, list[dict[str, str]]]]:
    sys_ = {"role": "system", "content": SYSTEM}
    u1 = {"role": "user", "content": "Which room has the clocks?"}
    u2 = {"role": "user", "content": "And the maps?"}
    turn2 = [sys_, u1, {"role": "assistant", "content": A1}, u2]
    out = [("turn 1", [sys_, u1]), ("repeat", [sys_, u1]), ("turn 2", turn2), ("regenerate", turn2),
           ("edit turn 1", [sys_, {"role": "user", "content": "Which room has the glass?"},
                            {"role": "assistant", "content": A1}, u2])]
    agent = [sys_, {"role": "user", "content": "Audit the rooms one by one."}]
    for k in range(1, 4):
        agent = [*agent, {"role": "assistant", "content": f"Calling lookup(room={k})."},
                 {"role": "user", "content": TOOL.format(k=k)}]
        out.append((f"agent step {k}", list(agent)))
    return out


def resolve(model: str) -> Path:
    cache = Path(os.environ.get("LOCALLLM_TEST_CACHE", "~/.cache/localllm-tests")).expanduser() / "derived"
    named = {"hybrid": "hybrid-qwen35-[0-9]*.gguf", "swa": "swa-gemma3-[0-9]*.gguf"}
    if model in named:
        found = glob.glob(str(cache / named[model]))
        if not found:
            raise SystemExit(f"no made {model} model in {cache}: run tests/backends/test_hybrid.py once")
        return Path(found[0])
    return Path(model)


def raw(msgs: list[dict[str, str]]) -> str:
    """A chat as plain text, for a model without a chat template (gemma3:270m is a base model)."""
    return "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in msgs) + "Assistant:"


def ours(path: Path, ctx: int, threads: int, tokens: int, plain: bool = False) -> list[dict[str, Any]]:
    from backends.contract.specs import GenerateRequest, LoadSpec, Sampling
    from backends.core.loop import LoadedModel
    from backends.registry import source_class

    m = LoadedModel(source_class("llamacpp"), LoadSpec(str(path), n_ctx=ctx, slots=1, n_threads=threads))
    rows = []
    try:
        for label, msgs in scenario():
            sampling = Sampling(temperature=0.0, max_tokens=tokens)
            req = (GenerateRequest(prompt=raw(msgs), sampling=sampling) if plain
                   else GenerateRequest(messages=msgs, sampling=sampling))
            t0 = time.perf_counter()
            ttft = None
            done = None
            for ev in m.generate(req):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                done = ev
            st = done.stats  # type: ignore[union-attr]
            rows.append({"turn": label, "prompt": st.prompt_eval_count,
                         "evaluated": st.prompt_eval_count - st.prompt_cached_tokens,
                         "prompt_ms": st.prompt_eval_duration / 1e6, "ttft_ms": (ttft or 0) * 1e3})
        rows.append({"checkpoints": m.metrics().kv_checkpoints, "checkpoint_bytes": m.metrics().kv_checkpoint_bytes,
                     "memory_bytes": m.info.kv_bytes})
    finally:
        m.close()
    return rows


def theirs(path: Path, ctx: int, threads: int, tokens: int, plain: bool = False) -> list[dict[str, Any]]:
    import re
    import tempfile

    import httpx
    import llama_tools
    from _serve import _wait_ready, free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [str(llama_tools.tool("llama-server")), "-m", str(path), "-c", str(ctx), "-np", "1", "-t", str(threads),
           "--port", str(port), "--jinja", "-fa", "auto", "-lv", "4"]  # (-lv 4: its buffer sizes in the log)
    logfile = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
    with open(logfile, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=log)
    rows: list[dict[str, Any]] = []
    try:
        _wait_ready(url, proc, "/health")
        for label, msgs in scenario():
            t0 = time.perf_counter()
            if plain:
                r = httpx.post(url + "/completion", timeout=600, json={
                    "prompt": raw(msgs), "n_predict": tokens, "temperature": 0, "cache_prompt": True})
            else:
                r = httpx.post(url + "/v1/chat/completions", timeout=600, json={
                    "messages": msgs, "max_tokens": tokens, "temperature": 0, "cache_prompt": True})
            r.raise_for_status()
            wall = time.perf_counter() - t0
            t = r.json()["timings"]
            rows.append({"turn": label, "prompt": t.get("cache_n", 0) + t["prompt_n"], "evaluated": t["prompt_n"],
                         "prompt_ms": t["prompt_ms"], "ttft_ms": wall * 1e3 - t.get("predicted_ms", 0)})
        text = logfile.read_text(errors="replace")  # what it allocated for the memory: its KV and RS buffers
        mib = sum(float(x) for x in re.findall(r"(?:KV|RS) buffer size =\s*([0-9.]+) MiB", text))
        rows.append({"memory_bytes": int(mib * (1 << 20))})
    finally:
        proc.terminate()
        proc.wait(30)
    return rows


def gemma12b_context(budget: int = 8 << 30) -> None:
    """The largest context whose KV cache fits ``budget`` for a Gemma-3-12B-shaped model (48 layers, 8 KV heads of
    256, a 1,024-token window on 40 of them), full-size windows (before) and windows at window size (now)."""
    from localllm.ggufinfo import GGUFInfo

    g = GGUFInfo(path="", file_size=7_300_000_000, architecture="gemma3", name="Gemma-3-12B-shaped", n_layers=48,
                 n_embd=3840, n_head=16, n_head_kv=8, head_dim_k=256, head_dim_v=256, context_length=131072,
                 vocab_size=262144, file_type="Q4_K_M", parameters=12_000_000_000, chat_template=None, license=None,
                 sliding_window=1024, swa_layers=40)
    for full in (True, False):
        fits = max(c for c in range(256, g.context_length + 1, 256) if g.memory_bytes(c, swa_full=full) <= budget)
        print(f"{'swa_full (before)' if full else 'window (now)':<18} largest context in {budget / 2**30:.0f} GiB of "
              f"KV: {fits:,} tokens; at 32,768 tokens: {g.memory_bytes(32768, swa_full=full) / 2**30:.2f} GiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="hybrid", help="hybrid | swa | a GGUF path")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--only", choices=["ours", "theirs"], default=None)
    ap.add_argument("--raw", action="store_true", help="plain-text prompts (a model without a chat template)")
    ap.add_argument("--memory", action="store_true",
                    help="only the planner's figure: the largest context a Gemma-3-12B-shaped model's KV fits in 8 GiB")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.memory:
        gemma12b_context()
        return
    path = resolve(args.model)
    res: dict[str, Any] = {"model": str(path)}
    if args.only != "theirs":
        res["localllm"] = ours(path, args.ctx, args.threads, args.tokens, args.raw)
    if args.only != "ours":
        res["llama-server"] = theirs(path, args.ctx, args.threads, args.tokens, args.raw)
    if args.json:
        print(json.dumps(res, indent=1))
        return
    a, b = res.get("localllm", []), res.get("llama-server", [])
    print(f"{path.name}: prompt tokens evaluated (prompt ms) per turn")
    print(f"{'turn':<14} {'prompt':>6} {'localllm':>16} {'llama-server':>16}")
    for i, (label, _) in enumerate(scenario()):
        x = a[i] if i < len(a) else None
        y = b[i] if i < len(b) else None
        p = (x or y or {}).get("prompt", 0)
        fx = f"{x['evaluated']:>6} ({x['prompt_ms']:6.1f})" if x else "-"
        fy = f"{y['evaluated']:>6} ({y['prompt_ms']:6.1f})" if y else "-"
        print(f"{label:<14} {p:>6} {fx:>16} {fy:>16}")
    if a:
        print(f"localllm checkpoints kept: {a[-1]['checkpoints']} ({a[-1]['checkpoint_bytes'] / 1e6:.1f} MB)")
    for who, rows in (("localllm", a), ("llama-server", b)):
        if rows:
            mib = rows[-1]["memory_bytes"] / 2**20
            print(f"{who} memory (KV + recurrent state) at {args.ctx:,} tokens: {mib:.1f} MiB")


if __name__ == "__main__":
    main()
