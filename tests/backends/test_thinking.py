"""backends/core/thinking.py: which templates think, how think is rendered, and splitting a stream into thinking,
content and (harmony) tool calls, wherever the text is cut. The last tests run the real default model with
Qwen3's template (tests/fixtures_thinking.py) through llama.cpp."""

from __future__ import annotations

import doctest
import json

import jinja2
import jinja2.sandbox
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import backends.core.thinking as th
from backends.core.thinking import (
    HARMONY,
    ThinkSplitter,
    ThinkStyle,
    parse_think,
    prompt_in_thought,
    prompt_suffix,
    render_kwargs,
    split_text,
    splitter_for,
    think_level,
    think_on,
    thinking_style,
)
from tests import fixtures_thinking
from tests.fixtures_thinking import QWEN3_CHAT_TEMPLATE, THINK_GBNF

thinking_model_path = fixtures_thinking.thinking_model_path  # the fixture, used in this module

# DeepSeek-R1-Distill's template (tokenizer_config.json, the February 2025 revision that opens <think>\n in the
# prompt; the January one ends with '<｜Assistant｜>' alone), tool branches left out
R1_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='') %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{% set ns.system_prompt = message['content'] %}{%- endif %}{%- endfor %}{{bos_token}}{{ns.system_prompt}}"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}{{'<｜User｜>' + message['content']}}"
    "{%- endif %}{%- if message['role'] == 'assistant' and message['content'] is not none %}"
    "{% set content = message['content'] %}{% if '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor -%}"
    "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\\n'}}{% endif %}"
)
R1_TEMPLATE_JANUARY = R1_TEMPLATE.replace("{{'<｜Assistant｜><think>\\n'}}", "{{'<｜Assistant｜>'}}")

# gpt-oss (harmony): the parts of the official template that matter here
HARMONY_TEMPLATE = (
    '{{- "<|start|>system<|message|>" }}{%- if reasoning_effort is not defined %}'
    '{%- set reasoning_effort = "medium" %}{%- endif %}{{- "Reasoning: " + reasoning_effort + "\\n\\n" }}'
    '{{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." }}'
    '{{- "<|end|>" }}{%- for message in messages %}{%- if message.role == "user" %}'
    '{{- "<|start|>user<|message|>" + message.content + "<|end|>" }}{%- elif message.role == "assistant" %}'
    '{{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}{%- endif %}'
    '{%- endfor %}{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}'
)
CHATML = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' "
          "+ m['content'] + '<|eot_id|>' }}{% endfor %}")

QWEN3 = thinking_style(QWEN3_CHAT_TEMPLATE)
R1 = thinking_style(R1_TEMPLATE)
USER = [{"role": "user", "content": "What is 2+2?"}]


def render(template: str, messages=USER, **kwargs) -> str:
    """The template rendered as llama-cpp-python's Jinja2ChatFormatter does (sandbox, trim/lstrip blocks)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=["jinja2.ext.loopcontrols"])
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, bos_token="<s>",
                                            eos_token="</s>", **kwargs)


def run(splitter: ThinkSplitter, chunks: list[str]) -> list[tuple[str, str]]:
    """All pieces of one stream, adjacent ones of a kind merged (how a client would concatenate them)."""
    out: list[tuple[str, str]] = []
    for piece in [p for c in chunks for p in splitter.push(c)] + splitter.flush():
        assert piece[1], "no empty pieces"
        if out and out[-1][0] == piece[0] and piece[0] != "tool":
            out[-1] = (piece[0], out[-1][1] + piece[1])
        else:
            out.append(piece)
    return out


def cut(text: str, points: list[int]) -> list[str]:
    bounds = [0, *sorted({p % (len(text) + 1) for p in points}), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def test_module_doctests():
    assert doctest.testmod(th).failed == 0


# ------------------------------------------------------------------------------------------ detection


def test_detects_qwen3_r1_and_harmony():
    assert QWEN3 == ThinkStyle("qwen3", "<think>", "</think>", enable_thinking=True, prefill=False)
    assert R1 == ThinkStyle("deepseek-r1", "<think>", "</think>", prefill=True)
    jan = thinking_style(R1_TEMPLATE_JANUARY)  # only content.split('</think>'): still a thinking template
    assert (jan.name, jan.open_tag, jan.close_tag, jan.prefill) == ("deepseek-r1", "<think>", "</think>", False)
    h = thinking_style(HARMONY_TEMPLATE)
    assert h is HARMONY and h.harmony and h.levels == ("low", "medium", "high") and not h.can_disable
    assert thinking_style(CHATML, "gpt-oss") is HARMONY  # the architecture alone says harmony
    assert thinking_style(None, "gpt-oss") is HARMONY


@pytest.mark.parametrize("template", [None, "", CHATML, LLAMA3, "{{ '<think>' }} only the opening tag"])
def test_templates_that_do_not_think(template):
    assert thinking_style(template) is None
    assert thinking_style(template, "llama") is None


def test_other_tag_pairs_and_thinking_2507_prefill():
    cmd = thinking_style("{{ '<|START_THINKING|>' }}{{ m.thinking }}{{ '<|END_THINKING|>' }}")
    assert (cmd.name, cmd.open_tag, cmd.close_tag) == ("tags", "<|START_THINKING|>", "<|END_THINKING|>")
    # Qwen3 Thinking-2507: the template opens <think> itself
    t2507 = QWEN3_CHAT_TEMPLATE.split("{%- if add_generation_prompt %}")[0] + \
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
    s = thinking_style(t2507)
    assert s.prefill and not s.enable_thinking and s.name == "tags"
    assert prompt_in_thought(s, render(t2507))


# ------------------------------------------------------------------------------------------ think values


def test_parse_think_follows_ollama():
    for v in (None, True, False, "low", "medium", "high", "max"):
        assert parse_think(v) == v
    for bad in ("x", "LOW", "true", 1, 0.5, [], {}):
        with pytest.raises(ValueError, match=r'^invalid think value: .* \(must be "high", "medium", "low", "max", '
                                             r"true, or false\)$"):
            parse_think(bad)


THINKS = [None, True, False, "low", "medium", "high", "max"]


@pytest.mark.parametrize("think", THINKS)
def test_qwen3_render_kwargs_and_the_real_template(think):
    on = think is not False
    assert think_on(QWEN3, think) is on
    assert render_kwargs(QWEN3, think) == {"enable_thinking": on}  # levels mean "on" for a binary switch
    prompt = render(QWEN3_CHAT_TEMPLATE, **render_kwargs(QWEN3, think))
    if on:
        assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    else:
        assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert prompt_suffix(QWEN3, think, prompt) == ""  # the template did it
    assert not prompt_in_thought(QWEN3, prompt)
    # a caller that cannot pass template kwargs gets the same prompt from the suffix
    bare = render(QWEN3_CHAT_TEMPLATE)
    assert bare + prompt_suffix(QWEN3, think, bare) == prompt


@pytest.mark.parametrize("template", [R1_TEMPLATE, R1_TEMPLATE_JANUARY])
@pytest.mark.parametrize("think", THINKS)
def test_r1_prompt_suffix(template, think):
    style = thinking_style(template)
    assert render_kwargs(style, think) == {}  # the template takes nothing
    prompt = render(template, **render_kwargs(style, think))
    final = prompt + prompt_suffix(style, think, prompt)
    if think is False:
        assert final.endswith("<｜Assistant｜><think>\n\n</think>\n\n")
        assert not prompt_in_thought(style, final)
    else:  # on (levels too: R1 has no levels): the prompt opens the thought, the splitter starts inside it
        assert final.endswith("<｜Assistant｜><think>\n")
        assert prompt_in_thought(style, final)
    assert prompt_suffix(style, think, final) == ""  # idempotent


@pytest.mark.parametrize(("think", "level"), [(None, "medium"), (True, "medium"), (False, "low"), ("low", "low"),
                                              ("medium", "medium"), ("high", "high"), ("max", "high")])
def test_harmony_levels(think, level):
    assert think_level(HARMONY, think) == level
    assert render_kwargs(HARMONY, think) == {"reasoning_effort": level}
    prompt = render(HARMONY_TEMPLATE, **render_kwargs(HARMONY, think))
    assert f"Reasoning: {level}\n\n" in prompt and prompt.endswith("<|start|>assistant")
    assert prompt_suffix(HARMONY, think, prompt) == ""


def test_non_thinking_model_gets_nothing():
    for think in THINKS:
        assert render_kwargs(None, think) == {} and prompt_suffix(None, think, "x") == ""
        assert think_on(None, think) is False and think_level(None, think) is None
        assert think_level(QWEN3, think) is None


# ------------------------------------------------------------------------------------------ tag splitting


@pytest.mark.parametrize(("chunks", "started", "expect"), [
    (["<think>\nHmm.\n</think>\n\nIt is 4."], False, [("thinking", "Hmm.\n"), ("content", "It is 4.")]),
    (["  \n <think>", "   ", "\n", "a", "</think>", "\n\n", "\n", "b"], False, [("thinking", "a"), ("content", "b")]),
    (["Hello <think>x</think>"], False, [("content", "Hello <think>x</think>")]),  # not first: content
    (["\n\nHello"], False, [("content", "\n\nHello")]),  # Ollama keeps the content's whitespace
    (["<thi"], False, [("content", "<thi")]),  # a partial opening tag that never completes
    (["<think>", "still thinking </thi"], False, [("thinking", "still thinking </thi")]),  # no close: all thinking
    (["a</think>b"], True, [("thinking", "a"), ("content", "b")]),  # the prompt opened the thought
    (["\n<think>\nplan</think>ans"], True, [("thinking", "plan"), ("content", "ans")]),  # repeated tag: once
    (["<think>\n<think>x</think>y"], False, [("thinking", "x"), ("content", "y")]),
    (["<think><think>\n<think>x</think>y"], False, [("thinking", "<think>x"), ("content", "y")]),  # only once
    (["<think></think>", "\n\n", "ans"], False, [("content", "ans")]),  # an empty thought gives no piece
    (["<think>a</think>b<think>c</think>"], False, [("thinking", "a"), ("content", "b<think>c</think>")]),
    (["<think><b>bold</b></think>x"], False, [("thinking", "<b>bold</b>"), ("content", "x")]),
    (["   "], False, []),
    ([], False, []),
])
def test_tag_splitting(chunks, started, expect):
    assert run(ThinkSplitter(QWEN3, started), chunks) == expect


def test_partial_tags_never_leak_while_streaming():
    s = ThinkSplitter(QWEN3)
    assert s.push("<") == [] and s.push("think") == [] and s.push(">") == []
    assert s.push("\nfirst") == [("thinking", "first")]
    assert s.push(" </") == [("thinking", " ")]  # "</" is held: it may begin </think>
    assert s.push("b> ok <") == [("thinking", "</b> ok ")]
    assert s.push("/think") == []
    assert s.push(">\n\nDone") == [("content", "Done")]
    assert s.flush() == [] and s.flush() == []


def test_passthrough_without_a_style():
    s = ThinkSplitter(None)
    assert s.push("<think>x</think>") == [("content", "<think>x</think>")]
    assert s.flush() == []


# text built from the tags, pieces of them and ordinary characters: the strings where splitting can go wrong
TAG_TEXT = st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "<th", "ink>", "think", ">", "/", " ", "\n",
                                     "a", "b", "é", "</thinker>", "<thin"]), max_size=14).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=TAG_TEXT, points=st.lists(st.integers(min_value=0, max_value=200), max_size=8),
       started=st.booleans())
@example(text="<think>a</think>b", points=[3, 9], started=False)
def test_tag_splitting_does_not_depend_on_where_the_text_is_cut(text, points, started):
    whole = run(ThinkSplitter(QWEN3, started), [text])
    assert run(ThinkSplitter(QWEN3, started), cut(text, points)) == whole
    assert run(ThinkSplitter(QWEN3, started), list(text)) == whole  # one character at a time
    kinds = [k for k, _ in whole]
    assert kinds in ([], ["thinking"], ["content"], ["thinking", "content"])  # thinking first, once
    rest = iter(text)
    assert all(c in rest for c in "".join(t for _, t in whole))  # nothing invented: a subsequence of the text


@pytest.mark.parametrize("text", [
    "<think>\nLet me see: 2+2 is 4.\n</think>\n\nThe answer is 4.",
    "\n<think></think>\n\nx",
    "<think>\n<think>\nrepeat</think>a</b>",
])
@pytest.mark.parametrize("started", [False, True])
def test_tag_splitting_at_every_point(text, started):
    whole = run(ThinkSplitter(QWEN3, started), [text])
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert run(ThinkSplitter(QWEN3, started), [text[:i], text[i:j], text[j:]]) == whole, (i, j)


# ------------------------------------------------------------------------------------------ harmony

GPT_OSS = ("<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|>"
           "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>")
GPT_OSS_TOOL = ("<|channel|>analysis<|message|>Need the weather.<|end|>"
                "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                '{"city": "Paris", "unit": "c"}<|call|>')


@pytest.mark.parametrize(("text", "started", "expect"), [
    (GPT_OSS, False, [("thinking", "User asks 2+2. Easy."), ("content", "2 + 2 = 4.")]),
    (GPT_OSS_TOOL, False, [("thinking", "Need the weather."),
                           ("tool", '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}')]),
    # the recipient before the channel, and the model restating <|start|>assistant itself
    ('<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"a":1}<|call|>', False,
     [("tool", '{"name": "f", "arguments": {"a": 1}}')]),
    # two calls, a built-in recipient kept as it is, arguments that are not JSON kept raw
    ('<|channel|>commentary to=functions.a<|message|>{}<|end|><|start|>assistant to=browser.search'
     '<|channel|>analysis<|message|>not json<|call|>', False,
     [("tool", '{"name": "a", "arguments": {}}'), ("tool", '{"name": "browser.search", "arguments": "not json"}')]),
    ("We think.<|end|><|start|>assistant<|channel|>final<|message|>Hi", True,
     [("thinking", "We think."), ("content", "Hi")]),  # the prompt opened the analysis message
    ("<|channel|>commentary<|message|>Calling now.<|end|>", False, [("content", "Calling now.")]),
    ("<|channel|>final<|message|>Hi<|end|> stray text <|sta", False, [("content", "Hi")]),  # between messages
    ("<|channel|>analysis<|message|>cut off mid <|en", False, [("thinking", "cut off mid <|en")]),
    ("Just text, no harmony at all.", False, [("content", "Just text, no harmony at all.")]),
    ("", False, []),
])
def test_harmony_splitting(text, started, expect):
    assert run(ThinkSplitter(HARMONY, started), [text]) == expect
    assert run(ThinkSplitter(HARMONY, started), list(text)) == expect


def test_harmony_streams_and_keeps_tools_for_the_end():
    s = ThinkSplitter(HARMONY)
    assert s.push("<|channel|>analysis<|message|>Need") == [("thinking", "Need")]
    assert s.push(" weather.<|e") == [("thinking", " weather.")]
    assert s.push("nd|><|start|>assistant to=functions.get_weather<|channel|>commentary<|message|>{\"c") == []
    assert s.push('ity": "Oslo"}<|call|>') == []
    (kind, text), = s.flush()
    assert kind == "tool" and json.loads(text) == {"name": "get_weather", "arguments": {"city": "Oslo"}}


def test_text_that_is_not_harmony_streams_as_content():
    s = ThinkSplitter(HARMONY)
    long = "plain words " * 60
    out = s.push(long)
    assert out == [("content", long)] and s.push("more") == [("content", "more")] and s.flush() == []


HARMONY_TEXT = st.lists(st.sampled_from([
    "<|start|>", "assistant", "<|channel|>", "analysis", "final", "commentary", "<|message|>", "<|end|>",
    "<|return|>", "<|call|>", " to=functions.f", "<|constrain|>json", "<|", "|>", "<|en", "{\"a\": 1}", "x", " ",
]), max_size=16).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=HARMONY_TEXT, points=st.lists(st.integers(min_value=0, max_value=300), max_size=8),
       started=st.booleans())
@example(text=GPT_OSS_TOOL, points=[5, 40, 90, 120], started=False)
def test_harmony_splitting_does_not_depend_on_where_the_text_is_cut(text, points, started):
    whole = run(ThinkSplitter(HARMONY, started), [text])
    assert run(ThinkSplitter(HARMONY, started), cut(text, points)) == whole
    assert run(ThinkSplitter(HARMONY, started), list(text)) == whole
    for kind, piece in whole:  # a thought or a call ends at its end tag, which is never part of it
        body = json.dumps(json.loads(piece)["arguments"]) if kind == "tool" else piece
        assert kind == "content" or not any(tag in body for tag in ("<|end|>", "<|return|>", "<|call|>")), whole


# ------------------------------------------------------------------------------------------ per request


def test_splitter_for_a_request():
    # think off on a tag template: no splitting, a <think> the model writes anyway stays in the content
    assert run(splitter_for(QWEN3, False, "…<think>\n\n</think>\n\n"), ["<think>x</think>y"]) == \
        [("content", "<think>x</think>y")]
    assert run(splitter_for(QWEN3, None, "<|im_start|>assistant\n"), ["<think>x</think>y"]) == \
        [("thinking", "x"), ("content", "y")]
    assert run(splitter_for(R1, "high", "<｜Assistant｜><think>\n"), ["x</think>y"]) == \
        [("thinking", "x"), ("content", "y")]
    # harmony is parsed whatever think says: its trace cannot be turned off
    assert run(splitter_for(HARMONY, False, "<|start|>assistant"), [GPT_OSS])[0] == ("thinking", "User asks 2+2. Easy.")
    assert run(splitter_for(None, True, ""), ["<think>x</think>"]) == [("content", "<think>x</think>")]


def test_split_text():
    assert split_text(QWEN3, "<think>\nA\n</think>\n\nB") == ("A\n", "B", [])
    thinking, content, tools = split_text(HARMONY, GPT_OSS_TOOL)
    assert (thinking, content) == ("Need the weather.", "") and json.loads(tools[0])["name"] == "get_weather"


# ------------------------------------------------------------------------------------------ the real model


def test_thinking_model_fixture_is_the_default_model_with_qwen3s_template(thinking_model_path, default_model_path):
    import gguf

    new, old = gguf.GGUFReader(thinking_model_path), gguf.GGUFReader(default_model_path)
    assert new.get_field("tokenizer.chat_template").contents() == QWEN3_CHAT_TEMPLATE
    keys = {f.name for f in new.fields.values()}
    assert keys == {f.name for f in old.fields.values()}
    assert [t.name for t in new.tensors] == [t.name for t in old.tensors]
    assert all((a.data == b.data).all() for a, b in zip(new.tensors, old.tensors, strict=True))


def test_llamacpp_renders_the_thinking_model_and_it_thinks(thinking_model_path, backend_factory):
    """The llama.cpp backend sees a Qwen3-style template; rendered with enable_thinking on/off it gives
    Qwen3's two prompts; under THINK_GBNF the real model writes a thought, and the stream, cut into the
    model's own tokens, splits into thinking and content — as TextChunk(thinking=True) events."""
    from backends.contract.events import TextChunk
    from backends.contract.specs import GenerateRequest, Sampling, Tuning


    b = backend_factory("llamacpp", fresh=True, model_path=str(thinking_model_path), tuning=Tuning(grammar=THINK_GBNF))
    style = thinking_style(b.info.chat_template, b.info.architecture)
    assert style == QWEN3
    plain = b.call(lambda s: s.render(USER))
    on = b.call(lambda s: s.render(USER, template_kwargs=render_kwargs(style, True)))
    off = b.call(lambda s: s.render(USER, template_kwargs=render_kwargs(style, False)))
    assert plain == on and on.endswith("<|im_start|>assistant\n")
    assert off == on + "<think>\n\n</think>\n\n"

    events = list(b.generate(GenerateRequest(messages=USER, sampling=Sampling(temperature=0.0, max_tokens=120))))
    chunks = [e for e in events if isinstance(e, TextChunk)]
    thought = "".join(c.text for c in chunks if c.thinking)
    answer = "".join(c.text for c in chunks if not c.thinking)
    assert len(chunks) > 4 and thought and answer  # streamed in many pieces, split into the two kinds
    assert "<think>" not in thought + answer and "</think>" not in thought + answer
    assert answer.endswith(".") and len(answer) > 2
    assert events[-1].stats.thinking_tokens > 0
