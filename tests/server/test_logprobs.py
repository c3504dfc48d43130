"""``logprobs`` / ``top_logprobs`` in each API's shape on the real default model: Ollama's ``/api/chat`` and
``/api/generate`` (through the ``ollama`` client), OpenAI's Chat Completions and legacy Completions (through the
``openai`` SDK); out of range is a 400 in each API's shape."""

from __future__ import annotations

import math

import httpx
import ollama
import openai
import pytest

from tests.server.conftest import MODEL

GREEDY = {"temperature": 0, "seed": 1, "num_predict": 5}
ASK = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def client(url):
    return ollama.Client(host=url)


@pytest.fixture(scope="module")
def oai(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _check(entries, n_top: int, text: str) -> None:
    """One entry per generated token, the tokens spell the text, greedy picks the most likely token."""
    assert "".join(e.token for e in entries) == text
    for e in entries:
        assert e.logprob <= 0 and math.isfinite(e.logprob)
        assert len(e.top_logprobs or []) == n_top
        if n_top:
            tops = [t.logprob for t in e.top_logprobs]
            assert tops == sorted(tops, reverse=True) and e.top_logprobs[0].token == e.token
            assert abs(tops[0] - e.logprob) < 1e-6


def test_ollama_chat_logprobs(client, url):
    r = client.chat(MODEL, messages=ASK, options=GREEDY, logprobs=True, top_logprobs=3)
    assert len(r.logprobs) == r.eval_count
    _check(r.logprobs, 3, r.message.content)
    chunks = list(client.chat(MODEL, messages=ASK, options=GREEDY, logprobs=True, top_logprobs=3, stream=True))
    streamed = [lp for c in chunks for lp in (c.logprobs or [])]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in r.logprobs]
    raw = httpx.post(url + "/api/chat", json={"model": MODEL, "messages": ASK, "options": GREEDY, "stream": False,
                                              "logprobs": True}).json()
    first = raw["logprobs"][0]
    assert set(first) == {"token", "logprob", "bytes"} and bytes(first["bytes"]).decode() == first["token"]
    plain = client.chat(MODEL, messages=ASK, options=GREEDY)
    assert plain.logprobs is None and plain.message.content == r.message.content  # asked for only


def test_ollama_generate_logprobs(client):
    r = client.generate(MODEL, "The sky is", options=GREEDY, logprobs=True, top_logprobs=1)
    assert len(r.logprobs) == r.eval_count
    _check(r.logprobs, 1, r.response)


def test_openai_chat_logprobs(oai):
    r = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, temperature=0, logprobs=True,
                                    top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    _check(content, 2, r.choices[0].message.content)
    chunks = list(oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, temperature=0, logprobs=True,
                                              top_logprobs=2, stream=True))
    streamed = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    without = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, temperature=0)
    assert without.choices[0].logprobs is None


def test_openai_completions_legacy_logprobs(oai):
    r = oai.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.token_logprobs) == len(lp.tokens)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    tops = zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    assert all(len(top) <= 2 and max(top.values()) == p for top, p in tops)
    echo = oai.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0, logprobs=0,
                                  echo=True)
    lp = echo.choices[0].logprobs
    assert lp.text_offset[0] == len("The sky is") and lp.top_logprobs is None


@pytest.mark.parametrize("path, body", [
    ("/api/chat", {"messages": ASK, "logprobs": True, "top_logprobs": 21}),
    ("/api/generate", {"prompt": "x", "logprobs": True, "top_logprobs": -1}),
    ("/v1/chat/completions", {"messages": ASK, "logprobs": True, "top_logprobs": 21}),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}),
])
def test_out_of_range_is_400(url, path, body):
    r = httpx.post(url + path, json={"model": MODEL, **body})
    assert r.status_code == 400
    if path.startswith("/api"):
        assert r.json() == {"error": "top_logprobs must be between 0 and 20"}
    else:
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and "must be between 0 and 20" in err["message"]
        assert err["param"] in ("top_logprobs", "logprobs")


def test_openai_logit_bias_bans_and_forces_tokens(oai, default_model):
    """``logit_bias``: -100 keeps a token out (greedy takes the next best), +100 makes it the pick; both APIs."""
    import llama_cpp

    base = oai.completions.create(model=MODEL, prompt="The sky is", max_tokens=1, temperature=0, logprobs=2)
    lp = base.choices[0].logprobs
    first, runner_up = lp.tokens[0], [t for t in lp.top_logprobs[0] if t != lp.tokens[0]][0]
    vocab = llama_cpp.Llama(str(default_model.path), vocab_only=True, verbose=False)
    tok = vocab.tokenize(first.encode(), add_bos=False, special=False)
    assert len(tok) == 1 and vocab.detokenize(tok).decode() == first
    banned = oai.completions.create(model=MODEL, prompt="The sky is", max_tokens=1, temperature=0,
                                    logit_bias={str(tok[0]): -100})
    assert banned.choices[0].text == runner_up
    chat = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, temperature=0.9, seed=3,
                                       logit_bias={str(tok[0]): 100})
    assert chat.choices[0].message.content == first * 3


@pytest.mark.parametrize("bias, says", [
    ({"hello": 1}, "keys must be token ids"),
    ({"5": 101}, "between -100 and 100"),
    ({"99999999": 1}, "does not have"),
])
def test_openai_logit_bias_bad_input_is_400(oai, bias, says):
    with pytest.raises(openai.BadRequestError, match=says):
        oai.completions.create(model=MODEL, prompt="x", max_tokens=1, logit_bias=bias)
