"""Bad input, the same rules in every API: unknown fields are ignored (as the real APIs do), a wrong type is a
400 in that API's shape, a JSON schema the grammar cannot follow is one sentence naming the keyword."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MODEL

MSG = [{"role": "user", "content": "Hi"}]
SHORT = {"ollama": {"options": {"num_predict": 2}}, "openai": {"max_tokens": 2}}

# (path, a minimal valid body, its API)
ROUTES = [
    ("/api/chat", {"model": MODEL, "messages": MSG, "stream": False, "options": {"num_predict": 2}}, "ollama"),
    ("/api/generate", {"model": MODEL, "prompt": "Hi", "stream": False, "options": {"num_predict": 2}}, "ollama"),
    ("/v1/chat/completions", {"model": MODEL, "messages": MSG, "max_tokens": 2}, "openai"),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}, "openai"),
    ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 2}, "openai"),
    ("/v1/messages", {"model": MODEL, "messages": MSG, "max_tokens": 2}, "anthropic"),
]


def _is_error(r: httpx.Response, api: str, status: int = 400) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    if api == "ollama":
        assert set(body) == {"error"} and isinstance(body["error"], str)
        return body["error"]
    if api == "openai":
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["type"] == "invalid_request_error"
        return body["error"]["message"]
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    return body["error"]["message"]


def _answer(path: str, body: dict) -> str:
    """The text of an answer, after checking it has its API's shape."""
    if path == "/api/chat":
        assert body["done"] is True and body["message"]["role"] == "assistant"
        return body["message"]["content"]
    if path == "/api/generate":
        assert body["done"] is True
        return body["response"]
    if path == "/v1/chat/completions":
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
        return body["choices"][0]["message"]["content"]
    if path == "/v1/completions":
        assert body["object"] == "text_completion"
        return body["choices"][0]["text"]
    if path == "/v1/responses":
        assert body["object"] == "response" and body["output"][0]["type"] == "message"
        return body["output"][0]["content"][0]["text"]
    assert body["type"] == "message" and body["content"][0]["type"] == "text"
    return body["content"][0]["text"]


@pytest.mark.parametrize("path, body, api", ROUTES)
def test_unknown_fields_are_ignored(url, path, body, api):
    r = httpx.post(url + path, json={**body, "frobnicate": True, "x-future": {"a": [1]}}, timeout=60)
    assert r.status_code == 200, r.text
    assert isinstance(_answer(path, r.json()), str)


@pytest.mark.parametrize("path, body, api", ROUTES)
@pytest.mark.parametrize("field, value", [("model", 7), ("stream", "yes")])
def test_wrong_types_are_400_in_the_apis_shape(url, path, body, api, field, value):
    message = _is_error(httpx.post(url + path, json={**body, field: value}), api)
    assert field in message


@pytest.mark.parametrize("path, body, api, field, value", [
    ("/api/chat", ROUTES[0][1], "ollama", "messages", [{"role": "user", "content": 5}]),
    ("/api/generate", ROUTES[1][1], "ollama", "logprobs", "sure"),
    ("/v1/chat/completions", ROUTES[2][1], "openai", "messages", [{"content": "no role"}]),
    ("/v1/completions", ROUTES[3][1], "openai", "logprobs", "many"),
    ("/v1/responses", ROUTES[4][1], "openai", "input", [{"role": "user", "content": 5}]),
    ("/v1/messages", ROUTES[5][1], "anthropic", "messages", [{"role": "user", "content": 5}]),
    ("/v1/messages", ROUTES[5][1], "anthropic", "system", [{"type": "image"}]),
    ("/v1/messages", ROUTES[5][1], "anthropic", "thinking", {"type": "sometimes"}),
    ("/v1/messages", ROUTES[5][1], "anthropic", "tools", [{"name": "f", "input_schema": "object"}]),
])
def test_wrong_nested_types(url, path, body, api, field, value):
    message = _is_error(httpx.post(url + path, json={**body, field: value}), api)
    assert message.startswith(field) or f" {field}" in message, message


BAD_SCHEMAS = [
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, '"not" (at properties.a)'),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, '"if"'),
    ({"$ref": "https://example.com/schema.json"}, '"$ref"'),
    ({"type": "object", "properties": {"a": {"type": "date"}}}, '"type" (at properties.a)'),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "[a-z]+"}}}, '"pattern"'),
    ({"type": "array", "items": {"anyOf": [{"type": "string"}, {"not": {}}]}}, '(at items.anyOf[1])'),
]


@pytest.mark.parametrize("schema, needle", BAD_SCHEMAS)
def test_a_format_schema_the_grammar_cannot_follow_names_the_keyword(url, schema, needle):
    message = _is_error(httpx.post(url + "/api/generate", json={"model": MODEL, "prompt": "x", "format": schema}),
                        "ollama")
    assert message.startswith("format: the JSON schema keyword ") and needle in message, message
    message = _is_error(httpx.post(url + "/v1/chat/completions", json={
        "model": MODEL, "messages": MSG,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}), "openai")
    assert message.startswith("response_format: the JSON schema keyword ") and needle in message
    message = _is_error(httpx.post(url + "/v1/responses", json={
        "model": MODEL, "input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}),
        "openai")
    assert needle in message


def test_schemas_the_grammar_follows_pass(url):
    schema = {"type": "object", "$defs": {"name": {"type": "string", "maxLength": 10}},
              "properties": {"n": {"$ref": "#/$defs/name"}, "k": {"type": ["integer", "null"]},
                             "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
                             "code": {"type": "string", "pattern": "^[A-Z]{2}$"}},
              "required": ["n"], "additionalProperties": False}
    r = httpx.post(url + "/api/generate", json={"model": MODEL, "prompt": "x", "format": schema, "stream": False,
                                                "options": {"num_predict": 3}}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["done"] and r.json()["response"].lstrip().startswith("{"), r.json()  # the schema's object
