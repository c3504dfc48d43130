"""Multi-turn prefix reuse: with ~1500 tokens of history, the time to first token of turn 5 should be
at most 1.3 x that of turn 1 when both send the same new message (only the new tokens are evaluated).

Each repetition loads the model fresh, warms it up on an unrelated raw prompt, then plays a chat
through the `localllm run` streaming path: turn 1 = the question; turns 2-4 = long passages to
summarise (building the history); turn 5 = the turn-1 question again. For contrast it also times
turn 5's full request on a freshly loaded model (no reuse possible).

    python benchmarks/multiturn_ttft.py --repetitions 3
"""

from __future__ import annotations

import argparse
import json
import statistics

from _common import engine_and_model, mean_std

SYSTEM = "You are a helpful assistant. Answer briefly."
QUESTION = "What is the capital of France? Answer in one sentence."
PASSAGE = (
    "The history of cartography traces the development of maps from early drawings on clay tablets and "
    "cave walls to the precise digital projections used today. Ancient Babylonian maps showed the world "
    "as a flat disc surrounded by ocean, while Greek scholars such as Eratosthenes estimated the "
    "circumference of the Earth with remarkable accuracy by comparing shadows in two cities. Ptolemy's "
    "Geography introduced coordinates of latitude and longitude, and medieval Islamic geographers like "
    "al-Idrisi produced detailed world maps for the courts of their patrons. During the Age of Discovery, "
    "Portuguese and Spanish navigators drew portolan charts with rhumb lines that helped sailors cross "
    "unknown seas, and Gerardus Mercator designed his famous projection so that a straight line on the "
    "chart would keep a constant compass bearing. Later, national surveys measured whole countries by "
    "triangulation, aerial photography transformed the twentieth century, and satellites now let anyone "
    "carry a map of the entire planet in a pocket. "
)


def turn_messages(k: int) -> str:
    return f"Passage {k}:\n\n{PASSAGE * 2}{PASSAGE[:400]}\nSummarise passage {k} in one sentence."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--answer-tokens", type=int, default=40)
    ap.add_argument("--num-ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from localllm.api import GenerateRequest, Sampling
    from localllm.cli.answer import stream_answer
    from localllm.loader import LoadOptions

    engine, name, _path = engine_and_model(args.model)
    options = LoadOptions(num_ctx=args.num_ctx, draft="none", num_thread=args.threads)
    sampling = Sampling(temperature=0.0, seed=0, max_tokens=args.answer_tokens)

    def fresh() -> None:
        engine.unload(name)
        engine.load(name, options)
        warm = GenerateRequest(prompt="Warm-up: one two three", sampling=Sampling(temperature=0.0, max_tokens=4))
        stream_answer(engine, name, warm, options)

    def ask(messages: list[dict]) -> tuple[float, object, str]:
        req = GenerateRequest(messages=[{"role": "system", "content": SYSTEM}] + messages, sampling=sampling)
        answer = stream_answer(engine, name, req, options)
        return answer.first_token_s or float("nan"), answer.done.stats, answer.text

    t1s, t5s, t5cold, rows = [], [], [], []
    for rep in range(args.repetitions):
        fresh()
        history: list[dict] = []
        ttft1, s1, a1 = ask([{"role": "user", "content": QUESTION}])
        history += [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": a1}]
        for k in (2, 3, 4):
            msg = turn_messages(k)
            _, _, a = ask(history + [{"role": "user", "content": msg}])
            history += [{"role": "user", "content": msg}, {"role": "assistant", "content": a}]
        final = history + [{"role": "user", "content": QUESTION}]
        ttft5, s5, _ = ask(final)
        fresh()
        cold, sc, _ = ask(final)
        t1s.append(ttft1 * 1000)
        t5s.append(ttft5 * 1000)
        t5cold.append(cold * 1000)
        rows.append({"ttft1_ms": ttft1 * 1000, "ttft5_ms": ttft5 * 1000, "ttft5_cold_ms": cold * 1000,
                     "turn1_prompt_tokens": s1.prompt_eval_count, "turn5_prompt_tokens": s5.prompt_eval_count,
                     "turn5_cached_tokens": s5.prompt_cached_tokens, "turn5_cold_cached": sc.prompt_cached_tokens})
        print(f"rep {rep + 1}: turn1 {ttft1 * 1000:7.1f} ms ({s1.prompt_eval_count} prompt tokens)   "
              f"turn5 {ttft5 * 1000:7.1f} ms ({s5.prompt_eval_count} prompt tokens, "
              f"{s5.prompt_cached_tokens} reused)   "
              f"turn5 cold {cold * 1000:7.1f} ms", flush=True)
    ratio = statistics.fmean(t5s) / statistics.fmean(t1s)
    print(f"\nTTFT turn 1      : {mean_std(t1s)} ms")
    print(f"TTFT turn 5      : {mean_std(t5s)} ms   ratio turn5/turn1 = {ratio:.2f} (target <= 1.3)")
    print(f"TTFT turn 5 cold : {mean_std(t5cold)} ms   (same request without reuse: "
          f"{statistics.fmean(t5cold) / statistics.fmean(t1s):.1f} x turn 1)")
    if args.json:
        print(json.dumps({"model": name, "rows": rows, "ratio": ratio}))
    engine.close()


if __name__ == "__main__":
    main()
