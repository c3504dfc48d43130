"""What a caller hands a backend: how to load a model (:class:`LoadSpec`), and one generation
(:class:`GenerateRequest` with its :class:`Sampling`). Plain, typed data; no backend library is imported."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from backends.descriptor import KVCacheType

ThinkValue = bool | Literal["low", "medium", "high"] | None


@dataclass
class DraftSpec:
    """Speculative decoding. ``kind="model"``: a second model with the same vocabulary;
    ``kind="ngram"``: prompt-lookup drafting (no extra model); ``kind="mtp"``: the model's own
    multi-token-prediction layers (llama.cpp; loaded with them)."""

    kind: Literal["model", "ngram", "mtp"]
    path: str | None = None  # model file / directory for kind="model"
    num_draft: int = 4  # upper bound on tokens proposed per step (the controller adapts below it)
    n_gpu_layers: int = 0
    devices: list[str] = field(default_factory=list)  # a draft model's llama.cpp device, as planned (empty: default)
    auto: bool = False  # chosen by default, not asked for: when it cannot run, decode plainly (the reason in info)


@dataclass
class LoraAdapter:
    """A LoRA adapter applied on the model's weights (llama.cpp: an adapter GGUF; MLX: an adapter directory)."""

    path: str
    scale: float = 1.0


@dataclass
class Tuning:
    """Knobs of the decode loop and the backends that tests and benchmarks turn; the defaults are the product's."""

    prefill_chunk: int | None = None  # prompt tokens per step while others decode (None: the loop's default)
    park: bool = True  # park idle sequences in host memory while several requests run (shared pools)
    batch: bool = True  # MLX: decode several sequences in one batched pass where the cache allows it
    n_seq_ids: int | None = None  # sequence ids in the pool (None: 2 × slots, so idle conversations keep their prefix)
    draft_p_min: float = 0.0  # a draft model stops proposing below this probability
    draft_always: bool = False  # keep drafting even where the controller finds it does not pay
    grammar: str | None = None  # llama.cpp: a GBNF grammar for every request without a format (tests)
    # llama.cpp: where tools are offered and no format asked, a call is constrained from its start (a lazy grammar
    # built from the tools' schemas, :mod:`backends.core.tool_grammar`); off: calls are whatever the model writes
    tool_grammar: bool = True


@dataclass
class LoadSpec:
    """Everything needed to load one model. Paths are plain filesystem paths."""

    model_path: str
    n_ctx: int = 4096  # tokens per sequence (what one request may use)
    slots: int = 1  # sequences decoding at once (slots); the KV pool holds n_ctx × slots cells
    n_gpu_layers: int = 0  # -1 = all
    n_cpu_moe: int = 0  # the first N layers' expert tensors stay in RAM though offloaded (llama.cpp --n-cpu-moe)
    n_threads: int | None = None  # None = physical cores
    n_threads_batch: int | None = None  # threads for prompt batches (None: n_threads)
    n_batch: int = 512  # most tokens one evaluation takes
    kv_cache_type: KVCacheType = "f16"
    flash_attn: bool | None = None  # None = the library decides (llama.cpp: auto)
    draft: DraftSpec | None = None
    embedding: bool = False  # load for embeddings too
    mmproj: str | None = None  # a projector (mmproj GGUF) loaded beside the model: it takes images and/or audio
    verbose: bool = False  # let the library log to stderr
    chat_template: str | None = None  # replaces the model's own (a Modelfile's TEMPLATE)
    lora: list[LoraAdapter] = field(default_factory=list)
    # llama.cpp devices to load on, exactly these (several GPUs, RPC workers), split by ``tensor_split``
    devices: list[str] = field(default_factory=list)
    tensor_split: list[float] = field(default_factory=list)
    # (K, V) head sizes read with the model's metadata: a quantized KV cache is checked without the file's header
    head_dims: tuple[int, int] | None = None
    use_mmap: bool = True
    # llama.cpp: sliding-window layers as long as the context (exact reuse from any position, at a global layer's
    # memory); off, as llama-server: the window per sequence, reuse through checkpoints
    swa_full: bool = False
    # llama.cpp: one KV pool for every sequence id (2 × slots ids, idle ones parked) instead of a stream per slot
    kv_unified: bool = False
    # llama.cpp, flash attention off (the CPU's plan): prompt chunks of 128 tokens or more are evaluated in a second
    # one-slot context with it on (its tiled kernel: ~25% faster for a long cold prompt), their cells then moved
    # into the slot's KV stream; one slot's KV cache more
    prefill_flash_attn: bool = False
    tuning: Tuning = field(default_factory=Tuning)


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
    # token id -> added to its logit before sampling (OpenAI's logit_bias: -100 bans a token, +100 all but forces it)
    logit_bias: dict[int, float] = field(default_factory=dict)
    # The fields the caller chose (a request's options, a flag, ``/set``), by these names: they win over what a
    # created model's PARAMETERs say even when they equal the default (``temperature: 0.8`` over ``PARAMETER
    # temperature 0``); the model's PARAMETERs fill in the others. None = not tracked (a library caller that
    # builds ``Sampling(temperature=0.5)``): then a field that differs from its default counts as chosen.
    # Backends ignore it.
    given: frozenset[str] | None = None

    def choose(self, **values: Any) -> None:
        """Set fields as the caller's choice (recorded in :attr:`given`).

        >>> s = Sampling()
        >>> s.choose(temperature=0.8)
        >>> sorted(s.chosen())
        ['temperature']
        """
        for key, value in values.items():
            if key not in _SAMPLING_CHOICES:
                raise TypeError(f"Sampling has no field {key!r}")
            setattr(self, key, value)
        self.given = self.chosen() | frozenset(values)

    def chosen(self) -> frozenset[str]:
        """The fields the caller chose: :attr:`given`, or where untracked, those that differ from the defaults."""
        if self.given is not None:
            return self.given
        default = Sampling()
        return frozenset(k for k in _SAMPLING_CHOICES if getattr(self, k) != getattr(default, k))


_SAMPLING_CHOICES = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n",
                     "presence_penalty", "frequency_penalty", "seed", "max_tokens", "stop", "logit_bias")


@dataclass(frozen=True)
class ToolCallFormat:
    """The ``fmt`` a sampler gets for a chat that offers ``tools`` and asks no format: a source that can constrains a
    tool call from where it starts (llama.cpp: a lazy grammar, :mod:`backends.core.tool_grammar`) and leaves other text
    free; a source that cannot treats it as no format."""

    tools: list[dict[str, Any]]
    # the template's <tool_call> holds JSON (Hermes, Qwen2.5); False for one whose calls inside it are XML
    # (Qwen3.5, Qwen3-Coder: <function=NAME>): there the tag must not start the JSON grammar
    json_tags: bool = True


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
    think: ThinkValue = None  # None = the model's default (a thinking model thinks)
    logprobs: bool = False
    top_logprobs: int = 0  # 0..20 alternatives per token (with logprobs)
    # raw media for a ``prompt`` request, in the order of IMAGE_MARKER in it (else prepended); chat messages carry
    # theirs as ``message["images"]`` (a list of bytes). As in Ollama, audio rides in the same list: a WAV, MP3 or
    # FLAC clip is told from an image by its magic bytes (:func:`is_audio`), by mtmd as by the faces' checks
    images: list[bytes] | None = None
    # no turn is dropped to make room: a chat that outgrows the context raises ContextOverflowError (with the
    # prompt's size) instead, so that the caller can load a larger context first
    keep_turns: bool = False

    @property
    def has_images(self) -> bool:
        return bool(self.images) or any(m.get("images") for m in self.messages or [])

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("GenerateRequest needs exactly one of messages or prompt")
