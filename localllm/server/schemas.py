"""Request bodies of both APIs (pydantic). They drive validation (a wrong type is a 400) and the
OpenAPI spec at ``/openapi.json``. Unknown fields are ignored, as Ollama and OpenAI do.

Extensions beyond the upstream APIs (documented in the README):

* ``/v1/chat/completions`` and ``/v1/completions`` accept ``num_ctx`` (context size), ``options``
  (any Ollama option, e.g. ``{"num_ctx": 8192, "top_k": 20}``) and ``keep_alive``.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool

KeepAlive = str | int | float | None
Bool = StrictBool  # true or false, as JSON decoders read it: "yes" or 1 is a 400, not a guess
Format = str | dict[str, Any] | None
# checked by the handler, so that a wrong value gets Ollama's own message ("invalid think value: ...")
Think = Annotated[Any, Field(json_schema_extra={"anyOf": [
    {"type": "boolean"}, {"type": "string", "enum": ["low", "medium", "high", "max"]}, {"type": "null"}]})]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ------------------------------------------------------------------------------------------- Ollama


class ToolCallFunction(_Body):
    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)
    index: int | None = None


class ToolCall(_Body):
    id: str | None = None
    function: ToolCallFunction


class Message(_Body):
    role: str
    content: str | None = ""
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class GenerateBody(_Body):
    model: str
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    stream: Bool = True
    raw: Bool = False
    format: Format = None
    keep_alive: KeepAlive = None
    images: list[str] | None = None
    options: dict[str, Any] | None = None
    think: Think = None
    logprobs: Bool = False
    top_logprobs: int | None = None


class ChatBody(_Body):
    model: str
    messages: list[Message] | None = None
    tools: list[dict[str, Any]] | None = None
    format: Format = None
    options: dict[str, Any] | None = None
    stream: Bool = True
    keep_alive: KeepAlive = None
    think: Think = None
    logprobs: Bool = False
    top_logprobs: int | None = None


class EmbedBody(_Body):
    model: str
    input: str | list[str] = ""
    truncate: Bool = True
    dimensions: int | None = Field(default=None, ge=1)
    options: dict[str, Any] | None = None
    keep_alive: KeepAlive = None


class EmbeddingsBody(_Body):
    model: str
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: KeepAlive = None


class ModelBody(_Body):
    model: str | None = None
    name: str | None = None  # older clients send "name"
    verbose: Bool = False


class PullBody(_Body):
    model: str | None = None
    name: str | None = None
    insecure: Bool = False
    stream: Bool = True


class CopyBody(_Body):
    source: str
    destination: str


class CreateBody(_Body):
    """``/api/create`` in Ollama's current JSON form (no Modelfile text: the client parses it)."""

    model: str | None = None
    name: str | None = None  # older clients
    from_: str | None = Field(default=None, alias="from")
    files: dict[str, str] | None = None  # file name -> "sha256:<hex>" of an uploaded blob
    adapters: dict[str, str] | None = None
    template: str | None = None
    system: str | None = None
    parameters: dict[str, Any] | None = None
    messages: list[dict[str, Any]] | None = None
    license: str | list[str] | None = None
    quantize: str | None = None
    draft: str | None = None  # ours: the DRAFT of a Modelfile
    projector: str | None = None  # ours: "sha256:<hex>" of an uploaded projector GGUF (a Modelfile's PROJECTOR)
    stream: Bool = True


# ------------------------------------------------------------------------------------------- OpenAI


class OAIContentPart(_Body):
    type: str
    text: str | None = None
    image_url: dict[str, Any] | str | None = None
    input_audio: dict[str, Any] | None = None  # {"data": base64, "format": "wav" | "mp3" | "flac"}


class OAIToolCallFunction(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"


class OAIToolCall(_Body):
    id: str | None = None
    type: str | None = "function"
    function: OAIToolCallFunction


class OAIMessage(_Body):
    role: str
    content: str | list[OAIContentPart] | None = None
    name: str | None = None
    tool_calls: list[OAIToolCall] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None  # an assistant turn's reasoning (Ollama's name)
    reasoning_content: str | None = None  # llama-server's / DeepSeek's name


class StreamOptions(_Body):
    include_usage: Bool = False


class _OAICommon(_Body):
    model: str
    stream: Bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(
        default=None, description="token id (a string) -> bias in [-100, 100] added to its logit",
        json_schema_extra={"propertyNames": {"pattern": "^[0-9]{1,5}$"},
                           "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}})
    n: int | None = Field(default=None, ge=1, le=1)
    user: str | None = None
    # extensions (not in OpenAI's API): the context size, any Ollama option, keep-alive
    num_ctx: int | None = Field(default=None, ge=1, description="localllm extension: context size in tokens")
    options: dict[str, Any] | None = Field(default=None, description="localllm extension: Ollama options")
    keep_alive: KeepAlive = Field(default=None, description="localllm extension: Ollama keep_alive")


class Reasoning(_Body):
    effort: str | None = None
    summary: str | None = None


class ChatCompletionBody(_OAICommon):
    messages: list[OAIMessage]
    max_completion_tokens: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    logprobs: Bool | None = None
    top_logprobs: int | None = None
    reasoning_effort: str | None = None
    reasoning: Reasoning | None = None


class CompletionBody(_OAICommon):
    prompt: str | list[str]
    suffix: str | None = None
    echo: Bool = False
    logprobs: int | None = Field(default=None, description="alternatives per token (0-20); the legacy shape")


class EmbeddingsOAIBody(_Body):
    model: str
    input: str | list[str]
    encoding_format: str | None = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None


class _Extensions(_Body):
    """localllm's extensions on the OpenAI-style and Anthropic bodies (documented in the README)."""

    num_ctx: int | None = Field(default=None, ge=1, description="localllm extension: context size in tokens")
    options: dict[str, Any] | None = Field(default=None, description="localllm extension: Ollama options")
    keep_alive: KeepAlive = Field(default=None, description="localllm extension: Ollama keep_alive")


# ------------------------------------------------------------------------------------- OpenAI Responses


class ResponsesBody(_Extensions):
    model: str
    input: str | list[dict[str, Any]] | None = None  # items are read by the handler (400 naming a bad one)
    instructions: str | None = None
    max_output_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Bool | None = None
    stream: Bool = False
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_logprobs: int | None = None
    include: list[str] | None = None
    reasoning: Reasoning | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: Bool = True
    metadata: dict[str, Any] | None = None
    truncation: str | None = None
    user: str | None = None
    # sent by Codex: a hint for which cached prompt prefix to reuse, and what the client says about itself
    prompt_cache_key: str | None = None
    client_metadata: dict[str, Any] | None = None


# ------------------------------------------------------------------------------------ Anthropic Messages


class AnthropicMessage(_Body):
    role: str
    content: str | list[dict[str, Any]]  # blocks are read by the handler (400 naming a bad one)


class AnthropicBody(_Extensions):
    model: str
    max_tokens: int | None = None
    messages: list[AnthropicMessage] | None = None
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: Bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


class AnthropicCountBody(_Body):
    model: str
    messages: list[AnthropicMessage] | None = None
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
