"""Images through llama.cpp's mtmd inside the batched decode loop, on the default model with the made projector
(random weights: the answers mean nothing, so the tests compare numbers and counters, not meanings)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from backends.contract.errors import UnsupportedError
from backends.contract.specs import DraftSpec, GenerateRequest, LoadSpec, Sampling
from backends.registry import load
from tests.backends.conftest import collect
from tests.support_vision import IMAGE_TOKENS, png

ASK = "Describe the picture."


@pytest.fixture(scope="module")
def vlm(default_model_path, test_projector):
    m = load("llamacpp", LoadSpec(str(default_model_path), n_ctx=1024, slots=2, mmproj=str(test_projector)))
    yield m
    m.close()


def chat(*images: bytes, text: str = ASK) -> list[dict]:
    return [{"role": "user", "content": text, **({"images": list(images)} if images else {})}]


def greedy(n: int = 8, **kw) -> Sampling:
    return Sampling(temperature=0.0, max_tokens=n, **kw)


def first_logprobs(model, messages) -> np.ndarray:
    """The top-5 log-probabilities of the first answer token (numbers, not text: see the module docstring)."""
    _, done, chunks = collect(model.generate(GenerateRequest(messages=messages, sampling=greedy(1), logprobs=True,
                                                             top_logprobs=5)))
    lp = next(c.logprobs[0] for c in chunks if getattr(c, "logprobs", None))
    return np.array([v for _, v, _ in lp.top])


def test_image_tokens_count_in_the_prompt_and_the_projector_is_loaded(vlm):
    assert vlm.info.vision and vlm.info.projector
    _, plain, _ = collect(vlm.generate(GenerateRequest(messages=chat(), sampling=greedy(2))))
    _, seen, _ = collect(vlm.generate(GenerateRequest(messages=chat(png(seed=11)), sampling=greedy(2))))
    s = seen.stats
    assert s.image_tokens == IMAGE_TOKENS and s.images == 1
    assert s.prompt_eval_count >= plain.stats.prompt_eval_count + IMAGE_TOKENS  # the marker's newline too


def test_same_image_same_numbers_other_image_other_numbers(vlm):
    a1 = first_logprobs(vlm, chat(png(seed=1)))
    a2 = first_logprobs(vlm, chat(png(seed=1)))
    b = first_logprobs(vlm, chat(png(seed=2)))
    none = first_logprobs(vlm, chat())
    np.testing.assert_allclose(a1, a2, atol=1e-4)
    assert not np.allclose(a1, b, atol=1e-3)
    assert not np.allclose(a1, none, atol=1e-3)


def test_a_second_question_about_the_same_picture_does_not_encode_it_again(vlm):
    pic = png(seed=21)
    text1, d1, _ = collect(vlm.generate(GenerateRequest(messages=chat(pic), sampling=greedy(6))))
    assert d1.stats.images_encoded == 1 and d1.stats.image_encode_duration > 0
    before = vlm.metrics().images_encoded
    follow = chat(pic) + [{"role": "assistant", "content": text1}, {"role": "user", "content": "And the colours?"}]
    _, d2, _ = collect(vlm.generate(GenerateRequest(messages=follow, sampling=greedy(4))))
    assert d2.stats.images_encoded == 0 and d2.stats.image_encode_duration == 0
    assert d2.stats.prompt_cached_tokens >= d1.stats.prompt_eval_count - 1  # the first turn, image included
    assert vlm.metrics().images_encoded == before


def test_evicted_cells_reuse_the_kept_embeddings(vlm):
    pic = png(seed=31)
    collect(vlm.generate(GenerateRequest(messages=chat(pic), sampling=greedy(2))))
    vlm.call(lambda s: vlm.pool.clear())  # the KV cells go, the embeddings stay
    _, d, _ = collect(vlm.generate(GenerateRequest(messages=chat(pic, text="Again?"), sampling=greedy(2))))
    assert d.stats.images_encoded == 0 and d.stats.prompt_cached_tokens == 0


def test_several_images_in_one_message_and_a_raw_prompt(vlm):
    _, d, _ = collect(vlm.generate(GenerateRequest(messages=chat(png(seed=3), png(seed=4)), sampling=greedy(2))))
    assert d.stats.image_tokens == 2 * IMAGE_TOKENS and d.stats.images == 2
    raw = GenerateRequest(prompt="<__media__> is a picture of", images=[png(seed=5)], sampling=greedy(2))
    _, d, _ = collect(vlm.generate(raw))
    assert d.stats.image_tokens == IMAGE_TOKENS


def test_an_image_stream_batched_with_a_text_stream(vlm):
    text_req = chat(text="What is the capital of France? Answer in one short sentence.")
    solo, _, _ = collect(vlm.generate(GenerateRequest(messages=text_req, sampling=greedy(12))))
    out: dict[str, tuple] = {}

    def run(key, messages):
        out[key] = collect(vlm.generate(GenerateRequest(messages=messages, sampling=greedy(12))))

    ts = [threading.Thread(target=run, args=("text", text_req)),
          threading.Thread(target=run, args=("image", chat(png(seed=41))))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert out["text"][1].finish_reason in ("stop", "length") and "Paris" in out["text"][0]
    assert out["image"][1].stats.image_tokens == IMAGE_TOKENS and out["image"][0]
    assert out["text"][0][:20] == solo[:20]


def test_bad_image_bytes_end_only_their_request(vlm):
    with pytest.raises(UnsupportedError, match="could not be decoded"):
        collect(vlm.generate(GenerateRequest(messages=chat(b"\x89PNG\r\n\x1a\nnot really"), sampling=greedy(2))))
    text, done, _ = collect(vlm.generate(GenerateRequest(messages=chat(png(seed=6)), sampling=greedy(2))))
    assert done.stats.image_tokens == IMAGE_TOKENS


def test_a_model_without_projector_refuses_images(backend_factory):
    b = backend_factory("llamacpp")
    with pytest.raises(UnsupportedError, match="no vision projector"):
        collect(b.generate(GenerateRequest(messages=chat(png()), sampling=greedy(2))))


def test_drafting_is_off_for_image_requests(default_model_path, test_projector):
    with load("llamacpp", LoadSpec(str(default_model_path), n_ctx=1024, mmproj=str(test_projector),
                                   draft=DraftSpec(kind="ngram"))) as m:
        _, d, _ = collect(m.generate(GenerateRequest(messages=chat(png(seed=7)), sampling=greedy(16))))
        assert d.stats.image_tokens == IMAGE_TOKENS and d.stats.draft_proposed == 0


def test_a_projector_for_another_model_width_is_refused(default_model_path, tmp_path):
    from backends.contract.errors import ModelLoadError
    from tests.support_vision import make_projector

    bad = make_projector(tmp_path / "mmproj-wide.gguf", n_embd=640)
    with pytest.raises(ModelLoadError, match="projector"):
        load("llamacpp", LoadSpec(str(default_model_path), n_ctx=512, mmproj=str(bad)))


CHILD = """
import json, sys
sys.path.insert(0, {root!r})
from backends.contract.specs import GenerateRequest, LoadSpec, Sampling
from backends.core.prompt_cache import PromptCacheSpec
from backends.registry import load
from tests.backends.conftest import collect
from tests.support_vision import png
spec = PromptCacheSpec({cache!r}, "test-model vision", min_tokens=16)
msgs = [{{"role": "user", "content": "Describe the picture in detail.", "images": [png(seed=77)]}}]
with load("llamacpp", LoadSpec({model!r}, n_ctx=1024, slots=1, mmproj={proj!r}), prompt_cache=spec) as m:
    text, done, _ = collect(m.generate(GenerateRequest(messages=msgs, sampling=Sampling(temperature=0, max_tokens=6))))
s = done.stats
print(json.dumps({{"text": text, "restored": s.prompt_restored_tokens, "prompt": s.prompt_eval_count,
                  "encoded": s.images_encoded}}))
"""


def test_a_conversation_with_an_image_restores_from_disk_in_a_second_process(default_model_path, test_projector,
                                                                               tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = CHILD.format(root=str(Path(__file__).resolve().parents[2]), cache=str(tmp_path),
                        model=str(default_model_path), proj=str(test_projector))

    def child() -> dict:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ))
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    first = child()
    assert first["restored"] == 0 and first["encoded"] == 1 and list(tmp_path.glob("*.kv")), "nothing was saved"
    again = child()
    assert again["restored"] == first["prompt"] - 1  # the image's positions came back from disk, keyed by content
    assert again["encoded"] == 0  # so the picture was not encoded again
    assert again["text"] == first["text"]


def test_more_image_tokens_than_the_context_holds(vlm):
    from backends.contract.errors import ContextOverflowError

    many = [png(seed=200 + i) for i in range(1024 // IMAGE_TOKENS + 1)]
    with pytest.raises(ContextOverflowError, match="context holds 1024"):
        collect(vlm.generate(GenerateRequest(messages=chat(*many), sampling=greedy(2))))
    _, d, _ = collect(vlm.generate(GenerateRequest(messages=chat(png(seed=8)), sampling=greedy(2))))
    assert d.stats.image_tokens == IMAGE_TOKENS  # the model goes on


def _first_top(m, msgs) -> np.ndarray:
    _, done, evs = collect(m.generate(GenerateRequest(messages=msgs, sampling=greedy(1), logprobs=True,
                                                      top_logprobs=5)))
    assert done.stats.image_tokens == IMAGE_TOKENS
    return np.array([lp for _, lp, _ in next(e.logprobs[0] for e in evs if getattr(e, "logprobs", None)).top])


def _ref_top(model, proj, prompt, pic) -> np.ndarray:
    from tests.support_vision import reference_logits

    ref = np.asarray(reference_logits(str(model), str(proj), prompt, [pic], 2), dtype=np.float64)
    lse = ref.max() + np.log(np.exp(ref - ref.max()).sum())
    return np.sort(ref - lse)[::-1][:5]


@pytest.mark.parametrize("kind", ["mlp", "gemma3"])
def test_the_loop_evaluates_images_as_llama_cpps_own_helper_does(default_model_path, derived_model, test_cache,
                                                                 kind):
    """Our path (placeholders, embeddings-only decodes in a shared pool; for a Gemma 3 style projector the whole
    image in one non-causal decode) gives the logits of ``mtmd_helper_eval_chunks`` (what ``llama-mtmd-cli``
    runs): bit for bit alone; batched beside a text stream on the F32 model (quantized kernels are not
    batch-invariant either), within 0.01 (a causal decode of the Gemma 3 image is 0.1 off)."""
    from tests.support_vision import make_projector

    proj = make_projector(test_cache / "vision" / f"mmproj-smollm2-test-{kind}.gguf", kind=kind)
    size = 64 if kind == "mlp" else 128
    pic = png(size, size, seed=9)
    for model, batched in ((default_model_path, False), (derived_model("f32"), True)):
        with load("llamacpp", LoadSpec(str(model), n_ctx=1024, slots=2, mmproj=str(proj))) as m:
            prompt = m.call(lambda s: s.render([{"role": "user", "content": "<__media__>\n" + ASK}]))
            side = threading.Thread(target=lambda: collect(m.generate(GenerateRequest(  # noqa: B023
                messages=chat(text="Count to twenty."), sampling=greedy(24)))))
            if batched:
                side.start()
            ours = _first_top(m, chat(pic))
            if batched:
                side.join(120)
        np.testing.assert_allclose(ours, _ref_top(model, proj, prompt, pic), atol=1e-2 if batched else 1e-5)


def test_a_model_on_mlx_refuses_images_in_one_sentence(backend_factory):
    b = backend_factory("mlx")  # mlx-lm has no vision: the projector stays with llama.cpp
    with pytest.raises(UnsupportedError, match="loaded on MLX, which has no vision"):
        collect(b.generate(GenerateRequest(messages=chat(png()), sampling=greedy(2))))
    text, _, _ = collect(b.generate(GenerateRequest(messages=chat(text="Hi"), sampling=greedy(2))))
    assert text  # the model goes on
