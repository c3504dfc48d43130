"""What every backend must do, on the real default model: parametrized over ``conftest.BACKENDS``.

Generations are short (≤ 64 tokens) and seeded or greedy, so the whole file runs in well under a minute.
"""

from __future__ import annotations

import json
import math
import threading

import pytest

from backends.contract.errors import BackendError, ContextOverflowError, ModelLoadError, UnsupportedError
from backends.contract.events import Done, TextChunk
from backends.contract.specs import GenerateRequest, LoadSpec, Sampling
from tests.backends.conftest import collect

CAPITAL = [{"role": "user", "content": "What is the capital of France? Answer in one short sentence."}]


def greedy(n: int = 32, **kw) -> Sampling:
    return Sampling(temperature=0.0, max_tokens=n, **kw)


def test_info_describes_the_model(backend):
    info = backend.info
    assert info.architecture == "llama"
    assert info.n_layers == 30 and info.n_vocab == 49152
    assert info.n_ctx == 2048 and info.n_ctx_train == 8192
    assert info.chat_template and "<|im_start|>" in info.chat_template
    assert info.size_bytes > 50_000_000
    assert info.kv_cache_type == "f16" and info.draft is None


def test_answers_a_simple_question(backend):
    text, done, events = collect(backend.generate(GenerateRequest(messages=CAPITAL, sampling=greedy(24))))
    assert "Paris" in text
    assert all(isinstance(e, TextChunk) and e.text for e in events[:-1])
    s = done.stats
    assert done.finish_reason == "stop"
    assert 0 < s.eval_count <= 24
    assert s.prompt_eval_count > 10 and s.eval_duration > 0 and s.prompt_eval_duration > 0
    assert s.n_ctx == 2048 and s.context_used >= s.prompt_eval_count


def test_raw_prompt_completion(backend):
    text, done, _ = collect(backend.generate(GenerateRequest(prompt="1, 2, 3, 4, 5,", sampling=greedy(6))))
    assert text.strip().startswith("6")


def test_same_seed_same_text_other_seed_differs(backend):
    def sample(seed: int) -> str:
        req = GenerateRequest(messages=[{"role": "user", "content": "Tell me a story about a dragon."}],
                              sampling=Sampling(temperature=1.0, top_k=0, top_p=1.0, seed=seed, max_tokens=16))
        return collect(backend.generate(req))[0]

    a, b = sample(42), sample(42)
    assert a == b and len(a) > 20
    assert sample(0) == sample(0)  # seed 0 is a seed, not "random"
    assert any(sample(s) != a for s in (43, 44))


def test_stop_string_never_leaks(backend):
    req = GenerateRequest(messages=CAPITAL, sampling=greedy(24))
    full, _, _ = collect(backend.generate(req))
    k = full.index("capital")  # a stop string that spans several tokens, in the middle of the answer
    stop = full[k : k + 10]
    req = GenerateRequest(messages=CAPITAL, sampling=greedy(24, stop=["zzz-not-there", stop]))
    text, done, events = collect(backend.generate(req))
    assert text == full[:k]
    assert done.finish_reason == "stop"
    streamed = ""
    for e in events[:-1]:
        streamed += e.text
        assert stop not in streamed and not full[k:].startswith(streamed[k:] or "\0")


def test_max_tokens_ends_with_length(backend):
    req = GenerateRequest(messages=[{"role": "user", "content": "Write a long essay about the sea."}],
                          sampling=greedy(5))
    _, done, _ = collect(backend.generate(req))
    assert done.finish_reason == "length" and done.stats.eval_count == 5


def test_multi_turn_reuses_the_prompt_prefix(backend):
    turn1 = [{"role": "system", "content": "You are terse."}, *CAPITAL]
    a1, d1, _ = collect(backend.generate(GenerateRequest(messages=turn1, sampling=greedy(16))))
    turn2 = [*turn1, {"role": "assistant", "content": a1}, {"role": "user", "content": "And of Italy?"}]
    _, d2, _ = collect(backend.generate(GenerateRequest(messages=turn2, sampling=greedy(16))))
    assert d2.stats.prompt_cached_tokens >= d1.stats.prompt_eval_count
    assert d2.stats.prompt_eval_count > d2.stats.prompt_cached_tokens


def test_cancel_from_another_thread(backend):
    cancel, first = threading.Event(), threading.Event()
    threading.Thread(target=lambda: first.wait(30) and cancel.set(), daemon=True).start()
    req = GenerateRequest(messages=[{"role": "user", "content": "Count from 1 to 500."}], sampling=greedy(400))
    chunks = 0
    done = None
    for e in backend.generate(req, cancel):
        if isinstance(e, TextChunk):
            chunks += 1
            first.set()
        else:
            done = e
    assert isinstance(done, Done) and done.finish_reason == "cancelled"
    assert 0 < done.stats.eval_count < 400
    text, d, _ = collect(backend.generate(GenerateRequest(messages=CAPITAL, sampling=greedy(24))))
    assert "Paris" in text and d.finish_reason == "stop"


def test_closing_the_stream_early_leaves_the_model_usable(backend):
    gen = backend.generate(GenerateRequest(messages=[{"role": "user", "content": "Count to 100."}],
                                           sampling=greedy(100)))
    next(gen), next(gen)
    gen.close()
    text, done, _ = collect(backend.generate(GenerateRequest(messages=CAPITAL, sampling=greedy(24))))
    assert "Paris" in text and done.finish_reason == "stop"


PARIS_JSON = [{"role": "user", "content": "Give a JSON object describing Paris with keys city and population."}]


def test_json_mode_output_parses(backend):
    text, done, _ = collect(backend.generate(GenerateRequest(messages=PARIS_JSON, format="json",
                                                              sampling=greedy(120))))
    assert done.finish_reason == "stop"
    assert isinstance(json.loads(text), dict)


def test_json_schema_output_validates(backend):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    text, done, _ = collect(backend.generate(GenerateRequest(messages=PARIS_JSON, format=schema,
                                                              sampling=greedy(60))))
    obj = json.loads(text)
    assert set(obj) == {"city", "population"}
    assert isinstance(obj["city"], str) and len(obj["city"]) <= 20 and isinstance(obj["population"], int)


def test_unconvertible_schema_is_refused(backend):
    bad = {"type": "object", "properties": {"x": {"$ref": "https://example.com/remote.json"}}}
    with pytest.raises(UnsupportedError):
        collect(backend.generate(GenerateRequest(messages=PARIS_JSON, format=bad, sampling=greedy(8))))


def test_tools_need_a_template_that_takes_them(backend):
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    with pytest.raises(UnsupportedError, match="does not support tools"):
        collect(backend.generate(GenerateRequest(messages=CAPITAL, tools=tools, sampling=greedy(8))))


def _long_chat(turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": "You are a helpful assistant called Zed."}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"Turn {i}: " + "tell me about rivers and mountains. " * 3})
        msgs.append({"role": "assistant", "content": f"Answer {i}: " + "rivers flow down from mountains. " * 3})
    msgs.append({"role": "user", "content": "What is your name?"})
    return msgs


# the smallest context a load takes (planner.MIN_CTX): the fewest prompt tokens to evaluate (MLX's CPU backend
# prefills ~10 tokens/s on one core), and one shared load for both tests
SMALL_CTX = 128  # a turn is ~55 tokens: one fits beside the system prompt and the question, two do not


def test_context_overflow_drops_oldest_turns(backend_name, backend_factory):
    b = backend_factory(backend_name, n_ctx=SMALL_CTX)
    text, done, _ = collect(b.generate(GenerateRequest(messages=_long_chat(10), sampling=greedy(8))))
    s = done.stats
    assert s.dropped_messages >= 2 and s.dropped_messages % 2 == 0  # whole user+assistant turns
    assert s.prompt_eval_count + 8 <= SMALL_CTX  # room was kept for the answer
    assert s.prompt_eval_count > 60  # the newest turn stayed: not everything but the question was dropped


def test_prompt_that_cannot_fit_is_an_error_with_numbers(backend_name, backend_factory):
    b = backend_factory(backend_name, n_ctx=SMALL_CTX)
    huge = [{"role": "user", "content": "word " * 2000}]
    with pytest.raises(ContextOverflowError) as e:
        collect(b.generate(GenerateRequest(messages=huge, sampling=greedy(8))))
    assert e.value.n_ctx == SMALL_CTX and e.value.prompt_tokens > 1500
    assert str(SMALL_CTX) in str(e.value) and str(e.value.prompt_tokens) in str(e.value)


def test_embeddings_are_normalised_and_meaningful(backend):
    a, b, c = backend.embed(["The cat sat on the mat.", "A cat was sitting on the mat.",
                             "Quarterly corporate tax filing deadlines."])
    for v in (a, b, c):
        assert math.isclose(sum(x * x for x in v), 1.0, rel_tol=1e-4)

    def cos(x, y):
        return sum(p * q for p, q in zip(x, y, strict=True))

    assert cos(a, b) > cos(a, c)


def test_concurrent_generations_both_answer(backend):
    results: list[str] = []

    def worker() -> None:
        results.append(collect(backend.generate(GenerateRequest(messages=CAPITAL, sampling=greedy(16))))[0])

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 3 and all("Paris" in r for r in results)


def test_closed_backend_refuses_work_and_closes_twice(backend_name, backend_factory):
    b = backend_factory(backend_name, n_ctx=512, fresh=True)
    b.close()
    b.close()
    with pytest.raises(BackendError, match="unloaded"):
        list(b.generate(GenerateRequest(prompt="hi", sampling=greedy(2))))


def test_tokenize_round_trip(backend):
    toks = backend.tokenize("Hello world, ça va?")
    assert len(toks) >= 4
    assert backend.detokenize(toks) == "Hello world, ça va?"


# ---------------------------------------------------------------------------- the fake token source

from backends.registry import load  # noqa: E402
from tests.fakes import fake  # noqa: E402


def test_fake_source_crashes_mid_stream_and_fails_loads():
    with load(fake(reply="abcdefghij", chunk=2, crash_after=2), LoadSpec("x.gguf")) as m:
        gen = m.generate(GenerateRequest(prompt="hi"))
        assert [next(gen).text, next(gen).text] == ["ab", "cd"]
        with pytest.raises(BackendError, match="crashed"):
            next(gen)
    with pytest.raises(ModelLoadError, match="memory"):
        load(fake(fail_load="oom"), LoadSpec("x.gguf"))


def test_fake_source_honours_stops_cancel_and_length():
    with load(fake(reply="hello STOP world", chunk=1), LoadSpec("x.gguf")) as m:
        text, done, _ = collect(m.generate(GenerateRequest(prompt="p", sampling=Sampling(stop=["STOP"]))))
        assert text == "hello " and done.finish_reason == "stop"
        text, done, _ = collect(m.generate(GenerateRequest(prompt="p", sampling=Sampling(max_tokens=5))))
        assert text == "hello" and done.finish_reason == "length"
        cancel = threading.Event()
        cancel.set()
        _, done, _ = collect(m.generate(GenerateRequest(prompt="p"), cancel))
        assert done.finish_reason == "cancelled"
