"""The next turn of a long conversation (what an agent sends all day): with the default settings (flash attention
off on the CPU) its few new tokens are evaluated, and its answer decoded, about as fast deep in a long context as at
its start. Real server over HTTP (its own, default settings), real default model (``/api/chat``, whose final object
also says how many prompt tokens came from the cache: ``prompt_cached_count``; the openai client, whose
``logit_bias`` keeps an answer going for its full length)."""

from __future__ import annotations

import json
import os
import time

import httpx
import openai
import pytest

from tests.server.conftest import MODEL
from tests.support_serve import ServeProcess


@pytest.fixture(scope="module")
def url(installed_default_model, tmp_path_factory):
    """A server of its own, default settings (``LOCALLLM_FLASH_ATTENTION=auto``: off on the CPU)."""
    with ServeProcess(tmp_path_factory.mktemp("next-turn-home")) as srv:
        yield srv.url

OPTS = {"temperature": 0, "num_predict": 8, "seed": 1}


def _system(n_rules: int, nonce: str) -> str:
    return "\n".join([f"You are a careful assistant for the Northwind project {nonce}. Follow every rule below."] + [
        f"Rule {i + 1}: when a customer asks about topic {i}, first check the order number, then quote section "
        f"{i % 7 + 1}.{i % 5 + 2} of the policy and end with one short sentence naming the next step."
        for i in range(n_rules)])


def test_the_new_tokens_of_turn_two_at_2k_depth_are_evaluated_about_as_fast_as_a_fresh_prompt(url):
    """Turn 2 of a chat with a ~2,000-token system prompt, sent as soon as turn 1 ends: its ~30 new tokens cost
    per token at most a few times what a fresh short prompt's do. With llama.cpp's flash attention on the CPU
    (``LOCALLLM_FLASH_ATTENTION=on``, llama.cpp's own auto setting) each new token reads the 2k cached keys one at a
    time: ~6-10x a fresh prompt's per-token time (llama-bench: 24 tokens at 3k depth 32 t/s with it, ~185 without),
    which is why the default turns it off there. The cold turn 1 goes through the flash-attention prefill context
    instead (``/metrics``), turn 2 does not."""
    nonce = f"{os.getpid()} {time.time_ns()}"

    def chat(messages: list[dict[str, str]]) -> dict:
        text, last = [], {}
        with httpx.stream("POST", url + "/api/chat", json={"model": MODEL, "messages": messages, "options": OPTS},
                          timeout=600) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line:
                    last = json.loads(line)
                    text.append(last.get("message", {}).get("content", ""))
        assert last.get("done"), last
        return {**last, "message": {"content": "".join(text)}}

    fresh = chat([{"role": "user", "content": f"Ticket {nonce}: which rule covers refunds, and which one covers "
                                              "shipping? Be brief."}])
    msgs = [{"role": "system", "content": _system(48, nonce)},
            {"role": "user", "content": "Which rule covers refunds? One sentence."}]
    before = _flash_tokens(url)
    t1 = chat(msgs)
    assert t1["prompt_eval_count"] > 1800, t1["prompt_eval_count"]  # deep enough for the cost to show
    # the cold prompt went through the flash-attention prefill context, all of it but a tail under 128 tokens
    cold = t1["prompt_eval_count"] - t1["prompt_cached_count"]
    assert cold - 128 < _flash_tokens(url) - before <= cold
    msgs += [{"role": "assistant", "content": t1["message"]["content"]},
             {"role": "user", "content": "And which one covers shipping? One sentence."}]
    before = _flash_tokens(url)
    t2 = chat(msgs)
    new = t2["prompt_eval_count"] - t2["prompt_cached_count"]
    assert 0 < new < 80, (new, t2)  # only the new turn is evaluated (the rest is cached)
    assert _flash_tokens(url) == before  # a short turn: the main context, without flash attention
    per_fresh = fresh["prompt_eval_duration"] / (fresh["prompt_eval_count"] - fresh["prompt_cached_count"])
    per_deep = t2["prompt_eval_duration"] / new
    assert per_deep < 4 * per_fresh, (
        f"turn 2's {new} new tokens took {per_deep / 1e6:.1f} ms each at {t1['prompt_eval_count']:,} tokens deep, "
        f"a fresh prompt's {per_fresh / 1e6:.1f} ms")


def _flash_tokens(url: str) -> int:
    """``/metrics``' count of prompt tokens the prefill context evaluated (the default model's)."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("localllm_prompt_tokens_flash_total{"):
            return int(float(line.split()[-1]))
    return 0


def _eog(path) -> list[int]:
    """The default model's end-of-generation tokens (what ``logit_bias`` -100 keeps out), from its vocabulary."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    return [t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)]


def _decode_rate(client: openai.OpenAI, messages: list[dict[str, str]], bias: dict[str, int], n: int) -> float:
    """Tokens a second after the first of a streamed ``n``-token answer, client-measured."""
    times = []
    s = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=n, temperature=0, seed=1,
                                       stream=True, logit_bias=bias)
    for ch in s:
        if ch.choices and ch.choices[0].delta.content:
            times.append(time.perf_counter())
    assert len(times) >= n - 2, len(times)  # one chunk a token (a chunk may hold two at a UTF-8 boundary)
    return (len(times) - 1) / (times[-1] - times[0])


def test_an_answer_2k_tokens_deep_decodes_at_least_half_as_fast_as_one_at_the_start(url, default_model_path):
    """Decoding ~2,000 tokens into a context: each step attends over the cached keys. Without flash attention (the
    CPU default) that costs ~1.5x a step at the start; llama.cpp's CPU flash-attention kernel
    (``LOCALLLM_FLASH_ATTENTION=on``), which reads them one at a time, ~3x (llama-bench tg16: 52 vs 21 t/s at 3k
    depth, 99 vs 69 at 256; this test: 16.8 vs 50.6 with it)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=600)
    bias = {str(t): -100 for t in _eog(default_model_path)}
    nonce = f"{os.getpid()} {time.time_ns()}"
    ask = [{"role": "user", "content": f"Ticket {nonce}: tell a short story about a lighthouse."}]
    deep = [{"role": "system", "content": _system(48, nonce)}, *ask]
    _decode_rate(client, deep, bias, 4)  # the long prompt evaluated (and cached) first: decode only, below
    rates = [(_decode_rate(client, ask, bias, 48), _decode_rate(client, deep, bias, 48)) for _ in range(2)]
    start, at_depth = max(r[0] for r in rates), max(r[1] for r in rates)
    assert at_depth > start / 2, f"{at_depth:.1f} tok/s 2k tokens deep against {start:.1f} at the start"
