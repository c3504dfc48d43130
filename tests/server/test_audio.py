"""Audio on every face, through the official clients, over a private store holding the default model with the made
``ultravox`` audio projector (``Store.set_projector``: the manifest records it and its encoders) and a text-only copy
of it. Every bad clip is one sentence in the API's own shape; nothing else is affected."""

from __future__ import annotations

import base64
import io
import struct

import httpx
import ollama
import openai
import pytest

from tests.support_audio import AUDIO_TOKENS, forged_wav, wav

ALM = "smollm2:135m"
TEXT = "textonly:latest"
FAST = {"temperature": 0, "num_predict": 4, "seed": 1}


@pytest.fixture(scope="module")
def asrv(installed_default_model, audio_projector, tmp_path_factory):
    from localllm.config import paths
    from localllm.store import Store
    from tests.server.derived import serve
    from tests.support import install_copy, private_paths

    root = tmp_path_factory.mktemp("audio-home")
    pp = private_paths(root)
    install_copy(pp.models, paths().models)
    store = Store(paths=pp)
    store.copy(ALM, TEXT)
    m = store.set_projector(ALM, audio_projector)
    assert m.projector is not None and m.projector.audio and not m.projector.vision
    srv = serve(store)
    yield srv
    srv.stop()
    srv.engine.close()


@pytest.fixture(scope="module")
def url(asrv) -> str:
    return asrv.url


@pytest.fixture(scope="module")
def oai(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def audio_part(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": b64(data), "format": fmt}}


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f"localllm_{name}{{") and f'model="{ALM}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def long_header_wav(seconds: float) -> bytes:
    """A WAV header declaring ``seconds`` of 16 kHz mono audio, carrying 0.1 s of it."""
    rate, n = 16000, int(seconds * 16000) * 2
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    body = b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", n) + b"\0" * 3200
    return b"RIFF" + struct.pack("<I", min(n + 36, 0xFFFFFFFF)) + body


# ------------------------------------------------------------------------------------------ the model


def test_show_tags_and_models_say_audio(url):
    c = ollama.Client(host=url)
    caps = c.show(ALM).capabilities
    assert "audio" in caps and "vision" not in caps
    raw = httpx.post(url + "/api/show", json={"model": ALM}).json()
    assert raw["projector_info"]["clip.projector_type"] == "ultravox"
    assert "audio" not in c.show(TEXT).capabilities
    tags = {m["name"]: m for m in httpx.get(url + "/api/tags").json()["models"]}
    assert "audio" in tags[ALM]["capabilities"] and "audio" not in tags[TEXT]["capabilities"]
    models = {m["id"]: m for m in httpx.get(url + "/v1/models").json()["data"]}
    assert "audio" in models[ALM]["capabilities"]


# ------------------------------------------------------------------------------------------ every face


def test_openai_chat_input_audio_counts_its_tokens(oai, url):
    before = metric(url, "audio_chunks_encoded_total")
    ask = [{"type": "text", "text": "What is said?"}]
    plain = oai.chat.completions.create(model=ALM, messages=[{"role": "user", "content": ask}], max_tokens=3,
                                        temperature=0)
    heard = oai.chat.completions.create(model=ALM, messages=[{"role": "user", "content": ask + [audio_part(wav())]}],
                                        max_tokens=3, temperature=0)
    assert heard.usage.prompt_tokens >= plain.usage.prompt_tokens + AUDIO_TOKENS
    assert metric(url, "audio_chunks_encoded_total") == before + 1
    assert metric(url, "audio_tokens_total") >= AUDIO_TOKENS and metric(url, "audio_encode_seconds_total") > 0


def test_responses_input_audio(oai):
    r = oai.responses.create(model=ALM, max_output_tokens=3, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "What is said?"}, audio_part(wav(seed=2))]}])
    plain = oai.responses.create(model=ALM, max_output_tokens=3, temperature=0, input="What is said?")
    assert r.usage.input_tokens >= plain.usage.input_tokens + AUDIO_TOKENS - 2


def test_ollama_native_audio_rides_in_images(url):
    c = ollama.Client(host=url)
    r = c.chat(model=ALM, messages=[{"role": "user", "content": "What is said?", "images": [wav(seed=3)]}],
               options=FAST)
    plain = c.chat(model=ALM, messages=[{"role": "user", "content": "What is said?"}], options=FAST)
    assert r.prompt_eval_count >= plain.prompt_eval_count + AUDIO_TOKENS
    g = c.generate(model=ALM, prompt="Transcribe:", images=[wav(seed=3)], options=FAST)
    assert g.prompt_eval_count >= AUDIO_TOKENS


def test_transcriptions_through_the_openai_client(oai, url):
    clip = wav(seed=4)
    t = oai.audio.transcriptions.create(model=ALM, file=("memo.wav", clip, "audio/wav"), temperature=0,
                                        prompt="A short memo.", language="en")
    assert isinstance(t.text, str) and t.text
    text = oai.audio.transcriptions.create(model=ALM, file=("memo.wav", clip), response_format="text",
                                           prompt="A short memo.", language="en")
    assert isinstance(text, str) and text.strip() == t.text  # greedy both times: the same transcript
    v = oai.audio.transcriptions.create(model=ALM, file=("memo.wav", clip), response_format="verbose_json",
                                        prompt="A short memo.", language="en")
    assert v.text == t.text and abs(v.duration - 1.5) < 0.01 and v.language == "en"
    assert v.segments and v.segments[0].end == v.duration
    # what nothing measures is left out (constants there read as "certain speech"); what is known is there
    r = httpx.post(url + "/v1/audio/transcriptions", files={"file": ("memo.wav", io.BytesIO(clip))},
                   data={"model": ALM, "response_format": "verbose_json", "temperature": "0",
                         "prompt": "A short memo.", "language": "en"}, timeout=120)
    seg = r.json()["segments"][0]
    assert not {"avg_logprob", "no_speech_prob", "tokens"} & seg.keys(), seg
    assert seg["temperature"] == 0.0 and seg["compression_ratio"] > 0 and seg["text"] == t.text


# ------------------------------------------------------------------------------------------ bad input


BAD = [
    (b"\x00\x01 definitely not audio \x02" * 8, "wav", "not a WAV, MP3 or FLAC"),
    (wav(seed=5)[:2000], "wav", "truncated"),
    (long_header_wav(5 * 3600), "wav", "more than the 600 s allowed"),
    # 6,000 frames at 8 Hz (750 s once resampled) behind a byte rate that would make them 0.00001 s
    (forged_wav(8, 0xFFFFFFF0, 6000), "wav", "lasts 750 s, more than the 600 s allowed"),
    (b"OggS\x00\x02" + b"\x00" * 64, "wav", "Ogg (Vorbis/Opus) audio is not supported"),
]


@pytest.mark.parametrize(("data", "fmt", "says"), BAD,
                         ids=["not-audio", "truncated", "absurd-duration", "forged-byte-rate", "ogg"])
def test_bad_clips_are_400s_in_each_apis_shape(oai, url, data, fmt, says):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=ALM, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, audio_part(data, fmt)]}])
    assert says in e.value.body["message"] and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        oai.audio.transcriptions.create(model=ALM, file=("clip.wav", data))
    assert says in e.value.body["message"]
    r = httpx.post(url + "/v1/responses", json={"model": ALM, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}, audio_part(data, fmt)]}]})
    assert r.status_code == 400 and says in r.json()["error"]["message"]
    if data[:4] in (b"RIFF", b"OggS"):  # Ollama's images: bytes that are neither image nor audio say "image"
        with pytest.raises(ollama.ResponseError) as oe:
            ollama.Client(host=url).chat(model=ALM, messages=[{"role": "user", "content": "Hi", "images": [data]}])
        assert oe.value.status_code == 400 and says in oe.value.error
    ok = oai.chat.completions.create(model=ALM, max_tokens=2, temperature=0, messages=[
        {"role": "user", "content": [audio_part(wav(seed=6))]}])
    assert ok.usage.prompt_tokens >= AUDIO_TOKENS  # nothing else affected


def test_the_duration_limit_is_the_environments(oai, monkeypatch):
    monkeypatch.setenv("LOCALLLM_MAX_AUDIO_SECONDS", "1")
    with pytest.raises(openai.BadRequestError, match=r"lasts 2 s, more than the 1 s allowed"):
        oai.audio.transcriptions.create(model=ALM, file=("two.wav", wav(2.0)))


def test_an_unsupported_declared_format_and_audio_for_a_text_model(oai, url):
    with pytest.raises(openai.BadRequestError, match="'m4a' is not supported"):
        oai.chat.completions.create(model=ALM, max_tokens=2, messages=[
            {"role": "user", "content": [audio_part(wav(), "m4a")]}])
    with pytest.raises(openai.BadRequestError, match=f'"{TEXT}" does not support audio'):
        oai.chat.completions.create(model=TEXT, max_tokens=2,
                                    messages=[{"role": "user", "content": [audio_part(wav())]}])
    with pytest.raises(openai.BadRequestError, match="does not support audio"):
        oai.audio.transcriptions.create(model=TEXT, file=("memo.wav", wav()))
    with pytest.raises(ollama.ResponseError, match="does not support audio"):
        ollama.Client(host=url).chat(model=TEXT, messages=[{"role": "user", "content": "Hi", "images": [wav()]}])


def test_transcriptions_form_errors(url):
    r = httpx.post(url + "/v1/audio/transcriptions", data={"model": ALM})
    assert r.status_code == 400 and "multipart" in r.json()["error"]["message"]
    files = {"file": ("memo.wav", io.BytesIO(wav()), "audio/wav")}
    r = httpx.post(url + "/v1/audio/transcriptions", files=files, data={"model": ALM, "response_format": "srt"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    r = httpx.post(url + "/v1/audio/transcriptions", files={"file": ("m.wav", io.BytesIO(wav()))}, data={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_the_cli_transcribes_through_a_server(url, tmp_path):
    """``--host``: the clip travels in Ollama's ``images`` (base64), as the CLI sends any media to a server."""
    import os
    import subprocess
    import sys

    (tmp_path / "memo.wav").write_bytes(wav(seed=8))
    r = subprocess.run([sys.executable, "-m", "localllm", "transcribe", ALM, "memo.wav", "--host", url,
                        "--num-predict", "4", "--verbose"], capture_output=True, text=True, cwd=tmp_path,
                       timeout=120, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and "prompt eval count:" in r.stderr
    r = subprocess.run([sys.executable, "-m", "localllm", "transcribe", TEXT, "memo.wav", "--host", url],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120, env=dict(os.environ))
    assert r.returncode != 0 and "does not support audio" in r.stderr and "Traceback" not in r.stderr
