"""What a generation streams back: :class:`TextChunk` and :class:`ToolCalls`, then exactly one :class:`Done`
with the request's :class:`Stats`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "cancelled"]  # a failure is an exception, raised to the consumer


@dataclass
class Stats:
    """Ollama's metrics (durations in ns) plus ours."""

    prompt_eval_count: int = 0  # prompt tokens in this request (cached ones included, as Ollama)
    prompt_eval_duration: int = 0
    eval_count: int = 0  # generated tokens (thinking included)
    eval_duration: int = 0
    load_duration: int = 0
    total_duration: int = 0
    prompt_cached_tokens: int = 0  # prompt tokens reused from the KV cache (not evaluated)
    prompt_restored_tokens: int = 0  # of those, restored from the prompt cache on disk
    draft_proposed: int = 0
    draft_accepted: int = 0
    dropped_messages: int = 0  # oldest turns dropped to fit the context
    thinking_tokens: int = 0  # of eval_count, tokens of reasoning
    queue_duration: int = 0  # waited for a free slot
    images: int = 0  # images in the prompt
    image_tokens: int = 0  # of prompt_eval_count, positions holding image embeddings
    images_encoded: int = 0  # of images, encoded by the projector for this request (0: all reused)
    image_encode_duration: int = 0  # ns spent encoding them
    audio_clips: int = 0  # audio clips (WAV/MP3/FLAC) in the prompt (not counted in images)
    audio_tokens: int = 0  # of prompt_eval_count, positions holding audio embeddings (not in image_tokens)
    audio_chunks_encoded: int = 0  # audio chunks (mtmd cuts a clip into 30 s chunks) encoded for this request
    audio_encode_duration: int = 0  # ns spent encoding them
    n_ctx: int = 0
    context_used: int = 0  # tokens of this sequence in the KV cache at the end

    @property
    def eval_rate(self) -> float:
        return self.eval_count / self.eval_duration * 1e9 if self.eval_duration else 0.0

    @property
    def prompt_eval_rate(self) -> float:
        evaluated = self.prompt_eval_count - self.prompt_cached_tokens
        return evaluated / self.prompt_eval_duration * 1e9 if self.prompt_eval_duration else 0.0

    @property
    def draft_acceptance(self) -> float | None:
        return self.draft_accepted / self.draft_proposed if self.draft_proposed else None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TokenLogprob:
    """One generated token with its log-probability and, when asked, the most likely alternatives."""

    token: str
    logprob: float
    bytes: list[int]
    top: list[tuple[str, float, list[int]]] = field(default_factory=list)  # (token, logprob, bytes)


@dataclass
class TextChunk:
    """A piece of generated text (complete UTF-8; stop strings never leak into it)."""

    text: str
    tokens: int = 1
    thinking: bool = False  # reasoning (Ollama's ``message.thinking``), not the answer
    logprobs: list[TokenLogprob] | None = None  # the tokens this chunk's text came from, when asked


@dataclass
class ToolCalls:
    """Tool calls parsed from the model's output (OpenAI/Ollama shape: name + arguments dict)."""

    calls: list[dict[str, Any]]


@dataclass
class Done:
    """The last event of every stream."""

    stats: Stats
    finish_reason: FinishReason = "stop"


Event = TextChunk | ToolCalls | Done
