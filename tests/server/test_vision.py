"""Images on every face, through the official clients, over a private store holding the default model with the made
vision projector (``Store.set_projector``: the manifest records it) and a text-only copy of it."""

from __future__ import annotations

import base64
import struct
import threading
import zlib

import anthropic
import httpx
import numpy as np
import ollama
import openai
import pytest

from tests.support_vision import IMAGE_TOKENS, png

VLM = "smollm2:135m"
TEXT = "textonly:latest"
FAST = {"temperature": 0, "num_predict": 4, "seed": 1}


@pytest.fixture(scope="module")
def vsrv(installed_default_model, test_projector, tmp_path_factory):
    from localllm.config import paths
    from localllm.store import Store
    from tests.server.derived import serve
    from tests.support import install_copy, private_paths

    root = tmp_path_factory.mktemp("vision-home")
    pp = private_paths(root)
    install_copy(pp.models, paths().models)
    store = Store(paths=pp)
    store.copy(VLM, TEXT)
    m = store.set_projector(VLM, test_projector)
    assert m.projector is not None and m.projector.size == test_projector.stat().st_size
    srv = serve(store)
    yield srv
    srv.stop()
    srv.engine.close()


@pytest.fixture(scope="module")
def url(vsrv) -> str:
    return vsrv.url


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + b64(data)


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f"localllm_{name}{{") and f'model="{VLM}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ------------------------------------------------------------------------------------------ the model


def test_show_list_and_models_say_vision(url, vsrv, test_projector):
    c = ollama.Client(host=url)
    shown = c.show(VLM)
    assert "vision" in shown.capabilities
    raw = httpx.post(url + "/api/show", json={"model": VLM}).json()
    assert raw["projector_info"]["clip.projector_type"] == "mlp"
    assert raw["projector_info"]["clip.vision.projection_dim"] == 576
    assert "vision" not in c.show(TEXT).capabilities and "projector_info" not in httpx.post(
        url + "/api/show", json={"model": TEXT}).json()
    tags = {m["name"]: m for m in httpx.get(url + "/api/tags").json()["models"]}
    assert "vision" in tags[VLM]["capabilities"] and "vision" not in tags[TEXT]["capabilities"]
    models = {m["id"]: m for m in httpx.get(url + "/v1/models").json()["data"]}
    assert "vision" in models[VLM]["capabilities"]


# ------------------------------------------------------------------------------------------ Ollama


def test_ollama_chat_and_generate_count_image_tokens(url):
    c = ollama.Client(host=url)
    ask = "Describe the picture."
    plain = c.chat(VLM, messages=[{"role": "user", "content": ask}], options=FAST)
    seen = c.chat(VLM, messages=[{"role": "user", "content": ask, "images": [png(seed=1)]}], options=FAST)
    assert seen.prompt_eval_count >= plain.prompt_eval_count + IMAGE_TOKENS
    two = c.generate(VLM, prompt=ask, images=[png(seed=2), png(seed=3)], options=FAST)
    assert two.prompt_eval_count >= plain.prompt_eval_count + 2 * IMAGE_TOKENS


def test_a_follow_up_about_the_same_picture_is_not_encoded_again(url):
    c = ollama.Client(host=url)
    pic = png(seed=50)
    first = [{"role": "user", "content": "What is this?", "images": [pic]}]
    r1 = c.chat(VLM, messages=first, options=FAST)
    n = metric(url, "images_encoded_total")
    assert n >= 1
    r2 = c.chat(VLM, messages=first + [{"role": "assistant", "content": r1.message.content},
                                      {"role": "user", "content": "What colour is it?"}], options=FAST)
    assert r2.prompt_eval_count > r1.prompt_eval_count
    assert metric(url, "images_encoded_total") == n  # the second question reused the encoded picture
    assert metric(url, "image_tokens_total") >= IMAGE_TOKENS


def test_an_image_stream_beside_a_text_stream(url):
    c = ollama.Client(host=url)
    out: dict[str, object] = {}
    question = {"role": "user", "content": "What is the capital of France? Answer in one short sentence."}
    solo = c.chat(VLM, messages=[question], options={**FAST, "num_predict": 12})

    def run(key, msg):
        out[key] = c.chat(VLM, messages=[msg], options={**FAST, "num_predict": 12})

    ts = [threading.Thread(target=run, args=("text", question)),
          threading.Thread(target=run, args=("image", {"role": "user", "content": "Describe it.",
                                                       "images": [png(seed=60)]}))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert out["text"].done and "Paris" in out["text"].message.content  # type: ignore[attr-defined]
    assert out["text"].message.content[:20] == solo.message.content[:20]  # type: ignore[attr-defined]
    assert out["image"].done and out["image"].prompt_eval_count > IMAGE_TOKENS  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------------ OpenAI, Anthropic


def _oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_openai_image_url_parts_change_the_numbers(url):
    client = _oai(url)

    def first(pic: bytes) -> np.ndarray:
        r = client.chat.completions.create(
            model=VLM, max_tokens=1, temperature=0, logprobs=True, top_logprobs=5,
            messages=[{"role": "user", "content": [{"type": "text", "text": "Describe it."},
                                                   {"type": "image_url", "image_url": {"url": data_uri(pic)}}]}])
        assert r.usage.prompt_tokens > IMAGE_TOKENS
        return np.array([t.logprob for t in r.choices[0].logprobs.content[0].top_logprobs])

    a, a2, b = first(png(seed=7)), first(png(seed=7)), first(png(seed=8))
    np.testing.assert_allclose(a, a2, atol=1e-4)
    assert not np.allclose(a, b, atol=1e-3)


def test_openai_responses_input_image(url):
    r = _oai(url).responses.create(model=VLM, max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Describe it."},
                                     {"type": "input_image", "image_url": data_uri(png(seed=9))}]}])
    assert r.usage.input_tokens > IMAGE_TOKENS


def test_anthropic_image_block(url):
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    r = client.messages.create(model=VLM, max_tokens=4, messages=[
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(png(seed=10))}},
            {"type": "text", "text": "Describe it."}]}])
    assert r.usage.input_tokens > IMAGE_TOKENS


# ------------------------------------------------------------------------------------------ bad input


def _bomb() -> bytes:
    """A PNG header declaring 100,000 x 100,000 pixels (a decompression bomb: refused before decoding)."""
    ihdr = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", 13) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return b"\x89PNG\r\n\x1a\n" + chunk


@pytest.mark.parametrize("image, words", [
    ("not base64!!", "not valid base64"),
    (b64(b"hello, I am text"), "not a PNG, JPEG"),
    (b64(_bomb()), "declares 100000x100000 pixels"),
    (b64(png()[:30]), "truncated"),
])
def test_ollama_bad_images_are_400s(url, image, words):
    r = httpx.post(url + "/api/chat", json={"model": VLM, "stream": False, "options": FAST, "messages": [
        {"role": "user", "content": "hi", "images": [image]}]})
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]


def test_too_large_image(url, monkeypatch):
    monkeypatch.setenv("LOCALLLM_MAX_IMAGE_BYTES", "1000")
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=url).chat(VLM, messages=[{"role": "user", "content": "hi", "images": [png()]}])
    assert e.value.status_code == 400 and "LOCALLLM_MAX_IMAGE_BYTES" in str(e.value)


def test_an_image_for_a_text_model_names_the_model(url):
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=url).chat(TEXT, messages=[{"role": "user", "content": "hi", "images": [png()]}])
    assert e.value.status_code == 400 and TEXT in str(e.value) and "does not support images" in str(e.value)


@pytest.mark.parametrize("image_url, words", [
    ("https://example.com/cat.png", "LOCALLLM_IMAGE_URLS=1"),
    ("file:///etc/passwd", "never read"),
    ("data:image/png,rawbytes", "must be base64"),
])
def test_openai_refused_urls(url, image_url, words):
    with pytest.raises(openai.BadRequestError) as e:
        _oai(url).chat.completions.create(model=VLM, max_tokens=1, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}}]}])
    assert words in str(e.value)


def test_anthropic_bad_image_is_its_error_shape(url):
    r = httpx.post(url + "/v1/messages", headers={"x-api-key": "x", "anthropic-version": "2023-06-01"}, json={
        "model": VLM, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(b"GIF89a")}}]}]})
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and "truncated" in body["error"]["message"]


def test_anthropic_count_tokens_counts_image_tokens(url):
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    text = [{"type": "text", "text": "Describe it."}]
    pic = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(png(seed=12))}}
    plain = client.messages.count_tokens(model=VLM, messages=[{"role": "user", "content": text}])
    seen = client.messages.count_tokens(model=VLM, messages=[{"role": "user", "content": [pic, *text]}])
    assert seen.input_tokens >= plain.input_tokens + IMAGE_TOKENS
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model=TEXT, messages=[{"role": "user", "content": [pic, *text]}])


def test_a_text_model_says_so_before_the_image_is_looked_at(url):
    r = httpx.post(url + "/api/chat", json={"model": TEXT, "stream": False, "messages": [
        {"role": "user", "content": "hi", "images": [b64(b"hello")]}]})  # valid base64, not an image
    assert r.status_code == 400 and "does not support images" in r.json()["error"]


def test_remote_image_urls_when_allowed_never_from_a_private_address(url, monkeypatch):
    from localllm.server import images
    from tests.support import MirrorServer, Route

    srv = MirrorServer()
    srv.routes["/cat.png"] = Route(png(seed=13))
    try:
        monkeypatch.setenv("LOCALLLM_IMAGE_URLS", "1")
        part = {"type": "image_url", "image_url": {"url": srv.url + "/cat.png"}}
        with pytest.raises(openai.BadRequestError, match="not a public address"):  # loopback: never fetched
            _oai(url).chat.completions.create(model=VLM, max_tokens=1, messages=[{"role": "user", "content": [part]}])
        assert not [h for h in srv.hits if h.path == "/cat.png"]
        # what a public host would give (the address check is the one part a loopback test cannot show)
        monkeypatch.setattr(images, "_public", lambda host: True)
        r = _oai(url).chat.completions.create(model=VLM, max_tokens=1, messages=[{"role": "user", "content": [part]}])
        assert r.usage.prompt_tokens > IMAGE_TOKENS and [h for h in srv.hits if h.path == "/cat.png"]
    finally:
        srv.close()
