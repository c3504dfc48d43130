"""The decode loop: many sequences in one batch per step, the shared KV pool, faults that end one stream.

Real model (llama.cpp; F32 where outputs are compared exactly, since only F32 kernels are batch-invariant
on the CPU), plus the fake token source for a crash in one sequence.
"""

from __future__ import annotations

import threading
import time

import pytest

from backends.contract.errors import BackendError
from backends.contract.events import TextChunk
from backends.contract.specs import GenerateRequest, LoadSpec, Sampling, Tuning
from backends.core.prompt_cache import PromptCacheSpec
from backends.registry import load
from tests.backends.conftest import collect
from tests.fakes import fake

QUESTIONS = ["Tell me a story about a cat.", "Write a poem about rain.", "Explain gravity to a child.",
             "List three fruits and their colours."]
SYSTEM = ("You are a meticulous assistant for a hardware store. Answer briefly, name the aisle, and never "
          "invent products. " * 6)


def chat(q: str, n: int = 48, system: str | None = None, **kw) -> GenerateRequest:
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": q}]
    return GenerateRequest(messages=msgs, sampling=Sampling(temperature=0.0, max_tokens=n, **kw))


def run_together(model, reqs: list[GenerateRequest]) -> list[tuple[str, object]]:
    out: list[tuple[str, object] | None] = [None] * len(reqs)
    start = threading.Barrier(len(reqs))

    def work(i: int) -> None:
        start.wait()
        text, done, _ = collect(model.generate(reqs[i]))
        out[i] = (text, done)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert all(o is not None for o in out)
    return out  # type: ignore[return-value]


@pytest.fixture(scope="module")
def f32_model(derived_model):
    m = load("llamacpp", LoadSpec(str(derived_model("f32")), n_ctx=1024, slots=4))
    yield m
    m.close()


def _empty_pool(model) -> None:
    model.call(lambda s: model.pool.clear())


def test_concurrent_streams_equal_their_solo_output_on_f32(f32_model):
    solo = [collect(f32_model.generate(chat(q)))[0] for q in QUESTIONS]
    steps0 = f32_model.metrics().steps
    together = run_together(f32_model, [chat(q) for q in QUESTIONS])
    assert [t for t, _ in together] == solo
    m = f32_model.metrics()
    gen = sum(d.stats.eval_count for _, d in together)  # type: ignore[attr-defined]
    assert m.steps - steps0 < gen * 0.6, "the streams were not batched: one step per token"
    assert m.slots == 4 and m.slots_busy == 0


def test_a_shared_system_prompt_is_evaluated_once(f32_model):
    _empty_pool(f32_model)
    before = f32_model.metrics()
    first = collect(f32_model.generate(chat("Where are the hammers?", n=8, system=SYSTEM)))[1]
    rest = run_together(f32_model, [chat(q, n=8, system=SYSTEM) for q in
                                    ("Do you sell nails?", "Where is the paint?", "Any garden hoses?")])
    after = f32_model.metrics()
    sys_tokens = first.stats.prompt_eval_count - 12  # the system prompt is most of every prompt
    evaluated = after.prompt_tokens_evaluated - before.prompt_tokens_evaluated
    assert evaluated < first.stats.prompt_eval_count + 3 * 20, evaluated  # not 4 × the system prompt
    assert all(d.stats.prompt_cached_tokens >= sys_tokens for _, d in rest)  # type: ignore[attr-defined]
    assert after.prompt_tokens_copied > before.prompt_tokens_copied


def test_a_system_prompt_sent_by_four_clients_at_once_is_evaluated_once(f32_model):
    """Four requests with the same long system prompt arriving together: the later ones wait for the first
    one's prefill of the shared part and copy it, instead of evaluating it four times side by side; the
    answers are the ones each gets alone."""
    asks = ("Where are the hammers?", "Do you sell nails?", "Where is the paint?", "Any garden hoses?")
    _empty_pool(f32_model)
    solo = []
    for q in asks:
        solo.append(collect(f32_model.generate(chat(q, n=8, system=SYSTEM)))[:2])
        _empty_pool(f32_model)
    before = f32_model.metrics()
    together = run_together(f32_model, [chat(q, n=8, system=SYSTEM) for q in asks])
    after = f32_model.metrics()
    assert [t for t, _ in together] == [t for t, _ in solo]
    prompt = solo[0][1].stats.prompt_eval_count
    evaluated = after.prompt_tokens_evaluated - before.prompt_tokens_evaluated
    assert evaluated < prompt + 3 * 20, f"{evaluated} prompt tokens evaluated for four {prompt}-token prompts"
    cached = sorted(d.stats.prompt_cached_tokens for _, d in together)  # type: ignore[attr-defined]
    assert cached[0] == 0 and all(c >= prompt - 20 for c in cached[1:]), cached


def test_a_disconnect_frees_its_slot_and_cells_within_a_step(f32_model):
    gen = f32_model.generate(chat("Count from 1 to 300, one number per line.", n=300))
    for ev in gen:
        if isinstance(ev, TextChunk):
            break
    assert f32_model.metrics().slots_busy == 1
    steps = f32_model.metrics().steps
    gen.close()
    t0 = time.monotonic()
    while f32_model.metrics().slots_busy and time.monotonic() - t0 < 60:  # a stuck loop, not a slow machine
        time.sleep(0.01)
    m = f32_model.metrics()
    assert m.slots_busy == 0 and m.kv_tokens_active == 0
    # "within a step" counted in steps, not seconds (an F32 step takes 0.2-0.6 s on a loaded 2-core machine):
    # the step in flight when the client left, and at most one more before the slot is freed
    assert m.steps - steps <= 2, (m.steps - steps, "steps ran for a client that had left")


def test_a_cancelled_request_keeps_its_evaluated_prompt_in_the_pool_and_on_disk(default_model_path, tmp_path):
    """A client that leaves at the first token (a user pressing stop, an agent aborting): the prompt it had
    evaluated stays, so the next request with the same system prompt evaluates only its own question, and the
    disk cache has it for the next process."""
    system = SYSTEM * 4
    spec = PromptCacheSpec(str(tmp_path), "test-model", min_tokens=256)
    with load("llamacpp", LoadSpec(str(default_model_path), n_ctx=2048, slots=1),
              prompt_cache=spec) as m:
        gen = m.generate(chat("Where are the hammers?", n=64, system=system))
        for ev in gen:
            if isinstance(ev, TextChunk):
                break
        gen.close()
        t0 = time.monotonic()
        while len(list(tmp_path.glob("*.kv"))) < 2 and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        saved = sorted(int(p.name.split("-")[0]) for p in tmp_path.glob("*.kv"))
        before = m.metrics()
        done = collect(m.generate(chat("Do you sell nails?", n=4, system=system)))[1]
        evaluated = m.metrics().prompt_tokens_evaluated - before.prompt_tokens_evaluated
    assert len(saved) == 2 and saved[0] > 500, saved  # where the system prompt ends, and the whole prompt
    assert done.stats.prompt_eval_count > 500 and evaluated < 30, evaluated


def test_a_long_prompt_does_not_stall_streams_in_flight(default_model_path):
    with load("llamacpp", LoadSpec(str(default_model_path), n_ctx=4096, slots=2,
                                   tuning=Tuning(prefill_chunk=32))) as m:
        times: list[float] = []  # when each of the stream's tokens arrived
        started = threading.Event()

        def stream() -> None:
            for ev in m.generate(chat("Count from 1 to 200.", n=120)):
                if isinstance(ev, TextChunk):
                    times.append(time.monotonic())
                    started.set()

        t = threading.Thread(target=stream)
        t.start()
        started.wait(60)
        # ~630 tokens: 20 chunks of 32. (On CPU, flash attention costs ~10 ms a token in chunks this small
        # against ~4 in the default 128: a 1,250-token prompt here took 14 s.)
        long_prompt = "Summarise this: " + "the quick brown fox jumps over the lazy dog. " * 62
        submitted = time.monotonic()
        first = None
        done = None
        for ev in m.generate(chat(long_prompt, n=4)):
            if first is None and isinstance(ev, TextChunk):
                first = time.monotonic()  # the prompt is evaluated: its prefill is over
            done = ev
        t.join(120)
        assert first is not None and done.stats.prompt_eval_count > 600
        # the prompt took ~20 steps of 32 tokens; the stream got a token in each of them meanwhile. Counted in
        # tokens, not seconds (a loaded machine stretches every step alike; an unchunked prefill is one step
        # and gives the stream at most a token or two): at least half as many tokens as the prefill had chunks
        during = sum(submitted < x < first for x in times)
        chunks = done.stats.prompt_eval_count // 32
        assert during >= chunks // 2, (during, chunks)


def test_one_crashing_sequence_ends_only_its_stream():
    spec = LoadSpec("fake.gguf", slots=3)
    with load(fake(delay=0.002, chunk=1, crash_after=5, crash_if="boom"), spec) as m:
        out: dict[str, object] = {}

        def run(name: str, req: GenerateRequest) -> None:
            try:
                out[name] = collect(m.generate(req))[0]
            except BackendError as e:
                out[name] = e

        reqs = {"a": GenerateRequest(prompt="a" * 40), "boom": GenerateRequest(prompt="boom" * 10),
                "b": GenerateRequest(prompt="b" * 40)}
        threads = [threading.Thread(target=run, args=kv) for kv in reqs.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert isinstance(out["boom"], BackendError) and "crashed" in str(out["boom"])
        assert out["a"] == "a" * 40 and out["b"] == "b" * 40  # decoded beside it, to the end
        assert m.metrics().slots_busy == 0


def test_an_error_in_one_request_leaves_the_others_streaming(default_model_path):
    with load("llamacpp", LoadSpec(str(default_model_path), n_ctx=1024, slots=3)) as m:
        results: dict[int, object] = {}

        def run(i: int, req: GenerateRequest) -> None:
            try:
                results[i] = collect(m.generate(req))
            except BackendError as e:
                results[i] = e

        bad = GenerateRequest(messages=[{"role": "user", "content": "x"}],
                              format={"type": "object", "properties": {"x": {"$ref": "http://x/y.json"}}})
        reqs = [chat("Tell me about the sea.", n=24), bad, chat("Tell me about the moon.", n=24)]
        threads = [threading.Thread(target=run, args=(i, r)) for i, r in enumerate(reqs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert isinstance(results[1], BackendError) and "grammar" in str(results[1])
        for i in (0, 2):
            text, done, _ = results[i]  # type: ignore[misc]
            assert len(text) > 20 and done.finish_reason in ("stop", "length")


def test_a_full_pool_makes_a_prompt_wait_not_fail(default_model_path):
    # 2 slots of 256 tokens: two long prompts cannot both be in the pool with their answers at once
    with load("llamacpp", LoadSpec(str(default_model_path), n_ctx=256, slots=2)) as m:
        assert m.info.kv_cells == 512
        long = "Repeat: " + "one two three four five six seven eight nine ten. " * 15  # ~180 tokens
        out = run_together(m, [chat(long, n=75), chat(long.replace("one", "uno"), n=75)])
        for text, done in out:
            assert done.finish_reason in ("stop", "length") and text  # type: ignore[attr-defined]


def test_seeded_request_alone_repeats_exactly_and_idle_prefixes_survive(default_model_path):
    with load("llamacpp", LoadSpec(str(default_model_path), n_ctx=1024, slots=2)) as m:
        req = chat("Write a limerick about a printer.", n=40, seed=9)
        req.sampling.temperature = 0.9
        a = collect(m.generate(req))[0]
        collect(m.generate(chat("Other conversation", n=8)))  # goes to another sequence id
        b, done, _ = collect(m.generate(req))
        assert a == b and done.stats.prompt_cached_tokens == done.stats.prompt_eval_count


def test_pool_metrics_move(default_model_path):
    with load("llamacpp", LoadSpec(str(default_model_path), n_ctx=512, slots=2)) as m:
        m0 = m.metrics()
        collect(m.generate(chat("Hi", n=8)))
        m1 = m.metrics()
        assert m1.requests == m0.requests + 1 and m1.generated_tokens > m0.generated_tokens
        assert m1.prompt_tokens_evaluated > 0 and m1.kv_tokens_idle > 0 and m1.kv_tokens_active == 0
        assert m1.kv_cells == 1024


def test_idle_kv_is_parked_while_others_decode_and_comes_back(derived_model):
    """One unified pool (LOCALLLM_KV_UNIFIED; the memory of sliding-window and hybrid models): two requests decode
    together, an idle conversation's cells leave the pool (its state waits in host memory, so attention does not
    span it) and come back when it continues, with the same answer."""
    conv = chat("Tell me about the sea.", n=16)
    others = [chat("Tell me about the moon.", n=16), chat("Name three trees.", n=16)]
    texts = []
    for no_park in (False, True):
        spec = LoadSpec(str(derived_model("f32")), n_ctx=1024, slots=2, tuning=Tuning(park=not no_park),
                        kv_unified=True)
        with load("llamacpp", spec) as m:
            first, done1, _ = collect(m.generate(conv))
            held = done1.stats.context_used
            run_together(m, others)
            met = m.metrics()
            if not no_park:
                assert met.kv_tokens_parked >= held and met.kv_parked_bytes > 0  # the conversation, parked
                assert met.kv_tokens_idle > 0  # the two that just ended stay: nothing runs beside them now
            follow = GenerateRequest(messages=[*conv.messages, {"role": "assistant", "content": first},
                                               {"role": "user", "content": "And the ocean?"}],
                                     sampling=Sampling(temperature=0.0, max_tokens=16))
            text, done, _ = collect(m.generate(follow))
            assert done.stats.prompt_cached_tokens >= held - 2  # the turn so far came back, not evaluated again
            if not no_park:
                assert m.metrics().kv_tokens_parked < met.kv_tokens_parked
            texts.append(text)
    assert texts[0] == texts[1]


def test_parking_goes_on_after_the_pool_was_emptied(default_model_path):
    """The parked total is the parked sequences' own: a pool emptied while a conversation was parked (and then
    a bigger one to park beside others) parks within its budget instead of failing the requests."""
    with load("llamacpp", LoadSpec(str(default_model_path), n_ctx=256, slots=2, kv_unified=True)) as m:
        assert m.pool.park_budget == 256
        collect(m.generate(chat("Tell me about the sea.", n=40)))
        run_together(m, [chat("Name a tree.", n=8), chat("Name a bird.", n=8)])
        assert m.metrics().kv_tokens_parked > 40  # the first conversation, parked beside the two
        _empty_pool(m)
        long = chat("Summarise: " + "the quick brown fox jumps over the lazy dog. " * 12, n=40)
        held = collect(m.generate(long))[1].stats.context_used
        assert 150 < held <= 256
        out = run_together(m, [chat("Name a fish.", n=8), chat("Name a city.", n=8)])
        assert all(done.finish_reason in ("stop", "length") for _, done in out)  # type: ignore[attr-defined]
        assert m.metrics().kv_tokens_parked >= held


def test_a_conversation_evicted_from_its_kv_stream_comes_back_from_the_disk(derived_model, tmp_path):
    """A stream per slot (the default) keeps as many conversations as there are slots: a third one takes the
    stream of the one idle longest, whose turn so far is saved to the prompt cache on disk and restored from there
    when it continues, with the same answer as where it stayed."""
    conv = chat("Tell me about the sea.", n=16)
    others = [chat("Tell me about the moon.", n=16), chat("Name three trees.", n=16)]
    follow_up = [{"role": "user", "content": "And the ocean?"}]
    texts = []
    for crowded in (False, True):
        cache = PromptCacheSpec(str(tmp_path / f"pc{crowded}"), "f32 test", max_bytes=1 << 30, min_tokens=16)
        spec = LoadSpec(str(derived_model("f32")), n_ctx=1024, slots=2)
        with load("llamacpp", spec, prompt_cache=cache) as m:
            assert m.info.kv_streams
            first, done1, _ = collect(m.generate(conv))
            held = done1.stats.context_used
            if crowded:
                run_together(m, others)
                assert m.metrics().evictions >= 1 and m.metrics().kv_tokens_parked == 0
            follow = GenerateRequest(messages=[*conv.messages, {"role": "assistant", "content": first}, *follow_up],
                                     sampling=Sampling(temperature=0.0, max_tokens=16))
            text, done, _ = collect(m.generate(follow))
            if crowded:  # the first prompt came back from the disk (its answer is evaluated again)
                assert done.stats.prompt_restored_tokens >= done1.stats.prompt_eval_count - 1
            else:
                assert done.stats.prompt_cached_tokens >= held - 2  # the turn so far, kept in its stream
            texts.append(text)
    assert texts[0] == texts[1]


def test_consumers_that_stop_reading_do_not_hold_the_steps_back(f32_model):
    """Where the evaluation fills the CPU, a step first lets its consumers finish with the last step's tokens
    (their work during a decode would stall llama.cpp's threads). Two consumers that read nothing until their
    answers end are waited for once, not at every step, and lose nothing. (How many cores this machine has is not
    what the test is about: the load is marked CPU-bound by hand.)"""
    from backends.core.scheduler import SETTLE_MAX_NS

    reqs = [chat(q, n=48) for q in QUESTIONS[:2]]
    solo = [collect(f32_model.generate(r))[0] for r in reqs]
    was = f32_model.call(lambda _s: f32_model._fills_cpu)
    f32_model.call(lambda _s: setattr(f32_model, "_fills_cpu", True))
    try:
        before = f32_model.metrics()
        chans = [f32_model.submit(r) for r in reqs]
        deadline = time.monotonic() + 300
        while not all(c.closed for c in chans) and time.monotonic() < deadline:
            time.sleep(0.02)  # reading nothing
        after = f32_model.metrics()
        texts = [collect(iter(c))[0] for c in chans]
    finally:
        f32_model.call(lambda _s: setattr(f32_model, "_fills_cpu", was))
    steps = after.steps - before.steps
    waited = after.consumer_wait_ns - before.consumer_wait_ns
    assert steps >= 20
    assert waited <= 3 * SETTLE_MAX_NS, f"{waited / 1e6:.1f} ms waited over {steps} steps"  # every step: ~4 ms each
    assert texts == solo
