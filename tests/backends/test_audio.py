"""Audio through llama.cpp's mtmd inside the batched decode loop, on the default model with the made ``ultravox``
projector (random weights: the answers mean nothing, so the tests compare numbers and counters, not meanings)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from backends.contract.errors import UnsupportedError
from backends.contract.specs import GenerateRequest, LoadSpec, Sampling
from backends.registry import load
from tests.backends.conftest import collect
from tests.support_audio import AUDIO_TOKENS, wav
from tests.support_vision import png

ASK = "Transcribe the audio."


@pytest.fixture(scope="module")
def alm(default_model_path, audio_projector):
    m = load("llamacpp", LoadSpec(str(default_model_path), n_ctx=1024, slots=2, mmproj=str(audio_projector)))
    yield m
    m.close()


def chat(*clips: bytes, text: str = ASK) -> list[dict]:
    return [{"role": "user", "content": text, **({"images": list(clips)} if clips else {})}]


def greedy(n: int = 8) -> Sampling:
    return Sampling(temperature=0.0, max_tokens=n)


def first_logprobs(model, messages) -> np.ndarray:
    _, done, evs = collect(model.generate(GenerateRequest(messages=messages, sampling=greedy(1), logprobs=True,
                                                          top_logprobs=5)))
    return np.array([v for _, v, _ in next(e.logprobs[0] for e in evs if getattr(e, "logprobs", None)).top])


def test_audio_tokens_count_in_the_prompt_and_the_projector_says_audio(alm):
    assert alm.info.audio and not alm.info.vision and alm.info.projector
    _, plain, _ = collect(alm.generate(GenerateRequest(messages=chat(), sampling=greedy(2))))
    # a clip of its own: one another test sent first is reused from the KV cache, not encoded (any order)
    _, heard, _ = collect(alm.generate(GenerateRequest(messages=chat(wav(seed=21)), sampling=greedy(2))))
    s = heard.stats
    assert s.audio_tokens == AUDIO_TOKENS and s.audio_clips == 1 and s.image_tokens == 0
    assert s.audio_chunks_encoded == 1 and s.audio_encode_duration > 0 and s.images_encoded == 0
    assert s.prompt_eval_count >= plain.stats.prompt_eval_count + AUDIO_TOKENS


def test_same_clip_same_numbers_other_clip_other_numbers(alm):
    a1 = first_logprobs(alm, chat(wav(seed=1)))
    a2 = first_logprobs(alm, chat(wav(seed=1)))
    b = first_logprobs(alm, chat(wav(seed=2, freq=880)))
    none = first_logprobs(alm, chat())
    np.testing.assert_allclose(a1, a2, atol=1e-4)
    assert not np.allclose(a1, b, atol=1e-3)
    assert not np.allclose(a1, none, atol=1e-3)


def test_a_follow_up_about_the_same_clip_reuses_it(alm):
    clip = wav(seed=3)
    text1, d1, _ = collect(alm.generate(GenerateRequest(messages=chat(clip), sampling=greedy(6))))
    assert d1.stats.audio_chunks_encoded == 1
    before = alm.metrics().audio_chunks_encoded
    follow = chat(clip) + [{"role": "assistant", "content": text1}, {"role": "user", "content": "And then?"}]
    _, d2, _ = collect(alm.generate(GenerateRequest(messages=follow, sampling=greedy(4))))
    assert d2.stats.audio_chunks_encoded == 0 and d2.stats.audio_encode_duration == 0
    assert d2.stats.prompt_cached_tokens >= d1.stats.prompt_eval_count - 1  # the first turn, clip included
    assert alm.metrics().audio_chunks_encoded == before


def test_a_long_clip_is_cut_in_30_second_chunks_as_mtmd_cuts_it(alm):
    _, d, _ = collect(alm.generate(GenerateRequest(messages=chat(wav(31.0, seed=4)), sampling=greedy(1))))
    assert d.stats.audio_tokens == 2 * AUDIO_TOKENS and d.stats.audio_chunks_encoded == 2


def test_a_raw_prompt_with_a_clip(alm):
    raw = GenerateRequest(prompt="<__media__> says", images=[wav(seed=5)], sampling=greedy(2))
    _, d, _ = collect(alm.generate(raw))
    assert d.stats.audio_tokens == AUDIO_TOKENS


def test_bad_audio_ends_only_its_request(alm):
    truncated = wav(seed=6)[:40]  # a RIFF/WAVE header that ends before its data
    with pytest.raises(UnsupportedError, match="could not be decoded"):
        collect(alm.generate(GenerateRequest(messages=chat(truncated), sampling=greedy(2))))
    _, done, _ = collect(alm.generate(GenerateRequest(messages=chat(wav(seed=6)), sampling=greedy(2))))
    assert done.stats.audio_tokens == AUDIO_TOKENS


def test_an_image_for_an_audio_only_projector_and_audio_for_a_vision_one(alm, default_model_path, test_projector):
    with pytest.raises(UnsupportedError, match="no vision encoder"):
        collect(alm.generate(GenerateRequest(messages=chat(png()), sampling=greedy(2))))
    with load("llamacpp", LoadSpec(str(default_model_path), n_ctx=512, mmproj=str(test_projector))) as vlm:
        assert vlm.info.vision and not vlm.info.audio
        with pytest.raises(UnsupportedError, match="no audio encoder"):
            collect(vlm.generate(GenerateRequest(messages=chat(wav()), sampling=greedy(2))))


def test_a_model_without_projector_refuses_audio(backend_factory):
    b = backend_factory("llamacpp")
    with pytest.raises(UnsupportedError, match="no audio projector"):
        collect(b.generate(GenerateRequest(messages=chat(wav()), sampling=greedy(2))))


def test_an_audio_stream_batched_with_text_streams_leaves_theirs_as_solo(derived_model, audio_projector):
    """On the F32 model (quantized kernels are not batch-invariant): two text streams answer token for token as
    they do alone while an audio request is admitted and evaluated beside them."""
    asks = ["What is the capital of France? Answer in one short sentence.", "Count from one to ten."]
    with load("llamacpp", LoadSpec(str(derived_model("f32")), n_ctx=1024, slots=3,
                                   mmproj=str(audio_projector))) as m:
        solo = [collect(m.generate(GenerateRequest(messages=chat(text=a), sampling=greedy(12))))[0] for a in asks]
        out: dict[str, tuple] = {}

        def run(key, messages):
            out[key] = collect(m.generate(GenerateRequest(messages=messages, sampling=greedy(12))))

        ts = [threading.Thread(target=run, args=(f"t{i}", chat(text=a))) for i, a in enumerate(asks)]
        ts.append(threading.Thread(target=run, args=("audio", chat(wav(seed=7)))))
        for t in ts:
            t.start()
        for t in ts:
            t.join(180)
    assert out["audio"][1].stats.audio_tokens == AUDIO_TOKENS
    assert [out["t0"][0], out["t1"][0]] == solo


CHILD = """
import json, sys
sys.path.insert(0, {root!r})
from backends.contract.specs import GenerateRequest, LoadSpec, Sampling
from backends.core.prompt_cache import PromptCacheSpec
from backends.registry import load
from tests.backends.conftest import collect
from tests.support_audio import wav
spec = PromptCacheSpec({cache!r}, "test-model audio", min_tokens=16)
msgs = [{{"role": "user", "content": "Transcribe the audio.", "images": [wav(seed=77)]}}]
with load("llamacpp", LoadSpec({model!r}, n_ctx=1024, slots=1, mmproj={proj!r}), prompt_cache=spec) as m:
    text, done, _ = collect(m.generate(GenerateRequest(messages=msgs, sampling=Sampling(temperature=0, max_tokens=6))))
s = done.stats
print(json.dumps({{"text": text, "restored": s.prompt_restored_tokens, "prompt": s.prompt_eval_count,
                  "encoded": s.audio_chunks_encoded}}))
"""


def test_a_conversation_with_a_clip_restores_from_disk_in_a_second_process(default_model_path, audio_projector,
                                                                            tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = CHILD.format(root=str(Path(__file__).resolve().parents[2]), cache=str(tmp_path),
                        model=str(default_model_path), proj=str(audio_projector))

    def child() -> dict:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ))
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    first = child()
    assert first["restored"] == 0 and first["encoded"] == 1 and list(tmp_path.glob("*.kv")), "nothing was saved"
    again = child()
    assert again["restored"] == first["prompt"] - 1  # the clip's positions came back from disk, keyed by content
    assert again["encoded"] == 0  # so the clip was not encoded again
    assert again["text"] == first["text"]


def test_the_loop_evaluates_audio_as_llama_cpps_own_helper_does(alm, default_model_path, audio_projector):
    """Our path (placeholders, an embeddings-only decode in the shared pool) gives the logits of
    ``mtmd_helper_eval_chunks`` on a fresh one-sequence context (what ``llama-mtmd-cli --audio`` runs)."""
    from tests.support_vision import reference_logits

    clip = wav(seed=9)
    prompt = alm.call(lambda s: s.render([{"role": "user", "content": "<__media__>\n" + ASK}]))
    ours = first_logprobs(alm, chat(clip))
    ref = np.asarray(reference_logits(str(default_model_path), str(audio_projector), prompt, [clip], 2), np.float64)
    lse = ref.max() + np.log(np.exp(ref - ref.max()).sum())
    np.testing.assert_allclose(ours, np.sort(ref - lse)[::-1][:5], atol=1e-4)


def test_flac_and_mp3_are_decoded_by_mtmd(alm):
    """FLAC is lossless: the same 16-bit samples as the WAV give the same numbers (another content hash, so it is
    encoded again); MP3 is lossy: its own numbers, the same token count."""
    from tests.support_audio import encoded

    as_wav = first_logprobs(alm, chat(wav(seed=12)))
    as_flac = first_logprobs(alm, chat(encoded("FLAC", seed=12)))
    np.testing.assert_allclose(as_flac, as_wav, atol=1e-4)
    _, d, _ = collect(alm.generate(GenerateRequest(messages=chat(encoded("MP3", seed=12)), sampling=greedy(1))))
    assert d.stats.audio_tokens == AUDIO_TOKENS and d.stats.audio_chunks_encoded == 1


def test_a_prompt_with_clips_is_tokenized_piecewise_as_mtmd_does_it_whole(alm):
    """Clips are prepared off the loop and their marker replacements cached; the prompt is then put together piece
    by piece. The ids equal one ``mtmd_tokenize`` of the whole prompt (BOS, the text around, both clips)."""
    a, b = wav(seed=13), wav(31.0, seed=14)
    text = "<|im_start|>user\n<__media__> then <__media__>\nWhat changed?<|im_end|>\n"

    def both(s):
        p = s._proj
        p.prepare([a, b])
        return p._tokenize_pieces(text, [a, b], True), p._tokenize_all(text, [a, b], True)

    pieces, whole = alm.call(both)
    assert pieces == whole and sum(t < 0 for t in pieces) == 3 * AUDIO_TOKENS


def test_audio_tokens_count_toward_the_context_fit(default_model_path, audio_projector):
    from backends.contract.errors import ContextOverflowError

    with load("llamacpp", LoadSpec(str(default_model_path), n_ctx=64, slots=1, mmproj=str(audio_projector))) as m:
        with pytest.raises(ContextOverflowError, match="context holds 64"):
            collect(m.generate(GenerateRequest(messages=chat(wav(seed=15)), sampling=greedy(2))))
        text, _, _ = collect(m.generate(GenerateRequest(messages=chat(text="Hi"), sampling=greedy(2))))
        assert text  # the model goes on


def test_clips_are_prepared_off_the_loop_and_unload_ends_a_request_still_preparing(default_model_path,
                                                                                   audio_projector):
    seen: list[str] = []
    with load("llamacpp", LoadSpec(str(default_model_path), n_ctx=512, slots=1, mmproj=str(audio_projector))) as m:
        src = m.source
        real = src.prepare_media

        def spy(media):
            seen.append(threading.current_thread().name)
            return real(media)

        src.prepare_media = spy  # type: ignore[method-assign]
        _, d, _ = collect(m.generate(GenerateRequest(messages=chat(wav(seed=16)), sampling=greedy(1))))
        assert d.stats.audio_tokens == AUDIO_TOKENS and seen == ["localllm-media"]
        gate = threading.Event()
        src.prepare_media = lambda media: gate.wait(10)  # type: ignore[method-assign]
        ch = m.submit(GenerateRequest(messages=chat(wav(seed=17)), sampling=greedy(1)))
    gate.set()  # the model is closed: the request that was still being prepared fails, it does not hang
    out: list[str] = []

    def drain() -> None:
        try:
            list(ch)
        except Exception as e:  # noqa: BLE001 - what the caller would see
            out.append(str(e))

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    t.join(15)
    assert not t.is_alive(), "a request prepared while the model closed hangs"
    assert out and "unloaded" in out[0]
