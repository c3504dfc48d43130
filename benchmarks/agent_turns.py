"""An agent-shaped workload: a long prefix (an agent's system prompt and tool schemas, 20k tokens by default)
re-sent every turn with a small append (the last answer, a tool result, the next instruction), 10 turns, 3
sessions interleaved (A1 B1 C1 A2 B2 C2 ...). Per turn: time to first token and the prompt tokens the server
evaluated (the rest it reused), for ``localllm serve`` and, beside it, llama.cpp's ``llama-server`` on the same
file and settings (the same context per slot, the same threads, 4 slots).

The model is the tests' made one (``tests/support_agents.py``: random weights, the default model's tokenizer, a
32,768-token trained context, 2 layers): what is measured is prompt evaluation and reuse, not answers. Both
servers get ``max_tokens`` answers of noise.

    python benchmarks/agent_turns.py                      # 20k prefix, 10 turns, 3 sessions
    python benchmarks/agent_turns.py --prefix 8000 --turns 5 --json

``llama-server`` is used where ``benchmarks/llama_tools.py`` has built it (``python benchmarks/llama_tools.py``);
without it, only localllm's column is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import default_threads
from _serve import ROOT, LlamaServer, Localllm, med, model_path

MODEL = "agent-llama:tiny"
APPEND = ("The command finished. Output:\n{out}\nNow run the next step of the plan: open the file that failed, "
          "read the function named in the traceback, and fix the off-by-one in its loop. Turn {turn}, session "
          "{session}.")


def prefix_text(n_tokens: int, tok: Any) -> str:
    """An agent-like system prompt of about ``n_tokens``: instructions and JSON tool schemas."""
    tools = []
    i = 0
    text = ""
    while True:
        tools.append({"type": "function", "function": {
            "name": f"tool_{i}", "description": f"Tool {i}: runs step {i} of a build, test or edit workflow and "
            "returns its output; use it when the plan reaches that step, never in parallel with itself.",
            "parameters": {"type": "object", "properties": {
                "path": {"type": "string", "description": "A file in the workspace."},
                "args": {"type": "array", "items": {"type": "string"}},
                "timeout_ms": {"type": "integer"}}, "required": ["path"]}}})
        text = "You are a coding agent working in a terminal. Tools:\n" + json.dumps(tools)
        if tok.count(text) >= n_tokens:
            return text
        i += 1


def stream_turn(url: str, messages: list[dict[str, str]], max_tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
    """One streamed chat request: TTFT and the server's own count of prompt tokens evaluated and reused."""
    import httpx

    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    t0 = time.perf_counter()
    ttft = float("nan")
    usage: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    answer = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices") or []:
                delta = c.get("delta") or {}
                if (delta.get("content") or delta.get("reasoning_content")) and ttft != ttft:
                    ttft = time.perf_counter() - t0
                answer.append(delta.get("content") or "")
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
    prompt = int(usage.get("prompt_tokens", 0))
    if timings:  # llama-server: prompt_n evaluated, cache_n reused
        evaluated, cached = int(timings.get("prompt_n", 0)), int(timings.get("cache_n", 0))
        prompt = prompt or evaluated + cached
    else:
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        evaluated = prompt - cached
    return {"ttft": ttft, "prompt": prompt, "evaluated": evaluated, "answer": "".join(answer)}


def workload(url: str, prefix: str, sessions: int, turns: int, max_tokens: int,
             extra: dict[str, Any]) -> list[dict[str, Any]]:
    convs = {s: [{"role": "system", "content": prefix},
                 {"role": "user", "content": f"Session {chr(65 + s)}: the tests in pkg/{s} fail; fix them."}]
             for s in range(sessions)}
    rows = []
    for turn in range(1, turns + 1):
        for s in range(sessions):
            r = stream_turn(url, convs[s], max_tokens, extra)
            rows.append({"session": chr(65 + s), "turn": turn, **{k: r[k] for k in ("ttft", "prompt", "evaluated")}})
            convs[s] += [{"role": "assistant", "content": r["answer"] or "ok"},
                         {"role": "user", "content": APPEND.format(out="0 passed, 1 failed", turn=turn,
                                                                   session=chr(65 + s))}]
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The cold first request, the other sessions' first turns (the prefix is shared), the later turns."""
    cold, others = rows[0], [r for r in rows[1:] if r["turn"] == 1]
    later = [r for r in rows if r["turn"] > 1]
    return {"cold_ttft_s": cold["ttft"], "cold_evaluated": cold["evaluated"],
            "other_first_ttft_s": med([r["ttft"] for r in others]) if others else float("nan"),
            "later_ttft_s": med([r["ttft"] for r in later]) if later else float("nan"),
            "later_evaluated": med([r["evaluated"] for r in later]) if later else 0,
            "later_evaluated_max_pct": max(100.0 * r["evaluated"] / r["prompt"] for r in later) if later else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix", type=int, default=20000, help="prefix tokens (system prompt + tool schemas)")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--answer-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    sys.path.insert(0, str(ROOT))
    import llama_tools
    from _serve import Tokens

    from tests.support_agents import LONG_CTX, long_context_model

    threads = args.threads or default_threads()
    gguf = long_context_model(model_path("smollm2:135m"))
    tok = Tokens(gguf)
    prefix = prefix_text(args.prefix, tok)
    models = Path(tempfile.mkdtemp(prefix="localllm-bench-agent-models-"))
    env = {"LOCALLLM_MODELS": str(models), "LOCALLLM_HOME": str(models.parent / (models.name + "-home"))}
    modelfile = models / "Modelfile"
    modelfile.write_text(f"FROM {gguf}\n")
    subprocess.run([sys.executable, "-m", "localllm", "create", MODEL, "-f", str(modelfile)], check=True,
                   env={**os.environ, **env}, capture_output=True)
    results: dict[str, Any] = {"prefix_tokens": tok.count(prefix), "turns": args.turns, "sessions": args.sessions,
                               "threads": threads, "n_ctx": LONG_CTX}
    with Localllm(env=env) as srv:
        rows = workload(srv.url, prefix, args.sessions, args.turns, args.answer_tokens,
                        {"num_ctx": LONG_CTX, "options": {"num_thread": threads}})
        results["localllm"] = {"summary": summary(rows), "rows": rows}
    binary = llama_tools.home() / "build" / "bin" / "llama-server"
    if binary.exists():
        with LlamaServer(binary, gguf, threads, LONG_CTX, 4) as ls:
            rows = workload(ls.url, prefix, args.sessions, args.turns, args.answer_tokens, {"cache_prompt": True})
            results["llama-server"] = {"summary": summary(rows), "rows": rows}
    else:
        results["llama-server"] = f"not built ({binary}); python benchmarks/llama_tools.py builds it"
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"agent workload: {results['prefix_tokens']:,}-token prefix, {args.turns} turns, {args.sessions} sessions "
          f"interleaved, {threads} threads, {LONG_CTX:,}-token context per slot")
    print(f"{'':14}{'cold TTFT':>11}{'cold eval':>11}{'1st TTFT':>10}{'later TTFT':>12}{'later eval':>12}"
          f"{'max % later':>12}")
    for side in ("localllm", "llama-server"):
        s = results[side]
        if isinstance(s, str):
            print(f"{side:14}{s}")
            continue
        m = s["summary"]
        print(f"{side:14}{m['cold_ttft_s']:>10.2f}s{m['cold_evaluated']:>11,}{m['other_first_ttft_s']:>9.2f}s"
              f"{m['later_ttft_s']:>11.3f}s{m['later_evaluated']:>12,.0f}{m['later_evaluated_max_pct']:>11.1f}%")
    print("cold: the first request; 1st: the other sessions' first turns (same prefix); later: turns 2..N; "
          "eval: prompt tokens the server evaluated (the rest it reused)")


if __name__ == "__main__":
    main()
