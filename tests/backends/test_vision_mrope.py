"""M-RoPE vision models (Qwen2-VL / Qwen2.5-VL / Qwen3-VL family) in the batched loop, on a ``qwen2vl`` copy of the
default model with a random ``qwen2vl_merger`` projector (:mod:`tests.support_vision`): an image of 6 x 4 tokens
takes 6 positions, each token evaluated with mtmd's 2-D positions, and the text after it continues there. The
yardstick is llama.cpp's own ``mtmd_helper_eval_chunks`` on a fresh context in another process."""

from __future__ import annotations

import numpy as np
import pytest

from backends.contract.media import IMAGE_MARKER
from backends.contract.specs import GenerateRequest, LoadSpec, Sampling
from backends.registry import load
from tests.backends.conftest import collect
from tests.support_vision import MROPE_IMAGE, MROPE_IMAGE_POSITIONS, MROPE_IMAGE_TOKENS, png, reference_in_subprocess

ASK = "Describe the picture."


@pytest.fixture(scope="module")
def qvl(mrope_model):
    model, proj = mrope_model
    m = load("llamacpp", LoadSpec(str(model), n_ctx=1024, slots=2, mmproj=str(proj)))
    yield m
    m.close()


def pic(seed: int) -> bytes:
    return png(*MROPE_IMAGE, seed=seed)


def chat(*images: bytes, text: str = ASK) -> list[dict]:
    return [{"role": "user", "content": text, **({"images": list(images)} if images else {})}]


def run(m, n: int = 8, **kw):
    """(text, done, top-5 log-probabilities of the first answer token)."""
    text, done, evs = collect(m.generate(GenerateRequest(sampling=Sampling(temperature=0.0, max_tokens=n),
                                                         logprobs=True, top_logprobs=5, **kw)))
    top = np.array([lp for _, lp, _ in next(e.logprobs[0] for e in evs if getattr(e, "logprobs", None)).top])
    return text, done, top


def held_positions(m) -> list[tuple[int, int]]:
    """(cells, next position) of every sequence holding tokens."""
    return m.call(lambda s: [(len(q.tokens), s.positions(q.tokens)) for q in m.pool.seqs if q.tokens])


def test_the_made_model_runs_with_m_rope_and_answers_text_as_the_original(qvl):
    assert qvl.info.vision and qvl.call(lambda s: s.media_whole)  # M-RoPE images are evaluated whole
    text, done, _ = run(qvl, 12, messages=chat(text="What is the capital of France? Answer in one short sentence."))
    assert "Paris" in text  # q/k rows re-ordered for NEOX rotation: the same model as SmolLM2
    qvl.call(lambda s: qvl.pool.clear())
    _, done, _ = run(qvl, 4, messages=chat(pic(1)))
    assert done.stats.image_tokens == MROPE_IMAGE_TOKENS and done.stats.images == 1
    (cells, pos), = held_positions(qvl)
    assert pos == cells - MROPE_IMAGE_TOKENS + MROPE_IMAGE_POSITIONS  # 24 cells, 6 positions


def test_the_loop_evaluates_m_rope_images_as_llama_cpps_own_helper_does(qvl, mrope_model):
    """Bit for bit: the first answer token's log-probabilities (the text after the image at ``p + max(nx, ny)``)
    and the greedy text (each answer token one position on), and again from the reused prefix."""
    model, proj = mrope_model
    image = pic(9)
    prompt = qvl.call(lambda s: s.render([{"role": "user", "content": IMAGE_MARKER + "\n" + ASK}]))
    ref_top, ref_toks = reference_in_subprocess(str(model), str(proj), prompt, [image], n_gen=8)
    ref_text = qvl.detokenize(ref_toks)
    qvl.call(lambda s: qvl.pool.clear())
    first = run(qvl, 8, messages=chat(image))
    again = run(qvl, 8, messages=chat(image))
    assert first[1].stats.prompt_cached_tokens == 0 and again[1].stats.prompt_cached_tokens > MROPE_IMAGE_TOKENS
    for text, _, top in (first, again):
        np.testing.assert_allclose(top, ref_top, atol=1e-5)
        assert text and ref_text.startswith(text), (text, ref_text)


def test_a_follow_up_turn_reuses_the_image_cells_at_their_positions(qvl):
    """The reused turn equals the one evaluated from nothing (1e-4). The pool starts empty: with flash attention
    on the CPU, llama.cpp's result depends on the order of a sequence's cells in the unified pool (a turn whose
    new cells fill a hole left before its older ones differs by up to ~0.5 in a logit, text-only too: measured
    with raw llama.cpp), and the cells other tests leave behind would make that order theirs, not this test's."""
    qvl.call(lambda s: qvl.pool.clear())
    image = pic(21)
    text1, d1, _ = run(qvl, 6, messages=chat(image))
    follow = chat(image) + [{"role": "assistant", "content": text1}, {"role": "user", "content": "And the colours?"}]
    reused = run(qvl, 6, messages=follow)
    assert reused[1].stats.images_encoded == 0
    assert reused[1].stats.prompt_cached_tokens >= d1.stats.prompt_eval_count - 1  # the image's cells included
    qvl.call(lambda s: qvl.pool.clear())
    fresh = run(qvl, 6, messages=follow)  # evaluated again from position 0 (the embeddings are kept)
    assert fresh[1].stats.prompt_cached_tokens == 0
    np.testing.assert_allclose(reused[2], fresh[2], atol=1e-4)
    assert reused[0] == fresh[0]


def test_positions_and_cuts_the_pool_asks_for(qvl):
    """What the KV pool counts in: one cell per token, positions per :meth:`positions`, and a kept prefix never ends
    inside an image (its cells share one position, so ``seq_rm`` can only drop all of them)."""
    image = pic(33)
    toks = qvl.call(lambda s: s.prompt_media(f"Look: {IMAGE_MARKER} and tell", [image]))
    i0 = next(i for i, t in enumerate(toks) if t < 0)
    end = i0 + MROPE_IMAGE_TOKENS
    assert all(t < 0 for t in toks[i0:end]) and toks[end] >= 0
    pos, cut = (lambda f: qvl.call(lambda s: f(s))), None
    assert pos(lambda s: s.positions(toks[:i0 + 5])) == i0  # a part of an image: where the rest of it goes
    assert pos(lambda s: s.positions(toks[:end])) == i0 + MROPE_IMAGE_POSITIONS
    assert pos(lambda s: s.positions(toks)) == len(toks) - MROPE_IMAGE_TOKENS + MROPE_IMAGE_POSITIONS
    cut = pos(lambda s: [s.kv_cut(toks, n) for n in (i0, i0 + 1, end - 1, end, end + 2)])
    assert cut == [(i0, i0), (i0, i0), (i0, i0), (end, i0 + MROPE_IMAGE_POSITIONS),
                   (end + 2, i0 + MROPE_IMAGE_POSITIONS + 2)]


def test_two_images_and_batched_text(qvl):
    import threading

    text_req = chat(text="What is the capital of France? Answer in one short sentence.")
    solo, _, _ = run(qvl, 10, messages=text_req)
    out: dict[str, tuple] = {}

    def go(key, messages):
        out[key] = run(qvl, 10, messages=messages)

    ts = [threading.Thread(target=go, args=("text", text_req)),
          threading.Thread(target=go, args=("image", chat(pic(41), pic(42))))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(300)
    assert out["image"][1].stats.image_tokens == 2 * MROPE_IMAGE_TOKENS and out["image"][0]
    assert "Paris" in out["text"][0] and out["text"][0][:20] == solo[:20]
    _, _, a = run(qvl, 1, messages=chat(pic(41)))
    _, _, b = run(qvl, 1, messages=chat(pic(42)))
    assert not np.allclose(a, b, atol=1e-3)  # two pictures, two answers


CHILD = """
import json, sys
sys.path.insert(0, {root!r})
from backends.contract.specs import GenerateRequest, LoadSpec, Sampling
from backends.core.prompt_cache import PromptCacheSpec
from backends.registry import load
from tests.backends.conftest import collect
from tests.support_vision import MROPE_IMAGE, png
spec = PromptCacheSpec({cache!r}, "test-model m-rope", min_tokens=16)
msgs = [{{"role": "user", "content": "Describe the picture in detail.", "images": [png(*MROPE_IMAGE, seed=77)]}}]
with load("llamacpp", LoadSpec({model!r}, n_ctx=1024, slots=1, mmproj={proj!r}), prompt_cache=spec) as m:
    text, done, evs = collect(m.generate(GenerateRequest(messages=msgs, sampling=Sampling(temperature=0, max_tokens=8),
                                                         logprobs=True, top_logprobs=5)))
top = [lp for _, lp, _ in next(e.logprobs[0] for e in evs if getattr(e, "logprobs", None)).top]
s = done.stats
print(json.dumps({{"text": text, "restored": s.prompt_restored_tokens, "prompt": s.prompt_eval_count,
                  "encoded": s.images_encoded, "top": top}}))
"""


def test_a_conversation_with_an_m_rope_image_restores_from_disk_in_a_second_process(mrope_model, tmp_path):
    """The saved state carries the image's cells with their 2-D positions (llama.cpp keeps them per cell); the
    next process restores all but the last prompt token and evaluates that one at the position after them."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    model, proj = mrope_model
    code = CHILD.format(root=str(Path(__file__).resolve().parents[2]), cache=str(tmp_path), model=str(model),
                        proj=str(proj))

    def child() -> dict:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ))
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    first = child()
    assert first["restored"] == 0 and first["encoded"] == 1 and list(tmp_path.glob("*.kv")), "nothing was saved"
    again = child()
    assert again["restored"] == first["prompt"] - 1 and again["encoded"] == 0
    assert again["text"] == first["text"]
    np.testing.assert_allclose(again["top"], first["top"], atol=1e-5)


def test_a_large_picture_is_scaled_to_fit_one_step_beside_the_streams(mrope_model):
    """An M-RoPE image is evaluated whole, so mtmd is told to make at most ``n_batch`` less one token per slot of
    it: a 256 px photo (256 tokens at full size) becomes fewer, and is admitted while another stream decodes."""
    import threading

    model, proj = mrope_model
    with load("llamacpp", LoadSpec(str(model), n_ctx=1024, slots=2, n_batch=64, mmproj=str(proj))) as m:
        out: dict[str, tuple] = {}

        def go(key, messages, n):
            out[key] = run(m, n, messages=messages)

        side = threading.Thread(target=go, args=("text", chat(text="Count to twenty."), 24))
        side.start()
        go("image", chat(png(256, 256, seed=3)), 4)
        side.join(300)
        n = out["image"][1].stats.image_tokens
        assert 8 <= n <= 64 - 2 and out["image"][0]
        assert out["text"][1].finish_reason in ("stop", "length")
        m.call(lambda s: m.pool.clear())
        _, _, solo = run(m, 1, messages=chat(png(256, 256, seed=3)))
        prompt = m.call(lambda s: s.render([{"role": "user", "content": IMAGE_MARKER + "\n" + ASK}]))
    ref_top, _ = reference_in_subprocess(str(model), str(proj), prompt, [png(256, 256, seed=3)], n_gen=1,
                                         image_max_tokens=64 - 2)
    np.testing.assert_allclose(solo, ref_top, atol=1e-5)  # the same scaled picture, the same numbers


def test_a_shared_image_prefix_is_copied_to_another_sequence_at_its_positions(qvl):
    """A second question about the picture, in a new conversation: the pool copies the first one's prefix (the
    system turn, the image, the text up to where they part) into another sequence by position (``seq_cp`` counts
    positions, and 24 image cells take 6), and the answer is the one evaluated from nothing."""
    image = pic(51)
    qvl.call(lambda s: qvl.pool.clear())
    run(qvl, 4, messages=chat(image, text="Describe the picture."))
    _, d, copied = run(qvl, 4, messages=chat(image, text="Describe the colours."))
    assert d.stats.prompt_cached_tokens > MROPE_IMAGE_TOKENS
    assert qvl.metrics().prompt_tokens_copied >= d.stats.prompt_cached_tokens
    qvl.call(lambda s: qvl.pool.clear())
    _, d2, fresh = run(qvl, 4, messages=chat(image, text="Describe the colours."))
    assert d2.stats.prompt_cached_tokens == 0
    np.testing.assert_allclose(copied, fresh, atol=1e-4)
