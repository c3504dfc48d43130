"""Thinking end to end over HTTP on a real GGUF: the default model with Qwen3's chat template (``enable_thinking``,
``<think>…</think>``), installed in a private store, and a grammar (``THINK_GBNF``, applied by llama.cpp to
every request without a format) that makes it write ``<think>\\n…\\n</think>\\n\\n`` and then an answer. The
tags arrive cut across several tokens (SmolLM2 has no ``<think>`` token), as a real stream must split them.

The reasoning must arrive apart from the answer in every API: ``message.thinking`` / ``thinking`` (ollama),
``reasoning`` / ``reasoning_content`` (openai chat), a ``reasoning`` item (Responses), ``thinking`` blocks
(Anthropic); ``think=false`` renders the template's no-think form."""

from __future__ import annotations

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.fixtures_thinking import THINK_GBNF, write_thinking_model
from tests.server.conftest import MODEL
from tests.server.derived import grammar_backend, install_derived, serve

THINKER = "smollm2-think:135m"
ASK = [{"role": "user", "content": "What is two plus two?"}]
GREEDY = {"temperature": 0, "seed": 1}


@pytest.fixture(scope="module")
def think_server(default_model_path, tmp_path_factory):
    gguf = write_thinking_model(default_model_path)
    store = install_derived(gguf, THINKER, tmp_path_factory.mktemp("think-home"))
    srv = serve(store, grammar_backend(THINK_GBNF))
    yield srv
    srv.stop()
    srv.engine.close()


@pytest.fixture(scope="module")
def client(think_server):
    return ollama.Client(host=think_server.url)


@pytest.fixture(scope="module")
def oai(think_server):
    return openai.OpenAI(base_url=think_server.url + "/v1", api_key="unused", max_retries=0)


def _clean(text: str | None) -> bool:
    return bool(text) and "<think>" not in text and "</think>" not in text and "think>" not in text


def test_show_lists_thinking(client, url):
    assert "thinking" in client.show(THINKER).capabilities
    assert "thinking" not in ollama.Client(host=url).show(MODEL).capabilities


def test_chat_thinking_apart_from_content(client):
    r = client.chat(THINKER, messages=ASK, options=GREEDY, think=True)
    assert _clean(r.message.thinking) and _clean(r.message.content), r.message
    assert r.message.content.endswith(".")  # the grammar's answer, whole
    unset = client.chat(THINKER, messages=ASK, options=GREEDY)  # unset on a thinking model means on (Ollama)
    assert (unset.message.thinking, unset.message.content) == (r.message.thinking, r.message.content)


def test_chat_stream_sends_thinking_first_then_content_and_joins_like_non_streaming(client):
    chunks = list(client.chat(THINKER, messages=ASK, options=GREEDY, think=True, stream=True))
    kinds = ["thinking" if c.message.thinking else "content" for c in chunks if c.message.thinking or c.message.content]
    assert kinds[0] == "thinking" and kinds[-1] == "content"
    assert kinds == sorted(kinds, key=lambda k: k == "content")  # all the thinking, then all the content
    assert not any(c.message.thinking and c.message.content for c in chunks)
    whole = client.chat(THINKER, messages=ASK, options=GREEDY, think=True)
    assert "".join(c.message.thinking or "" for c in chunks) == whole.message.thinking
    assert "".join(c.message.content or "" for c in chunks) == whole.message.content
    assert chunks[-1].done and chunks[-1].done_reason == "stop"


def test_think_false_renders_the_no_think_form(client):
    on = client.chat(THINKER, messages=ASK, options=GREEDY, think=True)
    off = client.chat(THINKER, messages=ASK, options=GREEDY, think=False)
    # Qwen3's template closes an empty thought in the prompt for enable_thinking=False: "<think>\n\n</think>\n\n"
    assert off.prompt_eval_count > on.prompt_eval_count
    assert not off.message.thinking  # not split: what the model writes stays in the content, as in Ollama
    assert off.message.content.startswith("<think>")


def test_generate_thinking_and_levels(client):
    r = client.generate(THINKER, "What is two plus two?", options=GREEDY, think="high")
    assert _clean(r.thinking) and _clean(r.response)
    streamed = list(client.generate(THINKER, "What is two plus two?", options=GREEDY, think="low", stream=True))
    assert "".join(c.thinking or "" for c in streamed) == r.thinking  # levels are "on" for Qwen3's template
    assert "".join(c.response or "" for c in streamed) == r.response
    r = client.generate(THINKER, "What is two plus two?", options=GREEDY, think="max")
    assert r.thinking


def test_thinking_tokens_are_counted(oai):
    r = oai.chat.completions.create(model=THINKER, messages=ASK, temperature=0)
    details = r.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < r.usage.completion_tokens


def test_openai_chat_reasoning_field(oai):
    r = oai.chat.completions.create(model=THINKER, messages=ASK, temperature=0)
    msg = r.choices[0].message
    extra = msg.model_extra or {}
    assert _clean(extra["reasoning"]) and extra["reasoning_content"] == extra["reasoning"] and _clean(msg.content)
    chunks = list(oai.chat.completions.create(model=THINKER, messages=ASK, temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, content) == (extra["reasoning"], msg.content)
    assert not any((d.model_extra or {}).get("reasoning") and d.content for d in deltas)
    # reasoning_effort "none" turns it off (Ollama's mapping): nothing is split out
    off = oai.chat.completions.create(model=THINKER, messages=ASK, temperature=0, reasoning_effort="none")
    assert "reasoning" not in (off.choices[0].message.model_extra or {})
    assert off.choices[0].message.content.startswith("<think>")


def test_reasoning_in_history_is_accepted(oai):
    first = oai.chat.completions.create(model=THINKER, messages=ASK, temperature=0)
    follow = oai.chat.completions.create(model=THINKER, temperature=0, messages=[
        *ASK, first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And three?"}])
    answer = follow.choices[0].message
    assert _clean((answer.model_extra or {}).get("reasoning")) and _clean(answer.content), answer


def test_responses_reasoning_item(oai):
    r = oai.responses.create(model=THINKER, input="What is two plus two?", temperature=0)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert _clean(r.output[0].summary[0].text) and _clean(r.output_text)
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    with oai.responses.stream(model=THINKER, input="What is two plus two?", temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    first_text = types.index("response.output_text.delta")
    assert types.index("response.reasoning_summary_text.delta") < first_text
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta")
    assert thought == r.output[0].summary[0].text and final.output_text == r.output_text


def test_responses_encrypted_reasoning_round_trips_without_a_store(oai):
    """Codex asks for ``reasoning.encrypted_content`` with ``store: false`` and sends the item back next turn."""
    r = oai.responses.create(model=THINKER, input="What is two plus two?", temperature=0, store=False,
                             include=["reasoning.encrypted_content"])
    reasoning = r.output[0]
    assert reasoning.type == "reasoning" and reasoning.encrypted_content
    assert reasoning.summary[0].text not in reasoning.encrypted_content  # opaque
    back = oai.responses.create(model=THINKER, temperature=0, store=False, include=["reasoning.encrypted_content"],
                                input=[{"role": "user", "content": "What is two plus two?"},
                                       {"type": "reasoning", "id": reasoning.id, "summary": [],
                                        "encrypted_content": reasoning.encrypted_content},
                                       *[o.model_dump(exclude_none=True) for o in r.output[1:]],
                                       {"role": "user", "content": "And three?"}])
    assert back.status == "completed" and back.usage.input_tokens > r.usage.input_tokens
    plain = oai.responses.create(model=THINKER, input="What is two plus two?", temperature=0)
    assert plain.output[0].encrypted_content is None  # only when asked for


def test_anthropic_thinking_blocks(think_server):
    client = anthropic.Anthropic(base_url=think_server.url, api_key="unused", max_retries=0)
    m = client.messages.create(model=THINKER, max_tokens=200, messages=ASK,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert _clean(m.content[0].thinking) and _clean(m.content[1].text) and m.stop_reason == "end_turn"
    with client.messages.stream(model=THINKER, max_tokens=200, messages=ASK,
                                thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas[0] == "thinking_delta" and "text_delta" in deltas
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text"] and [b.type for b in final.content] == ["thinking", "text"]
    # thinking sent back in the history (Claude Code does) is accepted
    again = client.messages.create(model=THINKER, max_tokens=200, messages=[
        *ASK, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": "And three?"}])
    assert [b.type for b in again.content] == ["thinking", "text"] and _clean(again.content[1].text), again


def test_anthropic_adaptive_thinking_and_effort_think_as_enabled_does_and_disabled_wins(think_server):
    """``thinking: adaptive`` is the model's default: a thinking model thinks, the same blocks as ``enabled``
    (greedy); ``output_config.effort`` alone asks for thinking at its level (Qwen3's template has no levels: on;
    the level a template with levels gets is ``think_of``'s doctest); ``disabled`` wins over an effort: the
    no-think form, nothing split out."""
    client = anthropic.Anthropic(base_url=think_server.url, api_key="unused", max_retries=0)

    def blocks(effort: str | None = None, **kw) -> list[tuple[str, str]]:
        extra = {"temperature": 0, **({"output_config": {"effort": effort}} if effort else {})}
        m = client.messages.create(model=THINKER, max_tokens=200, messages=ASK, extra_body=extra, **kw)
        return [(b.type, b.thinking if b.type == "thinking" else b.text) for b in m.content]

    enabled = blocks(thinking={"type": "enabled", "budget_tokens": 1024})
    assert [t for t, _ in enabled] == ["thinking", "text"] and all(_clean(x) for _, x in enabled), enabled
    assert blocks(thinking={"type": "adaptive"}) == enabled
    assert blocks("low", thinking={"type": "adaptive"}) == enabled
    assert blocks("max") == enabled
    off = blocks("high", thinking={"type": "disabled"})
    assert [t for t, _ in off] == ["text"] and off[0][1].startswith("<think>"), off  # not split, as think=false
    with pytest.raises(anthropic.BadRequestError) as e:
        blocks("extreme")
    assert "output_config.effort must be low, medium, high or max" in e.value.body["error"]["message"]


def test_a_model_that_cannot_think(url):
    """Ollama's 400 in Ollama's words on /api; OpenAI's shape on /v1; Anthropic's API drops think."""
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=url).chat(MODEL, messages=ASK, think=True)
    assert e.value.status_code == 400 and e.value.error == f'"{MODEL}" does not support thinking'
    r = httpx.post(url + "/api/generate", json={"model": MODEL, "prompt": "x", "think": "medium"})
    assert r.status_code == 400 and r.json() == {"error": f'"{MODEL}" does not support thinking'}
    r = httpx.post(url + "/api/chat", json={"model": MODEL, "messages": ASK, "think": False, "stream": False,
                                            "options": {"num_predict": 2}})
    assert r.status_code == 200 and "thinking" not in r.json()["message"]  # think=false is accepted
    assert r.json()["message"]["content"] and r.json()["done_reason"] == "length"
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, reasoning_effort="high")
    assert e.value.body == {"message": f'"{MODEL}" does not support thinking', "type": "invalid_request_error",
                            "param": "think", "code": None}
    m = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0).messages.create(
        model=MODEL, max_tokens=3, messages=ASK, thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in m.content] == ["text"] and m.content[0].text and m.stop_reason == "max_tokens"


@pytest.mark.parametrize("value", ["x", 3, "MAX", ["low"]])
def test_invalid_think_values(url, value):
    r = httpx.post(url + "/api/chat", json={"model": MODEL, "messages": ASK, "think": value})
    assert r.status_code == 400 and r.json()["error"].startswith("invalid think value: ")
    assert '(must be "high", "medium", "low", "max", true, or false)' in r.json()["error"]
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": ASK, "reasoning_effort": "lots"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("invalid reasoning value")
