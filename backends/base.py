"""The backend contract: load quantized weights from a plain spec, stream tokens for a plain request.

A backend knows nothing about HTTP, terminals, model names or downloads (it imports nothing from
``localllm``). Everything it needs arrives as a :class:`LoadSpec` and a :class:`GenerateRequest`;
everything it produces is a stream of :class:`TextChunk` events closed by one :class:`Done`.

Concurrency: one backend instance serves ``max_parallel`` sequences at once (1 for llama.cpp and
MLX today). The engine never calls :meth:`Backend.generate` on an instance more than
``max_parallel`` times concurrently. A backend that gains parallel slots raises ``max_parallel``;
nothing above it changes.

Cancellation: :meth:`Backend.generate` takes a ``threading.Event``; when it is set the backend stops
at the next token and ends the stream with ``Done(finish_reason="cancelled")``. Closing the
generator early (``gen.close()``) must also leave the instance usable.

Errors (all subclasses of :class:`BackendError`, each message one clear sentence)::

    BackendError
    ├── ModelLoadError        the file cannot be loaded (corrupt, unsupported architecture, no memory)
    ├── UnsupportedError      a feature the model / build cannot do (quantized KV type, draft pairing, format)
    └── ContextOverflowError  the prompt does not fit the context even after dropping old turns
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

KVCacheType = Literal["f16", "q8_0", "q4_0"]
KV_CACHE_TYPES: tuple[str, ...] = ("f16", "q8_0", "q4_0")
FinishReason = Literal["stop", "length", "cancelled", "error"]


class BackendError(Exception):
    """Base of every backend error; ``str(e)`` is one sentence a user can act on."""


class ModelLoadError(BackendError):
    """The weights could not be loaded."""


class UnsupportedError(BackendError):
    """The model or the build cannot do what was asked (KV type, draft pair, format, images...)."""


class ContextOverflowError(BackendError):
    """The prompt does not fit even after dropping the oldest turns."""

    def __init__(self, message: str, prompt_tokens: int = 0, n_ctx: int = 0):
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.n_ctx = n_ctx


# ---------------------------------------------------------------------------------------------- specs


@dataclass
class DraftSpec:
    """Speculative decoding. ``kind="model"``: a second model file with the same vocabulary;
    ``kind="ngram"``: prompt-lookup drafting (no extra model)."""

    kind: Literal["model", "ngram"]
    path: str | None = None  # model file / directory for kind="model"
    num_draft: int = 4  # upper bound on tokens proposed per step (the backend adapts below it)
    n_gpu_layers: int = 0


@dataclass
class LoadSpec:
    """Everything needed to load one model. Paths are plain filesystem paths."""

    model_path: str
    n_ctx: int = 4096
    n_gpu_layers: int = 0  # -1 = all
    n_threads: int | None = None  # None = physical cores
    n_batch: int = 512
    kv_cache_type: KVCacheType = "f16"
    flash_attn: bool | None = None  # None = on when the KV type needs it
    draft: DraftSpec | None = None
    embedding: bool = False  # load for embeddings too
    verbose: bool = False  # let the library log to stderr
    extra: dict[str, Any] = field(default_factory=dict)  # backend-specific knobs


@dataclass
class Sampling:
    """Sampling options; defaults follow Ollama's."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.9
    min_p: float = 0.0
    repeat_penalty: float = 1.1
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # same seed + same request -> same text
    max_tokens: int = -1  # -1 = until stop / context end
    stop: list[str] = field(default_factory=list)


@dataclass
class GenerateRequest:
    """One generation. Exactly one of ``messages`` (chat, rendered with the model's template) or
    ``prompt`` (raw completion, no template) is set."""

    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    sampling: Sampling = field(default_factory=Sampling)
    # None | "json" | a JSON Schema dict (Ollama's ``format``, OpenAI's response_format)
    format: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("GenerateRequest needs exactly one of messages or prompt")


# --------------------------------------------------------------------------------------------- events


@dataclass
class Stats:
    """Ollama's metrics (durations in ns) plus ours."""

    prompt_eval_count: int = 0  # prompt tokens in this request (cached ones included, as Ollama)
    prompt_eval_duration: int = 0
    eval_count: int = 0  # generated tokens
    eval_duration: int = 0
    load_duration: int = 0
    total_duration: int = 0
    prompt_cached_tokens: int = 0  # prompt tokens reused from the KV cache (not evaluated)
    draft_proposed: int = 0
    draft_accepted: int = 0
    dropped_messages: int = 0  # oldest turns dropped to fit the context
    n_ctx: int = 0
    context_used: int = 0  # tokens in the KV cache at the end

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
        from dataclasses import asdict

        return asdict(self)


@dataclass
class TextChunk:
    """A piece of generated text (complete UTF-8; stop strings never leak into it)."""

    text: str
    tokens: int = 1


@dataclass
class ToolCalls:
    """Tool calls parsed from the model's output (OpenAI/Ollama shape: name + arguments dict)."""

    calls: list[dict[str, Any]]


@dataclass
class Done:
    """The last event of every stream."""

    stats: Stats
    finish_reason: FinishReason = "stop"
    error: str | None = None  # set with finish_reason="error"


Event = TextChunk | ToolCalls | Done


# --------------------------------------------------------------------------------------------- models


@dataclass
class ModelInfo:
    """What a loaded model is, as the backend sees it."""

    architecture: str
    n_ctx: int  # context of this load
    n_ctx_train: int
    n_layers: int
    n_vocab: int
    chat_template: str | None
    n_gpu_layers: int = 0  # layers actually offloaded
    size_bytes: int = 0  # memory the backend holds (weights + KV), best estimate
    vram_bytes: int = 0  # of which on the GPU
    kv_cache_type: str = "f16"
    draft: str | None = None  # "ngram" / draft model path / None
    extra: dict[str, Any] = field(default_factory=dict)


class Backend(abc.ABC):
    """One loaded model. Subclasses load in ``__init__`` and free in :meth:`close`."""

    name: ClassVar[str]
    max_parallel: int = 1

    def __init__(self, spec: LoadSpec):
        self.spec = spec

    @classmethod
    @abc.abstractmethod
    def available(cls) -> tuple[bool, str]:
        """(importable on this machine, reason when not)."""

    @property
    @abc.abstractmethod
    def info(self) -> ModelInfo: ...

    @abc.abstractmethod
    def generate(self, request: GenerateRequest, cancel: threading.Event | None = None) -> Iterator[Event]:
        """Stream :class:`TextChunk` (and :class:`ToolCalls`) events, then exactly one :class:`Done`."""

    @abc.abstractmethod
    def tokenize(self, text: str, *, special: bool = False) -> list[int]: ...

    @abc.abstractmethod
    def detokenize(self, tokens: list[int]) -> str: ...

    @abc.abstractmethod
    def embed(self, texts: list[str]) -> list[list[float]]:
        """One L2-normalised vector per text."""

    @abc.abstractmethod
    def close(self) -> None:
        """Free weights and caches. Idempotent."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def get_backend_class(name: str) -> type[Backend]:
    """``"llamacpp"`` or ``"mlx"`` → the class (imported lazily: they pull heavy libraries)."""
    if name == "llamacpp":
        from backends.llamacpp import LlamaCppBackend

        return LlamaCppBackend
    if name == "mlx":
        from backends.mlx import MLXBackend

        return MLXBackend
    if name == "fake":
        from backends.fake import FakeBackend

        return FakeBackend
    raise ValueError(f"unknown backend {name!r} (choose llamacpp or mlx)")


# ------------------------------------------------------------------------------------ context policy


def answer_reserve(max_tokens: int, n_ctx: int) -> int:
    """Tokens kept free for the answer: ``max_tokens``, else n_ctx/8 (64..1024); at most half the context."""
    want = max_tokens if max_tokens and max_tokens > 0 else min(max(n_ctx // 8, 64), 1024)
    return max(1, min(want, n_ctx // 2))


def fit_messages(
    messages: list[dict[str, Any]], render: Callable[[list[dict[str, Any]]], list[int]], n_ctx: int, reserve: int
) -> tuple[list[int], int]:
    """(prompt tokens, messages dropped): the policy every backend follows when a chat outgrows its context.

    While the rendered prompt leaves less than ``reserve`` tokens for the answer, the oldest turns go
    first — never a system message nor the last user message; an assistant/tool reply right after a
    dropped turn goes with it, so the chat still starts with a user turn. A prompt that does not fit
    at all raises :class:`ContextOverflowError` with the numbers.
    """
    msgs = list(messages)
    toks = render(msgs)
    dropped = 0
    while len(toks) > n_ctx - reserve:
        last_user = max((i for i, m in enumerate(msgs) if m.get("role") == "user"), default=len(msgs) - 1)
        droppable = [i for i, m in enumerate(msgs) if i < last_user and m.get("role") != "system"]
        if not droppable:
            break
        del msgs[droppable[0]]
        dropped += 1
        last_user -= 1
        while True:  # keep the first remaining turn a user turn
            i = next((j for j, m in enumerate(msgs) if m.get("role") != "system"), None)
            if i is None or i >= last_user or msgs[i].get("role") == "user":
                break
            del msgs[i]
            dropped += 1
            last_user -= 1
        toks = render(msgs)
    check_fits(len(toks), n_ctx, dropped)
    return toks, dropped


def check_fits(n_prompt: int, n_ctx: int, dropped: int = 0) -> None:
    """Raise :class:`ContextOverflowError` when ``n_prompt`` tokens leave no room in ``n_ctx``."""
    if n_prompt >= n_ctx:
        what = "The prompt" if dropped == 0 else f"Even after dropping {dropped} older messages, the prompt"
        raise ContextOverflowError(
            f"{what} needs {n_prompt} tokens but the context holds {n_ctx}; shorten it or load the model "
            "with a larger context (num_ctx).", prompt_tokens=n_prompt, n_ctx=n_ctx)
