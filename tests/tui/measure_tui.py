"""Measure the terminal app (not a test: run it by hand, it prints figures).

    python tests/tui/measure_tui.py [--runs 5] [--tokens 200]

1. Start-up to an interactive screen: ``localllm chat`` in a real terminal (tmux), from launch to the
   prompt on screen, polled every ~10 ms (includes Python start-up and every import).
2. Render lag: end of generation (the Done event leaving the engine) to the last token on screen (the
   refresh after the final Markdown update), over answers of ``--tokens`` tokens at the model's speed.
3. Typing while it streams: per-key latency (key posted → character in the prompt) during streaming,
   against the same with the model idle.

Uses the default model installed in the test home (``~/.cache/localllm-tests/home``) and a scratch
LOCALLLM_HOME for chats.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = Path(os.environ.get("LOCALLLM_TEST_CACHE", "~/.cache/localllm-tests")).expanduser() / "home/data/models"


def startup(runs: int) -> list[float]:
    if not shutil.which("tmux"):
        print("tmux not found: start-up not measured")
        return []
    exe = Path(sys.executable).with_name("localllm")
    out = []
    for i in range(runs):
        home = tempfile.mkdtemp()
        session = f"llm-measure-{os.getpid()}-{i}"
        cmd = f"env LOCALLLM_HOME={home} LOCALLLM_MODELS={MODELS} {exe} chat"
        time.sleep(0.3)  # let the previous tmux server go away
        t0 = time.perf_counter()
        subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "100", "-y", "30", cmd], check=True)
        try:
            while time.perf_counter() - t0 < 20:
                screen = subprocess.run(["tmux", "capture-pane", "-t", session, "-p"], capture_output=True,
                                        text=True).stdout
                if "Enter sends" in screen and "no answer yet" in screen:
                    out.append(time.perf_counter() - t0)
                    break
                time.sleep(0.01)
        finally:
            subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
            shutil.rmtree(home, ignore_errors=True)
    return out


async def streaming(tokens: int, answers: int) -> tuple[list[float], list[float], list[float], list[float]]:
    os.environ["LOCALLLM_HOME"] = tempfile.mkdtemp()
    os.environ["LOCALLLM_MODELS"] = str(MODELS)
    from localllm.chats import ChatStore
    from localllm.tui.app import LocalLLMApp
    from localllm.tui.widgets import PromptInput

    chats = ChatStore(Path(os.environ["LOCALLLM_HOME"]) / "chats.sqlite3")
    conv = chats.create(title="measure", model="smollm2:135m",
                        params={"temperature": 0.7, "seed": 3, "max_tokens": tokens})
    app = LocalLLMApp(model="smollm2:135m", chats=chats)
    lags, busy_keys, idle_keys, rates = [], [], [], []
    async with app.run_test(size=(120, 40)) as pilot:
        screen = app.screen
        prompt = screen.query_one(PromptInput)

        async def key_latency(char: str) -> float:
            before = prompt.text
            t0 = time.perf_counter()
            app.post_message(__import__("textual.events", fromlist=["Key"]).Key(char, char))
            while prompt.text == before:
                await asyncio.sleep(0.001)
            return time.perf_counter() - t0

        # warm the model
        await pilot.press(*"Hi", "enter")
        while not screen.answer_done.is_set():
            await asyncio.sleep(0.05)
        for i in range(answers):
            chats.update(conv.id, params={"temperature": 0.7, "seed": 10 + i, "max_tokens": tokens})
            screen.conversation = chats.get(conv.id)
            await pilot.press(*"Write a long story about a lighthouse keeper.", "enter")
            while not screen.generating:
                await asyncio.sleep(0.01)
            while screen.generating:
                answer = screen._last_answer()
                if answer is not None and answer.markdown.source:
                    busy_keys.append(await key_latency("a"))
                await asyncio.sleep(0.05)
            await screen.answer_done.wait()
            await pilot.pause(0.2)
            lags.append(screen.render_lag_s)
            rates.append(screen.last_info.stats.eval_rate)
            prompt.clear()
            for _ in range(10):
                idle_keys.append(await key_latency("b"))
            prompt.clear()
    chats.close()
    return lags, busy_keys, idle_keys, rates


def summary(name: str, values: list[float], unit: str = "ms", scale: float = 1000) -> None:
    if not values:
        return
    v = sorted(x * scale for x in values)
    p95 = v[min(len(v) - 1, int(round(0.95 * (len(v) - 1))))]
    print(f"{name}: n={len(v)} median {statistics.median(v):.1f} {unit}, p95 {p95:.1f} {unit}, max {v[-1]:.1f} {unit}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--answers", type=int, default=3)
    args = ap.parse_args()
    summary("start-up to interactive screen (tmux)", startup(args.runs), "s", 1)
    lags, busy, idle, rates = asyncio.run(streaming(args.tokens, args.answers))
    print(f"generation speed during the runs: {', '.join(f'{r:.1f}' for r in rates)} tok/s")
    summary("end of generation -> last token on screen", lags)
    summary("key -> prompt while streaming", busy)
    summary("key -> prompt while idle", idle)


if __name__ == "__main__":
    main()
