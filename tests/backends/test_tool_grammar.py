"""The lazy tool-call grammar's pieces that need no model: the trigger patterns fire on the starts of calls in the
shapes small models write (and on nothing in plain answers), their replay is only a call's head, and the stream
parses every shape the grammar lets through -- after words, fenced, several, in ``<tools>``, the envelope."""

from __future__ import annotations

import re

import pytest

from backends.core import tool_grammar
from backends.core._stops import parse_tool_calls
from backends.llamacpp.sampling import grammar_for

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "fs.write", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def grammar():
    g = tool_grammar.build(TOOLS, grammar_for)
    assert g is not None
    return g


def _fires(g, text: str) -> str | None:
    """What would be replayed into the grammar after ``text`` (llama.cpp: the first capture group on), or None."""
    for pat in g.triggers:
        m = re.search(pat, text)
        if m:
            return text[next((m.start(i) for i in range(1, (m.lastindex or 0) + 1) if m.group(i)), m.start()):]
    return None


@pytest.mark.parametrize(("text", "replay"), [
    ("<tool_call>", "<tool_call>"),
    ("<tool_call>\n{\"na", "<tool_call>\n{\"na"),
    ("<tools>\n{", "<tools>\n{"),
    ("{", "{"),
    ("  {\"", "{\""),
    ("Sure:\n```json\n{", "{"),
    ('I will call it: {"name": "get_w', '{"name": "get_w'),
    ('{"name":"fs.wr', '{"name":"fs.wr'),
    ('[{"name": ', '[{"name": '),
    ('x {"type": "function", "fun', '{"type": "function", "fun'),
])
def test_triggers_fire_at_a_calls_start_with_only_its_head(grammar, text, replay):
    assert _fires(grammar, text) == replay


@pytest.mark.parametrize("text", [
    "The weather is fine.", "def f(x):\n    return {x: 1}", 'Use {"name": "other_tool"', '{"name": "get_weather", ',
    "```python\n{", '{"type": "object"', "a { b",
])
def test_plain_text_and_replays_the_grammar_would_refuse_do_not_fire(grammar, text):
    assert _fires(grammar, text) is None


def test_unsafe_tool_names_or_no_tools_give_no_grammar():
    assert tool_grammar.build([], grammar_for) is None
    assert tool_grammar.build([{"type": "function", "function": {"name": "a b|c"}}], grammar_for) is None


@pytest.mark.parametrize(("text", "names"), [
    ('```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```', ["get_weather"]),
    ('{"name": "get_weather", "arguments": {"city": "A"}}\n```\n```json\n{"name": "get_weather", "arguments": '
     '{"city": "B"}}\n```', ["get_weather", "get_weather"]),
    ('<tools>\n{"type": "function", "function": {"name": "fs.write", "parameters": {"path": "x"}}}\n</tools>',
     ["fs.write"]),
    ('[{"name": "get_weather", "arguments": {"city": "A"}}, {"name": "fs.write", "arguments": {}}]',
     ["get_weather", "fs.write"]),
])
def test_every_shape_the_grammar_allows_is_parsed(text, names):
    calls = parse_tool_calls(text)
    assert calls is not None and [c["name"] for c in calls] == names


def test_a_template_with_xml_calls_in_its_tags_is_not_forced_into_json():
    """Qwen3.5 / Qwen3-Coder write ``<tool_call>\\n<function=NAME>``: their tag must not start the JSON grammar."""
    g = tool_grammar.build(TOOLS, grammar_for, json_tags=False)
    assert g is not None and _fires(g, "<tool_call>\n<function=get_weather>") is None
    assert _fires(g, "<tool_call>") is None and _fires(g, '{"name": "get_') == '{"name": "get_'
