# ruff: noqa: E501  (Qwen3's template is kept verbatim)
"""A test model that thinks: the default GGUF with Qwen3's chat template, written through the ``gguf`` package.

SmolLM2-135M does not reason, but with Qwen3's template (``enable_thinking``, ``<think>…</think>``) in its
metadata every part of the stack that reads the template sees a Qwen3-style thinking model, and
:data:`THINK_GBNF` makes it *produce* a thought before its answer (llama.cpp grammar), so the stream can be
split for real. The file is cached next to the other derived models (``$LOCALLLM_TEST_CACHE/derived``), keyed
by the source file and the template, so only the first run writes it (~1 s).

Use the fixture by importing it into a test module::

    from tests.fixtures_thinking import thinking_model_path  # noqa: F401  (a pytest fixture)

or call :func:`write_thinking_model` directly.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

TEST_CACHE = Path(os.environ.get("LOCALLLM_TEST_CACHE", "~/.cache/localllm-tests")).expanduser()

# Qwen3's chat template as published in Qwen3's tokenizer_config.json (the hybrid-thinking releases, April 2025):
# thoughts of earlier turns are dropped, and enable_thinking=False closes an empty thought in the prompt.
QWEN3_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# A llama.cpp grammar that makes any model think first: "<think>\n", 3-6 words, "\n</think>\n\n", an answer of 2-6
# words (short: every token is checked against the grammar, and six test files run it).
# (SmolLM2's vocabulary has no <think> token, so the tags arrive cut into several tokens, as they must be
# split in a real stream of a model whose tokenizer lacks them.)
THINK_GBNF = r'''
root ::= "<think>\n" thought "\n</think>\n\n" answer
thought ::= word (" " word){2,5}
answer ::= word (" " word){1,5} "."
word ::= [a-zA-Z]{1,10}
'''


def _file_key(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
    return f"{path.stat().st_size}-{h.hexdigest()[:12]}"


def copy_with_chat_template(src: Path, dst: Path, template: str) -> Path:
    """Write ``dst``: ``src`` with ``tokenizer.chat_template`` set to ``template``, every other key and every
    tensor as they were (the recipe of gguf's ``gguf_new_metadata.py``). Atomic."""
    import gguf

    reader = gguf.GGUFReader(src, "r")
    arch_field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    assert arch_field is not None, f"{src} has no general.architecture"
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + f".part{os.getpid()}")
    writer = gguf.GGUFWriter(tmp, arch=arch_field.contents(), endianess=reader.endianess)
    alignment = reader.get_field(gguf.Keys.General.ALIGNMENT)
    if alignment is not None:
        writer.data_alignment = alignment.contents()
    try:
        for f in reader.fields.values():
            # GGUFWriter writes the architecture and the GGUF.* header fields itself
            if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
                continue
            if f.name.startswith(gguf.Keys.Tokenizer.CHAT_TEMPLATE):  # the old template(s)
                continue
            vtype = f.types[0]
            sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(f.name, f.contents(), vtype, sub_type=sub)
        writer.add_chat_template(template)
        for t in reader.tensors:
            writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in reader.tensors:
            writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
        writer.close()
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    return dst


def write_thinking_model(src: Path, cache: Path | None = None, template: str = QWEN3_CHAT_TEMPLATE) -> Path:
    """``src`` with ``template`` (Qwen3's by default), cached under ``cache`` (default: the test cache's
    ``derived/``) by the source's content key and the template's hash."""
    src = Path(src)
    tkey = hashlib.sha256(template.encode()).hexdigest()[:12]
    dst = (cache or TEST_CACHE / "derived") / f"think-{_file_key(src)}-{tkey}.gguf"
    return dst if dst.is_file() else copy_with_chat_template(src, dst, template)


@pytest.fixture(scope="session")
def thinking_model_path(default_model_path: Path) -> Path:
    """The default model with Qwen3's chat template (a thinking model to every part that reads the template)."""
    return write_thinking_model(Path(default_model_path))
