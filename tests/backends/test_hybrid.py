"""Memory that cannot drop its tail through the decode loop — a hybrid's recurrent state beside attention cells,
a sliding window kept at window size: a reused or restored prefix answers as the prompt evaluated cold.

The models are made (:mod:`tests.support_memory`: a 4-layer ``qwen35`` hybrid, a 4-layer ``gemma3`` with a
32-token window on three layers, a 4-layer ``gpt-oss`` mixture of experts with a 32-token window on two; random
F32 weights, the default model's chat template), so answers are noise:
each path is compared with the same prompt evaluated cold (the pool emptied first), greedy, token for token, and
with how many prompt tokens it evaluated.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.contract.specs import GenerateRequest, LoadSpec, Sampling, Tuning
from backends.core.prompt_cache import PromptCacheSpec
from backends.registry import load
from tests.backends.conftest import collect
from tests.support_memory import LOG_STEP

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


@pytest.fixture(scope="module", params=["hybrid_model", "swa_model", "moe_model"], ids=["hybrid", "swa", "moe"])
def made(request) -> Path:
    """Each made model whose memory cannot drop its tail: the ``qwen35`` hybrid, the ``gemma3`` with a 32-token
    window (its cache holds the window, ``swa_full`` off), the ``gpt-oss`` MoE with the same window on every
    other layer."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def hybrid(made):
    m = load("llamacpp", LoadSpec(str(made), n_ctx=1024, slots=2))
    assert m.source.capabilities.checkpoints is not None
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


def test_regenerate_and_an_edited_middle_turn_restore_a_checkpoint_and_evaluate_only_the_rest(hybrid):
    t1, _, _ = ask(hybrid, chat(TURNS[:1]))
    t2, _, _ = ask(hybrid, chat(TURNS[:2], [t1]))
    turn3 = chat(TURNS, [t1, t2])
    want = cold(hybrid, turn3)
    ask(hybrid, chat(TURNS[:2], [t1]))  # the conversation is back at turn 2 (held whole, answer included)
    text, n, cached = ask(hybrid, turn3)  # turn 3 continues the held sequence
    assert text == want and n - cached < 40
    text, n, cached = ask(hybrid, turn3)  # regenerate: the same prompt again, nothing evaluated
    assert text == want and cached == n
    edited = chat([TURNS[0], "And the stamps, the shells and the lamps?", TURNS[2]], [t1, t2])
    want = cold(hybrid, edited)
    ask(hybrid, turn3)
    text, n, cached = ask(hybrid, edited)  # diverges inside turn 2: back to the checkpoint where it starts
    assert text == want
    assert cached > len(SYSTEM) // 6  # the system prompt and turn 1 at least (a transformer's reuse, less turn 2)
    m = hybrid.metrics()
    assert m.kv_checkpoints > 0 and m.kv_checkpoint_bytes > 0


def test_two_conversations_share_the_system_prompt_through_a_checkpoint(hybrid):
    a, b = chat(TURNS[:1]), chat(TURNS[2:3])
    want_b = cold(hybrid, b)
    ask(hybrid, a)
    text, n, cached = ask(hybrid, b)  # another conversation: the system prompt restored into a fresh sequence
    assert text == want_b
    assert cached >= len(SYSTEM) // 6
    assert ask(hybrid, a)[0] == cold(hybrid, a)  # the first conversation is still whole


def test_an_idle_conversation_is_parked_and_continues_as_if_it_had_stayed(made):
    m = load("llamacpp", LoadSpec(str(made), n_ctx=2048, slots=1))
    try:
        long = chat(TURNS[:1], n=8)
        long.messages[0]["content"] = SYSTEM * 4  # ~700 tokens: idle, it is parked beside a running request
        t1, _, _ = ask(m, long)
        other = chat(TURNS[1:2], n=8)
        other.messages[0]["content"] = "Be brief."
        ask(m, other)
        assert m.metrics().kv_tokens_parked > 0
        turn2 = GenerateRequest(messages=[*long.messages, {"role": "assistant", "content": t1},
                                          {"role": "user", "content": TURNS[1]}],
                                sampling=Sampling(temperature=0.0, max_tokens=12))
        text, n, cached = ask(m, turn2)
        assert cached > 600
        assert text == cold(m, turn2)
    finally:
        m.close()


def test_a_restarted_process_restores_the_prompt_from_the_disk_cache(hybrid, made, tmp_path: Path):
    spec = PromptCacheSpec(str(tmp_path / "m"), "hybrid", min_tokens=64, budget_root=str(tmp_path))
    first = load("llamacpp", LoadSpec(str(made), n_ctx=1024, slots=1), prompt_cache=spec)
    try:
        t1, _, _ = ask(first, chat(TURNS[:1]))
    finally:
        first.close()
    assert list((tmp_path / "m").glob("*.kv"))
    turn2 = chat(TURNS[:2], [t1])
    second = load("llamacpp", LoadSpec(str(made), n_ctx=1024, slots=1), prompt_cache=spec)
    try:
        text, done, _ = collect(second.generate(turn2))
        assert done.stats.prompt_restored_tokens > 150
        assert text == cold(hybrid, turn2)
    finally:
        second.close()


CHILD = """
import json, sys
sys.path.insert(0, {root!r})
from backends.contract.specs import LoadSpec
from backends.core.prompt_cache import PromptCacheSpec
from backends.registry import load
from tests.backends.conftest import collect
from tests.backends.test_hybrid import TURNS, chat
spec = PromptCacheSpec({cache!r}, "made", min_tokens=64)
m = load("llamacpp", LoadSpec({model!r}, n_ctx=1024, slots=1), prompt_cache=spec)
text, done, _ = collect(m.generate(chat(TURNS[:2], [{t1!r}])))
m.close()
print(json.dumps({{"text": text, "restored": done.stats.prompt_restored_tokens}}))
"""


def _cached(path: Path, root: Path):
    return load("llamacpp", LoadSpec(str(path), n_ctx=1024, slots=1),
                prompt_cache=PromptCacheSpec(str(root), "made", min_tokens=64))


def test_a_second_process_restores_the_conversation_and_answers_as_cold(hybrid, made, tmp_path: Path):
    """The state (recurrent + attention cells, or the windowed cells) saved by this process is loaded by a fresh
    interpreter (another address space, another context), which evaluates only the rest of turn 2."""
    import json
    import os
    import subprocess
    import sys

    first = _cached(made, tmp_path / "m")
    try:
        t1, _, _ = ask(first, chat(TURNS[:1]))
    finally:
        first.close()  # (flushes the background writes)
    assert list((tmp_path / "m").glob("*.kv"))
    code = CHILD.format(root=str(Path(__file__).resolve().parents[2]), cache=str(tmp_path / "m"), model=str(made),
                        t1=t1)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    assert r.returncode == 0, r.stderr[-2000:]
    child = json.loads(r.stdout.strip().splitlines()[-1])
    assert child["restored"] > 150  # the system prompt and turn 1 at least
    assert child["text"] == cold(hybrid, chat(TURNS[:2], [t1]))


@pytest.mark.parametrize("forged", [False, True], ids=["renamed", "forged"])
def test_a_cache_entry_of_another_model_is_refused_and_the_prompt_evaluated_cold(hybrid_model, swa_model, forged,
                                                                                 tmp_path: Path, caplog):
    """An entry the made ``gemma3`` saved, put where the hybrid looks for the same prompt: renamed (its header names
    the other model: refused on read) or with a forged header (only llama.cpp can tell: it refuses the state). Either
    way one log line of ours, the entry removed, the prompt evaluated cold and the cold answer."""
    import hashlib
    import json
    import logging

    other = _cached(swa_model, tmp_path / "swa")
    try:
        ask(other, chat(TURNS[:1]))  # saves the whole prompt of turn 1
    finally:
        other.close()
    (entry,) = (tmp_path / "swa").glob("*.kv")
    with open(entry, "rb") as f:
        head, state = json.loads(f.readline()), f.read()
    req = chat(TURNS[:2], ["Room 2."])  # turn 2: turn 1's prompt is its prefix
    m = _cached(hybrid_model, tmp_path / "hybrid")
    try:
        pc = m.prompt_cache
        assert pc is not None and pc.key != head["key"]
        want = cold(m, req)
        m.call(lambda s: m.pool.clear())
        pc.flush()
        pc.clear()  # (the hybrid's own entries)
        path = pc._path(head["tokens"])  # the same tokens (one tokenizer): the name the hybrid looks up
        if forged:
            head = {**head, "key": pc.key, "sha256": hashlib.sha256(state).hexdigest()}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(json.dumps(head).encode() + b"\n" + state)
        pc._scan()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="backends"):
            text, n, cached = ask(m, req)
        assert (text, cached) == (want, 0)
        # ours; llama.cpp's own ERROR lines about the state go to backends.llamacpp.native, quiet by default
        lines = [r.getMessage() for r in caplog.records
                 if r.name.startswith("backends") and r.name != "backends.llamacpp.native"]
        assert len(lines) == 1 and path.name in lines[0], lines
        assert ("refused" if forged else "another model") in lines[0]
        assert not path.exists()
    finally:
        m.close()


def test_a_restored_checkpoint_gives_the_cold_logits(made):
    import numpy as np

    from backends.contract.source import Feed
    from backends.llamacpp.source import LlamaCppSource

    src = LlamaCppSource(LoadSpec(str(made), n_ctx=1024, slots=2))
    try:
        assert src.capabilities.checkpoints is not None
        toks = src.prompt_tokens(SYSTEM + " " + SYSTEM)

        def run(seq: int, part: list[int], pos: int) -> np.ndarray:
            rows = src.evaluate([Feed(seq, part, pos, 1)])[0]
            return np.asarray(src.logits(rows[-1]))

        cut = 200
        run(0, toks[:cut], 0)
        ck = src.checkpoint_save(0)
        whole = run(0, toks[cut:], cut)
        if src.info.recurrent:
            assert not src.seq_rm(0, cut)  # the recurrent state cannot go back: hence checkpoints
        assert src.checkpoint_restore(0, 1, cut, ck)
        again = run(1, toks[cut:], cut)
        run(2, toks[:cut], 0)
        cold_ = run(2, toks[cut:], cut)
        # equal up to the order of the sums over cells elsewhere in the unified pool (~1e-6 hybrid, ~3e-4 SWA, as
        # between two cold evaluations in other cells); a wrong state: tenths to units
        assert float(np.abs(again - cold_).max()) < 1e-3 and float(np.abs(whole - cold_).max()) < 1e-3
        src.seq_rm(3)
        wrong = run(3, toks[cut:], cut)  # the same tokens without the state before them
        assert float(np.abs(wrong - cold_).max()) > 0.1
        assert not src.checkpoint_restore(0, 1, cut, ck[: len(ck) // 2])  # a truncated one is refused
    finally:
        src.close()


def test_sliding_window_layers_keep_their_window_unless_swa_full_is_asked_for(swa_model):
    from backends.llamacpp.source import LlamaCppSource

    sizes = {}
    for full in (False, True):
        src = LlamaCppSource(LoadSpec(str(swa_model), n_ctx=2048, slots=1, swa_full=full))
        try:
            assert (src.capabilities.checkpoints is None) is full  # a full-size window cache drops nothing: plain reuse
            sizes[full] = src.info.kv_bytes  # what llama.cpp allocated
            assert src.info.sliding_window == 32
        finally:
            src.close()
    # 1 global layer of 2,048 cells + 3 windowed of 768 (the window x 2 sequence ids + a batch, padded to 256), to
    # the log's resolution (two lines against one, scaled by 2.125)
    assert abs(sizes[False] - sizes[True] / 4 * (1 + 3 * 768 / 2048)) <= 5 * LOG_STEP, sizes


@pytest.mark.parametrize("n_ctx,slots", [(4096, 1), (1024, 4)])
def test_the_planner_counts_the_memory_llama_cpp_allocates(made, n_ctx, slots):
    """Windowed layers at the window (+ a batch) per sequence id, recurrent states per sequence id: the planner's
    KV figure is what llama.cpp says it allocated (its two KV / RS buffer lines), to the log's resolution."""
    from backends.llamacpp.source import LlamaCppSource
    from localllm.ggufinfo import read_gguf
    from localllm.planner import estimate

    info = read_gguf(made)
    assert info.swa_layers in (2, 3) or (info.recurrent_layers == 3 and info.recurrent_bytes > 0)
    src = LlamaCppSource(LoadSpec(str(made), n_ctx=n_ctx, slots=slots))
    try:
        allocated = src.info.kv_bytes
    finally:
        src.close()
    planned = estimate(info, n_ctx * slots, "f16", slots=slots).kv_cache
    assert abs(planned - allocated) <= 2 * LOG_STEP, (planned, allocated)  # measured: 1,393-5,242 B of ~1.5 MB
    if info.recurrent_layers:  # one state a sequence id (two a slot) beside the attention layer's every cell
        attention = int(info.kv_bytes_per_layer_token() * info.attention_layers * n_ctx * slots)
        assert planned == attention + info.recurrent_bytes * 2 * slots
    else:  # the windowed layers hold their window: a full cache is larger
        assert info.memory_bytes(n_ctx * slots, slots=slots, swa_full=True) > planned


def test_the_planner_counts_gemma3_270m_as_llama_cpp_allocates(gemma_model):
    """15 of its 18 layers have a 512-token window: at a 32k context llama.cpp allocates ~6x less than a full
    cache, and the planner says the same (probe's "memory layout" line)."""
    from backends.llamacpp.source import LlamaCppSource
    from localllm.ggufinfo import info_of
    from localllm.planner import estimate

    info = info_of(gemma_model.info, gemma_model.path, gemma_model.weights_digest)
    assert (info.swa_layers, info.sliding_window) == (15, 512)
    src = LlamaCppSource(LoadSpec(str(gemma_model.path), n_ctx=32768, slots=1))
    try:
        allocated = src.info.kv_bytes
    finally:
        src.close()
    assert abs(estimate(info, 32768, "f16").kv_cache - allocated) <= 2 * LOG_STEP  # measured: 0 B of 118.5 MiB
    assert info.memory_bytes(32768, swa_full=True) > 4 * allocated


def test_concurrent_conversations_with_one_system_prompt_equal_their_solo_answers(hybrid):
    """Submitted together, the second waits for the first's system prompt and restores its checkpoint (join);
    batched, each stream answers as it does alone."""
    import threading

    reqs = [chat(TURNS[i:i + 1], n=10) for i in range(2)]
    solo = [cold(hybrid, r) for r in reqs]
    hybrid.call(lambda s: hybrid.pool.clear())
    out: list[tuple[str, int, int] | None] = [None, None]
    start = threading.Barrier(2)

    def work(i: int) -> None:
        start.wait()
        out[i] = ask(hybrid, reqs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [o[0] for o in out if o] == solo
    assert max(o[2] for o in out if o) >= len(SYSTEM) // 6  # one of them reused the other's system prompt


def _plain_and_drafted(path: Path, draft, messages: list[dict[str, str]], n: int = 48):
    from backends.contract.specs import GenerateRequest, Sampling

    req = GenerateRequest(messages=messages, sampling=Sampling(temperature=0.0, max_tokens=n))
    plain = load("llamacpp", LoadSpec(str(path), n_ctx=1024, slots=1))
    try:
        a, _, _ = collect(plain.generate(req))
    finally:
        plain.close()
    spec = load("llamacpp", LoadSpec(str(path), n_ctx=1024, slots=1, draft=draft, tuning=Tuning(draft_always=True)))
    try:
        assert spec.source.can_rewind()  # llama.cpp keeps rollback states (n_rs_seq) for the drafts
        b, done, _ = collect(spec.generate(req))
    finally:
        spec.close()
    return a, b, done.stats


def test_prompt_lookup_drafts_on_a_hybrid_target_give_the_plain_output(tied_hybrid_model):
    """Drafts accepted whole, in part and not at all are rolled back by llama.cpp's recurrent rollback states
    (a cut inside the last decode): temperature 0 on F32 gives the plain tokens."""
    from backends.contract.specs import DraftSpec

    a, b, s = _plain_and_drafted(tied_hybrid_model, DraftSpec("ngram", num_draft=8),
                                 [{"role": "user", "content": "x\n\n\n\n\n\n\n mid"}])
    assert a == b
    assert 0 < s.draft_accepted < s.draft_proposed


def test_a_draft_model_on_a_hybrid_target_gives_the_plain_output(hybrid_model, swa_model):
    from backends.contract.specs import DraftSpec

    a, b, s = _plain_and_drafted(hybrid_model, DraftSpec("model", path=str(swa_model), num_draft=4),
                                 [{"role": "user", "content": TURNS[0]}], n=24)
    assert a == b and s.draft_proposed > 0


@pytest.mark.parametrize("drafter", ["swa_model", "moe_model"], ids=["rejected", "accepted"])
def test_a_draft_model_on_the_moe_target_gives_the_plain_output(moe_model, drafter, request):
    """The made ``gpt-oss`` (experts, a window on every other layer) drafted by another random model (every draft
    rejected: the windowed cells rolled back) and by itself (drafts accepted)."""
    from backends.contract.specs import DraftSpec

    draft = request.getfixturevalue(drafter)
    a, b, s = _plain_and_drafted(moe_model, DraftSpec("model", path=str(draft), num_draft=4),
                                 [{"role": "user", "content": TURNS[0]}], n=16)
    assert a == b and s.draft_proposed > 0
    assert (s.draft_accepted > 0) is (draft == moe_model)


def test_a_window_that_has_slid_gives_its_prefix_back_from_a_checkpoint(swa_model):
    """~1,000 tokens through a 32-token window whose cache holds 768 cells: the cells before an edit of the
    first user turn are gone, so the edit restores the checkpoint where that turn starts (a cut would attend to
    missing cells)."""
    def long_turn(prefix: str) -> GenerateRequest:
        return GenerateRequest(messages=[{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": prefix + SYSTEM * 6}],
                               sampling=Sampling(temperature=0.0, max_tokens=8))

    m = load("llamacpp", LoadSpec(str(swa_model), n_ctx=2048, slots=1))
    try:
        ask(m, long_turn("Read this. "))
        held = next(s for s in m.pool.seqs if len(s.tokens) > 900)
        assert m.call(lambda s: s.can_cut(held.id, 20)) is False  # the window slid past the turn's start
        edited = long_turn("Now read this. ")
        text, n, cached = ask(m, edited)
        assert cached > 5 and m.pool.counters.checkpoints_restored > 0
        assert text == cold(m, edited)
    finally:
        m.close()


def _checkpoints(model) -> list[list[int]]:
    """The prefix lengths of every sequence's checkpoints, as the pool holds them now."""
    return model.call(lambda s: [[c.n for c in q.checkpoints] for q in model.pool.seqs])


def test_checkpoints_stay_within_16_a_sequence_and_the_bytes_a_slot(hybrid_model):
    """The pool's bounds (README: 16 checkpoints a sequence, 256 MiB a slot): a long conversation keeps 16, its
    first (the system prompt's end) and the latest; over the byte budget the least recently used sequence's go
    first, its first one last. The made hybrid's checkpoints (58 KB) never reach 256 MiB, so the byte bound is run
    with a budget of 10 checkpoints a slot: the same code."""
    from dataclasses import replace

    from backends.core.kvseq import CheckpointPolicy

    policy = CheckpointPolicy()
    assert (policy.per_seq, policy.bytes_per_slot, policy.every) == (16, 256 << 20, 1024)  # the README's figures
    m = load("llamacpp", LoadSpec(str(hybrid_model), n_ctx=2048, slots=2))
    try:
        qs = [f"What is in room {i}?" for i in range(12)]
        answers = [f"Room {i} holds item {i}." for i in range(11)]
        t, _, _ = ask(m, chat(qs, answers, n=4))  # 24 message starts: 16 checkpoints (the first, the latest 15)
        [first] = [ns for ns in _checkpoints(m) if ns]
        assert len(first) == 16 and first[0] < 200, first  # the system prompt's end, then the latest 15
        more = [f"And room {i}?" for i in range(12, 16)]
        text, n, _ = ask(m, chat(qs + more, answers + [t] + [f"Room {i} is closed." for i in range(12, 15)], n=4))
        [a] = [ns for ns in _checkpoints(m) if ns and ns[-1] == n]  # the conversation's sequence, to its end
        assert len(a) == 16 and a[0] == first[0] and a[-2] > first[-1], a  # 7 more message starts checkpointed
        assert m.pool.counters.checkpoints_taken > 16 + 7
        usage = m.metrics()
        size = usage.kv_checkpoint_bytes // usage.kv_checkpoints
        assert round(size / 1000) == 58  # a checkpoint of this 4-layer hybrid: its recurrent state (README: 58 KB)
        # the byte bound: 10 checkpoints a slot (20 for the 2 slots); another conversation takes its own 16
        m.pool.checkpointing = replace(policy, bytes_per_slot=10 * size)
        other = [{"role": "system", "content": "You are a ferry timetable. " * 10}] + [
            {"role": "user" if i % 2 == 0 else "assistant", "content": f"Line {i} leaves at {i}:00."}
            for i in range(23)]
        collect(m.generate(GenerateRequest(messages=other, sampling=Sampling(temperature=0.0, max_tokens=4))))
        after = sorted((ns for ns in _checkpoints(m) if ns), key=len)
        usage = m.metrics()
        assert usage.kv_checkpoint_bytes <= 20 * size and usage.kv_checkpoints == 20, (after, usage)
        assert [len(ns) for ns in after] == [4, 16], after  # the older conversations gave theirs back, LRU first
        assert after[0] == [a[0], *a[-3:]]  # of the conversation before the newest: its first and its latest stay
    finally:
        m.close()


def test_a_checkpoint_before_an_image_gives_back_the_text_before_a_changed_image(hybrid_model, test_cache):
    """A prompt that diverges at an image (the same text, another picture) restores the checkpoint taken where the
    image starts and evaluates only the image and what follows, answering as cold."""
    from backends.contract.media import IMAGE_MARKER
    from tests.support_vision import IMAGE_TOKENS, make_projector, png

    proj = make_projector(test_cache / "vision" / "mmproj-hybrid-test-f32.gguf", n_embd=128)  # the hybrid's width
    m = load("llamacpp", LoadSpec(str(hybrid_model), n_ctx=1024, slots=1, mmproj=str(proj)))
    try:
        def about(seed: int) -> GenerateRequest:  # a raw prompt: no message starts, the image where its marker is
            return GenerateRequest(prompt=f"{SYSTEM}\n{IMAGE_MARKER}\nWhich room is this?", images=[png(seed=seed)],
                                   sampling=Sampling(temperature=0.0, max_tokens=6))

        want = cold(m, about(2))
        m.call(lambda s: m.pool.clear())
        ask(m, about(1))
        [tokens] = m.call(lambda s: [list(q.tokens) for q in m.pool.seqs if q.tokens])
        start = next(i for i, t in enumerate(tokens) if t < 0)  # where the image's placeholders begin
        assert start > len(SYSTEM) // 6 and any(start in ns for ns in _checkpoints(m)), (start, _checkpoints(m))
        text, n, cached = ask(m, about(2))
        assert cached == start and n - cached >= IMAGE_TOKENS, (cached, start, n)
        assert text == want
    finally:
        m.close()
