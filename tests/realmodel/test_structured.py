"""Anthropic's ``output_config.format`` (structured output) on a real model: the answer is JSON matching the schema,
where the model by itself answers in prose (so this is red when the format is not wired to the sampler)."""

from __future__ import annotations

import json

import anthropic

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                           "population_millions": {"type": "number"}},
          "required": ["city", "country", "population_millions"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Tell me about Paris in one sentence."}]


def test_output_config_format_gives_json_of_the_schema(coder, coder_url):
    import jsonschema

    client = anthropic.Anthropic(base_url=coder_url, api_key="unused", max_retries=0)
    free = client.messages.create(model=coder, max_tokens=60, messages=ASK,  # type: ignore[arg-type]
                                  extra_body={"temperature": 0})
    try:
        json.loads(free.content[0].text)
        raise AssertionError(f"the model answered JSON unasked: {free.content[0].text!r}")
    except ValueError:
        pass  # prose, as expected: the format below is what makes it JSON
    r = client.messages.create(model=coder, max_tokens=120, messages=ASK,  # type: ignore[arg-type]
                               extra_body={"temperature": 0,
                                           "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}})
    assert r.stop_reason == "end_turn"
    answer = json.loads(r.content[0].text)
    jsonschema.validate(answer, SCHEMA)
    assert answer["city"] == "Paris"
