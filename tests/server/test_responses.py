"""OpenAI's Responses API (``/v1/responses``) through the official ``openai`` SDK and raw HTTP, on the real
default model: string and item inputs, instructions, max_output_tokens, the stream's events, previous_response_id
(in memory, LRU), retrieve/delete, logprobs, errors in OpenAI's shape. (Function tools end to end:
test_tool_choice.py; reasoning items: test_thinking.py.)"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.conftest import MODEL

HI = "Say hello."


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_string_input(client):
    r = client.responses.create(model=MODEL, input=HI, max_output_tokens=200, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "completed" and r.incomplete_details is None and r.error is None
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.output_text and r.output[0].content[0].type == "output_text"
    u = r.usage
    assert u.input_tokens > 5 and 0 < u.output_tokens < 200 and u.total_tokens == u.input_tokens + u.output_tokens


def test_max_output_tokens_makes_it_incomplete(client):
    r = client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output_text


def test_instructions_and_items(client):
    as_string = client.responses.create(model=MODEL, instructions="Answer in French.", input=HI,
                                        max_output_tokens=6, temperature=0)
    as_items = client.responses.create(model=MODEL, max_output_tokens=6, temperature=0, input=[
        {"role": "developer", "content": "Answer in French."},  # the same system turn, as an item
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": HI}]}])
    assert as_items.output_text == as_string.output_text
    assert as_string.instructions == "Answer in French."


def test_stream_events(client):
    with client.responses.stream(model=MODEL, input=HI, max_output_tokens=200, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    whole = client.responses.create(model=MODEL, input=HI, max_output_tokens=200, temperature=0)
    assert text == final.output_text == whole.output_text
    assert events[0].response.status == "in_progress" and final.status == "completed"
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if e.type == "response.output_text.delta")


def test_raw_stream_frames(url):
    r = httpx.post(url + "/v1/responses", json={"model": MODEL, "input": HI, "max_output_tokens": 3,
                                                 "stream": True}, timeout=60)
    frames = [f for f in r.text.split("\n\n") if f.strip()]
    for f in frames:
        head, data = f.split("\n", 1)
        assert json.loads(data.removeprefix("data: "))["type"] == head.removeprefix("event: ")
    assert "[DONE]" not in r.text
    last = json.loads(frames[-1].split("\n", 1)[1][6:])
    assert last["type"] == "response.incomplete" and last["response"]["incomplete_details"] == {
        "reason": "max_output_tokens"}


def test_previous_response_id_continues_the_conversation(client, url):
    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=8, temperature=0)
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    alone = client.responses.create(model=MODEL, input="What is my name?", max_output_tokens=8, temperature=0)
    # the earlier turn and its answer are in the prompt
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id
    same = client.responses.create(model=MODEL, temperature=0, max_output_tokens=8, input=[
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert same.usage.input_tokens == second.usage.input_tokens  # the same conversation, sent in full
    assert client.responses.retrieve(first.id).output_text == first.output_text
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
    assert e.value.body["param"] == "previous_response_id" and "not found" in e.value.body["message"]


def test_store_false_delete_and_retrieve(client):
    kept = client.responses.create(model=MODEL, input=HI, max_output_tokens=2)
    unkept = client.responses.create(model=MODEL, input=HI, max_output_tokens=2, store=False)
    assert client.responses.retrieve(kept.id).id == kept.id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id=kept.id)


def test_the_store_is_a_bounded_lru():
    from localllm.server.responses_routes import ResponseStore

    store = ResponseStore(max_entries=3, max_bytes=10_000)
    for i in range(4):
        store.put(f"r{i}", [{"role": "user", "content": str(i)}], {"id": f"r{i}"})
    assert store.get("r0") is None and len(store) == 3
    store.get("r1")  # used: r2 is now the oldest
    store.put("r4", [], {"id": "r4"})
    assert store.get("r2") is None and store.get("r1") is not None
    store.put("big", [{"role": "user", "content": "x" * 20_000}], {"id": "big"})  # alone over the size bound
    assert len(store) == 0


def test_logprobs(client):
    r = client.responses.create(model=MODEL, input=HI, max_output_tokens=4, temperature=0, top_logprobs=2,
                                include=["message.output_text.logprobs"])
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens and "".join(lp.token for lp in lps) == r.output_text
    assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob for lp in lps)


@pytest.mark.parametrize("body, needle", [
    ({"input": [{"type": "input_file", "file_id": "f"}]}, "input item type 'input_file'"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "'input_file' is not"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "role must be"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, "not valid JSON"),
    ({"input": "x", "tools": [{"type": "hologram"}]}, "'hologram' is not a Responses API tool type"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "invalid reasoning value"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs must be between 0 and 20"),
    ({"input": "x", "max_output_tokens": "many"}, "max_output_tokens"),
    ({"input": 42}, "input"),
    ({}, "input is required"),
])
def test_bad_requests_in_openai_shape(url, body, needle):
    r = httpx.post(url + "/v1/responses", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and needle in err["message"], err


def test_unknown_fields_and_unknown_model(client, url):
    r = httpx.post(url + "/v1/responses", json={"model": MODEL, "input": "Say hello.", "max_output_tokens": 2,
                                                 "temperature": 0, "prompt_cache_key": "k", "safety_identifier": "s",
                                                 "future": [1]})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "response" and body["status"] in ("completed", "incomplete")
    (item,) = body["output"]
    assert item["type"] == "message" and item["content"][0]["text"] and 0 < body["usage"]["output_tokens"] <= 2
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="no-such-model:1b", input="x")
    assert e.value.body["type"] == "not_found_error" and "no-such-model:1b" in e.value.body["message"]
