"""One stream's decode rate before and after a long conversation sits idle in the pool (issue 47's second-round
B=1 dip): ``localllm serve`` (its own process, ``--slots`` slots), three 128-token answers through ``/api/generate``
(EOG allowed; the model's own eval rate), a ``--prefix``-token conversation through ``/api/chat``, then three
more answers. Each answer prints its eval rate, prompt time and total; the pool's idle and parked tokens
(``/api/ps``) print after each answer of the second set.

    python benchmarks/after_a_long_turn.py
    python benchmarks/after_a_long_turn.py --prefix 6000 --env LOCALLLM_FLASH_ATTENTION=off
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _serve import Localllm, Tokens, model_path, story_prompt, system_prompt  # noqa: E402

MODEL = "smollm2:135m"


def answer(url: str, salt: int, n_ctx: int) -> float:
    """Generate one 128-token answer; print and return its eval rate (tokens/s)."""
    r = httpx.post(url + "/api/generate", timeout=600, json={
        "model": MODEL, "prompt": story_prompt(salt), "stream": False,
        "options": {"num_predict": 128, "temperature": 0, "num_ctx": n_ctx}}).json()
    rate = r["eval_count"] / r["eval_duration"] * 1e9
    print(f"  {r['eval_count']} tokens: eval {rate:.1f} tok/s, prompt {r['prompt_eval_duration'] / 1e6:.0f} ms, "
          f"total {r['total_duration'] / 1e6:.0f} ms")
    return rate


def pool(url: str) -> str:
    m = httpx.get(url + "/api/ps").json()["models"][0]
    return f"pool: {m.get('kv_cells_cached')} idle tokens, {m.get('kv_tokens_parked')} parked"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix", type=int, default=3000, help="the conversation's system prompt, in tokens")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server (repeatable)")
    args = ap.parse_args()
    tok = Tokens(model_path(MODEL))
    n_ctx = max(4096, args.prefix + 1024)
    env = {"LOCALLLM_NUM_PARALLEL": str(args.slots), **dict(e.split("=", 1) for e in args.env)}
    with Localllm(env=env) as s:
        print("before:")
        answer(s.url, 999, n_ctx)  # the model loaded
        before = [answer(s.url, i, n_ctx) for i in range(3)]
        msgs = [{"role": "system", "content": system_prompt(args.prefix, tok, nonce=str(time.time()))},
                {"role": "user", "content": "Which rule covers refunds?"}]
        httpx.post(s.url + "/api/chat", timeout=600, json={"model": MODEL, "messages": msgs, "stream": False,
                                                             "options": {"num_predict": 16, "num_ctx": n_ctx}})
        print(f"after a {args.prefix:,}-token conversation ({pool(s.url)}):")
        after = []
        for i in range(3):
            after.append(answer(s.url, 10 + i, n_ctx))
            print("   ", pool(s.url))
    print(f"eval tok/s before {' / '.join(f'{x:.1f}' for x in before)}, after {' / '.join(f'{x:.1f}' for x in after)}")


if __name__ == "__main__":
    main()
