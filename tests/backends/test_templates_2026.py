"""The chat templates of 2026's families render and parse (issue 36): Qwen3.5 (XML tool calls, enable_thinking),
Gemma 4 (``<|channel>thought`` thinking, ``<|tool_call>call:NAME{…}`` tool calls) and gpt-oss (harmony channels,
reasoning levels), each with the template itself in a small made model (the default GGUF with the template in its
metadata), rendered by the llama.cpp backend, and outputs written from each family's documentation fed through
the request pipeline (``backends/core/stream.py``: thinking split, tool calls held and parsed) token by token in the
model's own tokens (streamed) and whole (``split_text`` + ``parse_tool_calls``, as a stored answer is read).

The templates (``tests/templates/``) are copied verbatim from public sources:

* ``qwen3.5.jinja``: Qwen/Qwen3.5-35B-A3B's ``chat_template.jinja``, as vendored by a serving framework's
  tokenizer fallback (``_QWEN35_DEFAULT_CHAT_TEMPLATE``); its tool format matches Qwen3.5-2B's
  ``tokenizer_config.json`` as quoted elsewhere.
* ``gemma4.jinja``: llama.cpp's ``models/templates/gemma4.jinja`` (ggml-org/llama.cpp, 12,133 characters).
* ``gpt-oss.jinja``: llama.cpp's ``models/templates/openai-gpt-oss-120b.jinja`` (16,717 characters).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from backends.core._stops import parse_tool_calls
from backends.core.thinking import render_kwargs, split_text, thinking_style
from tests.fixtures_thinking import write_thinking_model

TEMPLATES = Path(__file__).resolve().parents[1] / "templates"
FAMILIES = ("qwen3.5", "gemma4", "gpt-oss")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather forecast for a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "The city."},
        "days": {"type": "integer", "description": "How many days."}}}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = ASK + [
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "18 C, sunny"},
]
CALL = [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]

# Outputs written from each family's documentation: (think, generated text, thinking, content, tool calls).
# The end-of-generation token (<|im_end|>, <turn|>, <|call|>/<|return|>) is not text: the stream ends before it.
RECORDED: dict[str, list[tuple[Any, str, str, str, list[dict[str, Any]]]]] = {
    "qwen3.5": [
        # thinking on: the template opened "<think>\n"; the model closes it and calls the tool in XML
        (True, "The user wants the forecast for Paris, so I call get_weather.\n</think>\n\n<tool_call>\n"
               "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
               "</function>\n</tool_call>",
         "The user wants the forecast for Paris, so I call get_weather.", "", CALL),
        (True, "A plain fact.\n</think>\n\nParis is the capital of France.", "A plain fact.",
         "Paris is the capital of France.", []),
        # a call before any </think> ends the thought (llama.cpp's Qwen3.5 parser: <tool_call> is a thinking end)
        (True, "I need the forecast.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
               "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", "I need the forecast.", "", CALL),
        # thinking off: the template closed an empty thought; the answer is all content
        (False, "Paris is the capital of France.", "", "Paris is the capital of France.", []),
        (False, "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
                "</parameter>\n</function>\n</tool_call>", "", "", CALL),
        # the template allows reasoning in plain words before the call ("BEFORE the function call, but NOT after")
        (False, "I will look it up.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", "", "I will look it up.", CALL),
    ],
    "gemma4": [
        (True, '<|channel>thought\nThe user asks for the weather: call the tool.<channel|><|tool_call>call:get_weather'
               '{city:<|"|>Paris<|"|>,days:3}<tool_call|>',
         "The user asks for the weather: call the tool.", "", CALL),
        (True, "<|channel>thought\nA plain fact.<channel|>Paris is the capital of France.", "A plain fact.",
         "Paris is the capital of France.", []),
        (False, "Paris is the capital of France.", "", "Paris is the capital of France.", []),
        (False, '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>', "", "", CALL),
    ],
    "gpt-oss": [
        ("high", "<|channel|>analysis<|message|>Need the forecast: call get_weather.<|end|><|start|>assistant"
                 "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                 '{"city":"Paris","days":3}',
         "Need the forecast: call get_weather.", "", CALL),
        ("low", "<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final<|message|>"
                "Paris is the capital of France.", "Simple.", "Paris is the capital of France.", []),
    ],
}


def template(family: str) -> str:
    return (TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8")


@pytest.fixture
def family_model(default_model_path, backend_factory):
    """``family -> (backend, style)``: the default model with that family's template (loaded once a session:
    the backend factory keeps it)."""
    loaded: dict[str, Any] = {}

    def get(family: str):
        if family not in loaded:
            path = write_thinking_model(Path(default_model_path), template=template(family))
            b = backend_factory("llamacpp", model_path=str(path))
            loaded[family] = (b, thinking_style(b.info.chat_template, b.info.architecture))
        return loaded[family]

    return get


def render(b, messages, think, tools=TOOLS, style=None) -> str:
    return b.call(lambda s: s.render(messages, tools=tools, template_kwargs=render_kwargs(style, think)))


def test_the_templates_are_the_published_ones():
    assert len(template("gemma4")) == 12133 and len(template("gpt-oss")) == 16717
    q = template("qwen3.5")
    assert "<parameter=example_parameter_1>" in q and "enable_thinking is defined and enable_thinking is false" in q


def test_each_family_s_thinking_style():
    qwen, gemma, oss = (thinking_style(template(f)) for f in FAMILIES)
    assert (qwen.name, qwen.open_tag, qwen.enable_thinking, qwen.levels) == ("qwen3", "<think>", True, ())
    assert qwen.ends_at == ("<tool_call>",) and gemma.ends_at == () and oss.ends_at == ()
    assert (gemma.name, gemma.open_tag, gemma.close_tag, gemma.label, gemma.enable_thinking) == (
        "gemma4", "<|channel>", "<channel|>", "thought", True)
    assert oss.harmony and oss.levels == ("low", "medium", "high") and not oss.can_disable


def test_qwen35_renders_thinking_and_its_xml_tools(family_model):
    b, style = family_model("qwen3.5")
    on, off = render(b, ASK, True, style=style), render(b, ASK, False, style=style)
    assert on.endswith("<|im_start|>assistant\n<think>\n")
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in on
    assert "<function=example_function_name>" in on  # the XML format the template teaches
    past = render(b, HISTORY, True, style=style)
    assert "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>" \
        in past
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in past


def test_gemma4_renders_thinking_and_its_tool_declarations(family_model):
    b, style = family_model("gemma4")
    on, off = render(b, ASK, True, style=style), render(b, ASK, False, style=style)
    assert "<|turn>system\n<|think|><|tool>declaration:get_weather{description:<|\"|>Get the weather" in on
    assert on.endswith("<|turn>user\nWhat is the weather in Paris?<turn|>\n<|turn>model\n")
    assert "<|think|>" not in off and off.endswith("<|turn>model\n<|channel>thought\n<channel|>")
    past = render(b, HISTORY, False, style=style)
    assert '<|turn>model\n<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>' in past


@pytest.mark.parametrize("level", ["low", "medium", "high"])
def test_gpt_oss_renders_each_reasoning_level_and_its_tools(family_model, level):
    b, style = family_model("gpt-oss")
    p = render(b, ASK, level, style=style)
    assert f"Reasoning: {level}\n\n" in p and p.endswith("<|start|>user<|message|>What is the weather in Paris?"
                                                         "<|end|><|start|>assistant")
    assert "namespace functions {\n\n// Get the weather forecast for a city.\ntype get_weather = (_: {" in p
    if level == "medium":
        past = render(b, HISTORY, level, style=style)
        assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
                "<|call|>") in past
        assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"18 C, sunny"<|end|>' \
            in past


def _through_the_stream(b, think, text: str) -> tuple[str, str, list[dict[str, Any]], int]:
    """The prompt rendered by the real source, then ``text`` in the model's own tokens, one push each."""
    from backends.contract.events import TextChunk, ToolCalls
    from backends.contract.specs import GenerateRequest, Sampling
    from backends.core.stream import RequestStream

    def run(s) -> tuple[str, str, list[dict[str, Any]], int]:
        rs = RequestStream(GenerateRequest(messages=ASK, tools=TOOLS, think=think,
                                           sampling=Sampling(temperature=0.0)))
        rs.prepare(s)
        toks = s.tokenize(text)
        assert b"".join(s.piece(t) for t in toks).decode() == text  # the tokens give the text back
        events = [e for t in toks for e in rs.push(t)] + rs.close()
        chunks = [e for e in events if isinstance(e, TextChunk)]
        calls = [c for e in events if isinstance(e, ToolCalls) for c in e.calls]
        return ("".join(c.text for c in chunks if c.thinking), "".join(c.text for c in chunks if not c.thinking),
                calls, len(chunks))

    return b.call(run)


@pytest.mark.parametrize(("family", "i"), [(f, i) for f in FAMILIES for i in range(len(RECORDED[f]))])
def test_recorded_outputs_split_and_parse_streamed_and_whole(family_model, family, i):
    b, style = family_model(family)
    think, text, thinking, content, calls = RECORDED[family][i]
    got_thinking, got_content, got_calls, n_chunks = _through_the_stream(b, think, text)
    assert (got_thinking.strip(), got_content.strip(), got_calls) == (thinking, content, calls)
    if thinking or content:
        assert n_chunks > 1  # streamed in pieces, not only at the end
    # whole: the same answer read at once (a stored answer, a non-streamed reply)
    prompt = render(b, ASK, think, style=style)
    started = bool(render_kwargs(style, think).get("enable_thinking")) and prompt.rstrip().endswith(style.open_tag)
    whole = split_text(style if (think is not False or style.harmony) else None, text, started_in_thinking=started)
    w_calls = [json.loads(c) for c in whole[2]] if style.harmony else (parse_tool_calls(whole[1], TOOLS) or [])
    w_content = whole[1]
    if w_calls and not style.harmony:  # the text before the call is the content
        w_content = w_content.split("<tool_call>")[0].split("<|tool_call>")[0]
    assert (whole[0].strip(), w_content.strip(), w_calls) == (thinking, content, calls)


def test_a_qwen35_string_parameter_stays_text_and_values_keep_their_lines():
    text = ("<tool_call>\n<function=run>\n<parameter=zip>\n01234\n</parameter>\n<parameter=code>\nprint(1)\n"
            "print(2)\n</parameter>\n</function>\n</tool_call>")
    tools = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {
        "zip": {"type": "string"}, "code": {"type": "string"}}}}}]
    want = [{"name": "run", "arguments": {"zip": "01234", "code": "print(1)\nprint(2)"}}]
    assert parse_tool_calls(text, tools) == want
    assert parse_tool_calls(text) == want  # "01234" is no JSON number: text either way
    # without a schema a value that reads as JSON is taken as JSON; with one, a string parameter stays text
    num = text.replace("01234", "75001")
    assert parse_tool_calls(num)[0]["arguments"]["zip"] == 75001
    assert parse_tool_calls(num, tools)[0]["arguments"]["zip"] == "75001"


def test_gemma4_arguments_nest_and_several_calls_follow_each_other():
    text = ('<|tool_call>call:book{who:<|"|>Ann, Bo<|"|>,n:2,opts:{late:true,tags:[<|"|>a<|"|>,<|"|>b{c}<|"|>]},'
            'note:null}<tool_call|><|tool_call>call:ping{}<tool_call|>')
    assert parse_tool_calls(text) == [
        {"name": "book", "arguments": {"who": "Ann, Bo", "n": 2, "opts": {"late": True, "tags": ["a", "b{c}"]},
                                       "note": None}},
        {"name": "ping", "arguments": {}}]
    assert parse_tool_calls('<|tool_call>call:book{who:<|"|>unterminated}<tool_call|>') is None


# SmolLM2's control tokens 3..7 renamed to Gemma 4's format markers: a vocabulary where they are special tokens,
# so the model's own token ids carry them (ids 0-2 stay <|endoftext|>, <|im_start|>, <|im_end|>). (gpt-oss's
# harmony markers need no help: llama.cpp's vocabulary loader always writes them out.)
GEMMA_MARKERS = {3: "<|channel>", 4: "<channel|>", 5: "<|tool_call>", 6: "<tool_call|>", 7: '<|"|>'}


def _with_control_markers(src: Path, dst: Path, template_text: str) -> Path:
    """``src`` with GEMMA_MARKERS as the texts of those control tokens and ``template_text`` as its template."""
    import os

    import gguf

    if dst.is_file():
        return dst
    reader = gguf.GGUFReader(src, "r")
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(tmp, arch=arch, endianess=reader.endianess)
    alignment = reader.get_field(gguf.Keys.General.ALIGNMENT)
    if alignment is not None:
        w.data_alignment = alignment.contents()
    for f in reader.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF.") \
                or f.name.startswith(gguf.Keys.Tokenizer.CHAT_TEMPLATE):
            continue
        value = f.contents()
        if f.name == gguf.Keys.Tokenizer.LIST:
            types = reader.get_field(gguf.Keys.Tokenizer.TOKEN_TYPE).contents()
            assert all(types[i] == gguf.TokenType.CONTROL for i in GEMMA_MARKERS)
            value = [GEMMA_MARKERS.get(i, t) for i, t in enumerate(value)]
        vtype = f.types[0]
        w.add_key_value(f.name, value, vtype, sub_type=f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    w.add_chat_template(template_text)
    for t in reader.tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in reader.tensors:
        w.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    w.close()
    os.replace(tmp, dst)
    return dst


def test_format_markers_that_are_control_tokens_reach_the_parser(default_model_path, backend_factory, tmp_path):
    """Gemma 4's <|channel>, <|tool_call> ... are special tokens of its vocabulary, which llama.cpp writes as
    nothing unless asked: the backend writes out the ones a chat format needs (llama.cpp's server keeps the same
    "preserved tokens"), so an answer in the model's own token ids still splits into thinking and tool calls."""
    path = _with_control_markers(Path(default_model_path), tmp_path / "smol-gemma4.gguf", template("gemma4"))
    b = backend_factory("llamacpp", fresh=True, model_path=str(path))
    think, text, thinking, content, calls = RECORDED["gemma4"][0]
    ids = b.call(lambda s: s.tokenize(text, special=True))
    assert set(GEMMA_MARKERS) <= set(ids)  # the markers are single special tokens here
    assert b.call(lambda s: [s.piece(i).decode() for i in sorted(GEMMA_MARKERS)]) == list(GEMMA_MARKERS.values())
    assert b.call(lambda s: s.piece(2)) == b""  # other control tokens stay hidden (<|im_end|>)

    from backends.contract.events import TextChunk, ToolCalls
    from backends.contract.specs import GenerateRequest, Sampling
    from backends.core.stream import RequestStream

    def run(s):
        rs = RequestStream(GenerateRequest(messages=ASK, tools=TOOLS, think=think, sampling=Sampling()))
        rs.prepare(s)
        return [e for t in ids for e in rs.push(t)] + rs.close()

    events = b.call(run)
    got_thinking = "".join(e.text for e in events if isinstance(e, TextChunk) and e.thinking)
    got_content = "".join(e.text for e in events if isinstance(e, TextChunk) and not e.thinking)
    got_calls = [c for e in events if isinstance(e, ToolCalls) for c in e.calls]
    assert (got_thinking.strip(), got_content, got_calls) == (thinking, content, calls)


def test_gemma4_takes_tool_results_inside_the_model_turn(family_model):
    """OpenAI-shaped history (assistant tool_calls, then role "tool") is reshaped for Gemma 4's template, which
    takes the results as the calling message's ``tool_responses``: the call and its response stay in one model
    turn, and the generation prompt continues that turn (no new "<|turn>model")."""
    from backends.contract.specs import GenerateRequest, Sampling
    from backends.core.stream import RequestStream

    b, _ = family_model("gemma4")

    def prompt(s, messages):
        rs = RequestStream(GenerateRequest(messages=messages, tools=TOOLS, think=False, sampling=Sampling()))
        return s.detokenize(rs.prepare(s))

    p = b.call(lambda s: prompt(s, HISTORY))
    assert p.endswith('<|turn>model\n<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
                      '<|tool_response>response:get_weather{value:<|"|>18 C, sunny<|"|>}<tool_response|>'
                      "<|channel>thought\n<channel|>")
    assert "<|turn>tool" not in p
    answered = HISTORY + [{"role": "assistant", "content": "It is 18 C and sunny."}]
    p = b.call(lambda s: prompt(s, answered + [{"role": "user", "content": "Thanks!"}]))
    assert '<tool_response|>It is 18 C and sunny.<turn|>\n<|turn>user\nThanks!<turn|>\n<|turn>model\n' in p
    # other templates get the messages as they are
    qb, _ = family_model("qwen3.5")
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in qb.call(lambda s: prompt(s, HISTORY))


@pytest.mark.parametrize(("text", "content"), [
    # LFM2: Python-style calls between its markers (its model card's format), after a few words
    ('Checking.<|tool_call_start|>[get_weather(city="Paris", days=3)]<|tool_call_end|>', "Checking."),
    # the JSON form llama.cpp's LFM2 template writes into histories
    ('<|tool_call_start|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]<|tool_call_end|>', ""),
    # Ministral 3 / Mistral: [TOOL_CALLS]NAME[ARGS]{json}
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}', ""),
])
def test_lfm2_and_ministral3_tool_calls_through_the_stream(family_model, text, content):
    """Granite 4 writes Hermes' <tool_call>{json}</tool_call> (parsed since Qwen 2.5); LFM2 and Ministral 3 have
    their own forms. Parsing does not depend on the template: a tools-capable one (Qwen3.5's, thinking off)
    carries the request here."""
    b, _ = family_model("qwen3.5")
    got_thinking, got_content, got_calls, _ = _through_the_stream(b, False, text)
    assert (got_thinking, got_content.strip(), got_calls) == ("", content, CALL)
    assert parse_tool_calls(text) == CALL


def test_python_style_calls_are_read_never_run():
    assert parse_tool_calls('<|tool_call_start|>[__import__("os").system("ls")]<|tool_call_end|>') is None
    assert parse_tool_calls('<|tool_call_start|>[f(x=true, y=[1, -2], z={"a": null})]<|tool_call_end|>') == [
        {"name": "f", "arguments": {"x": True, "y": [1, -2], "z": {"a": None}}}]
