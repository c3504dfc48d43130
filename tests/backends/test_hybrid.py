"""Hybrid memory (recurrent state beside attention cells) through the decode loop: a reused or restored prefix
answers as the prompt evaluated cold.

The model is made (:func:`tests.support_memory.make_hybrid`: a 4-layer ``qwen35`` with random F32 weights and
the default model's chat template), so answers are noise: each path is compared with the same prompt evaluated
cold (the pool emptied first), greedy, token for token, and with how many prompt tokens it evaluated.
"""

from __future__ import annotations

import pytest

from backends.base import GenerateRequest, LoadSpec, Sampling
from backends.registry import load
from tests.backends.conftest import collect

pytest.importorskip("llama_cpp")

SYSTEM = "You are the archivist of a small museum. " + " ".join(
    f"Room {i} holds the {w} collection; answer questions about it with the catalogue number." for i, w in
    enumerate(["coin", "map", "clock", "glass", "shell", "stamp", "lamp", "key"]))  # ~170 tokens
TURNS = ["Which room has the clocks?", "And the maps?", "Where are the keys kept?"]


def chat(turns: list[str], answers: list[str] | None = None, n: int = 12) -> GenerateRequest:
    """A chat: the system prompt, then user turns with the given assistant answers between them."""
    msgs = [{"role": "system", "content": SYSTEM}]
    for i, q in enumerate(turns):
        msgs.append({"role": "user", "content": q})
        if answers and i < len(answers):
            msgs.append({"role": "assistant", "content": answers[i]})
    return GenerateRequest(messages=msgs, sampling=Sampling(temperature=0.0, max_tokens=n))


def ask(model, req: GenerateRequest) -> tuple[str, int, int]:
    """(text, prompt tokens, prompt tokens reused) of one greedy generation."""
    text, done, _ = collect(model.generate(req))
    return text, done.stats.prompt_eval_count, done.stats.prompt_cached_tokens


def cold(model, req: GenerateRequest) -> str:
    """The answer with the whole prompt evaluated (every idle sequence dropped first)."""
    model.call(lambda s: model.pool.clear())
    text, n, cached = ask(model, req)
    assert cached == 0
    return text


@pytest.fixture(scope="module")
def hybrid(hybrid_model):
    m = load("llamacpp", LoadSpec(str(hybrid_model), n_ctx=1024, n_seq=2))
    assert m.info.recurrent
    yield m
    m.close()


def test_the_same_prompt_asked_again_answers_the_same(hybrid):
    """The wrong-answer bug: the repeat sampled its first token from the saved logits, then went on from an
    emptied sequence (the partial removal of the answer failed on the recurrent state)."""
    req = chat(TURNS[:1], n=16)
    first, _, _ = ask(hybrid, req)
    again, _, _ = ask(hybrid, req)
    assert again == first
    assert again == cold(hybrid, req)

