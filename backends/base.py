"""The backend contract: a backend is a *token source*; everything per request lives above it, once.

A backend loads quantized weights from a plain :class:`LoadSpec` and answers a handful of questions —
tokenize, render a chat, **evaluate these tokens for these sequences**, sample a row, keep / trim /
copy a sequence's KV cells — and nothing else. It knows nothing about HTTP, terminals, model names,
downloads, stop strings or tool calls (it imports nothing from ``localllm``).

Above it, in this package:

* :mod:`backends.stream` — per request: prompt fitting, stop strings, UTF-8, tool calls, thinking,
  limits, stats and the closing :class:`Done`, the same for every backend;
* :mod:`backends.loop` — one decode loop per loaded model, on the one thread that owns the source:
  many sequences per step (continuous batching), chunked prefill, speculative decoding as a step policy;
* :mod:`backends.kvpool` — that model's KV pool: which tokens each sequence holds, prefix sharing,
  parking, victims, the prompt cache on disk; :mod:`backends.drafting` — what proposes the drafts;
* :mod:`backends.channel` — the one bridge from that thread to a consumer (sync or asyncio);
* :mod:`backends.descriptor` — each backend described once (name, whether it runs here, weights, KV types,
  schema rules, memory, install); :mod:`backends.registry` — names to classes, and loading.

Adding a backend is one file: a :class:`TokenSource` subclass, plus one descriptor registered.

Errors (all subclasses of :class:`BackendError`, each message one clear sentence)::

    BackendError
    ├── ModelLoadError        the file cannot be loaded (corrupt, unsupported architecture, no memory)
    ├── UnsupportedError      a feature the model / build cannot do (quantized KV type, draft pairing, format)
    ├── ContextOverflowError  the prompt does not fit the context even after dropping old turns
    └── PoolFullError         the shared KV pool has no room for this step (the loop frees idle cells and retries)
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Literal, Protocol

from backends.descriptor import KV_CACHE_TYPES, KVCacheType  # noqa: F401 - KV_CACHE_TYPES re-exported
from backends.descriptor import get as descriptor_of

FinishReason = Literal["stop", "length", "cancelled"]  # a failure is an exception, raised to the consumer
ThinkValue = bool | Literal["low", "medium", "high"] | None
FALLBACK_CHAT_TEMPLATE = (  # ChatML, for models without a chat template (base models: chat is of little use)
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


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


class PoolFullError(BackendError):
    """:meth:`TokenSource.evaluate` found no free KV cells for the batch; the memory is unchanged."""


# ---------------------------------------------------------------------------------------------- specs


@dataclass
class DraftSpec:
    """Speculative decoding. ``kind="model"``: a second model with the same vocabulary;
    ``kind="ngram"``: prompt-lookup drafting (no extra model); ``kind="mtp"``: the model's own
    multi-token-prediction layers (llama.cpp; loaded with them)."""

    kind: Literal["model", "ngram", "mtp"]
    path: str | None = None  # model file / directory for kind="model"
    num_draft: int = 4  # upper bound on tokens proposed per step (the controller adapts below it)
    n_gpu_layers: int = 0
    auto: bool = False  # chosen by default, not asked for: when it cannot run, decode plainly (the reason in info)


@dataclass
class LoadSpec:
    """Everything needed to load one model. Paths are plain filesystem paths."""

    model_path: str
    n_ctx: int = 4096  # tokens per sequence (what one request may use)
    n_seq: int = 1  # sequences decoding at once (slots); the KV pool holds n_ctx × n_seq cells
    n_gpu_layers: int = 0  # -1 = all
    n_cpu_moe: int = 0  # the first N layers' expert tensors stay in RAM though offloaded (llama.cpp --n-cpu-moe)
    n_threads: int | None = None  # None = physical cores
    n_batch: int = 512  # most tokens one evaluation takes
    kv_cache_type: KVCacheType = "f16"
    flash_attn: bool | None = None  # None = the library decides (llama.cpp: auto)
    draft: DraftSpec | None = None
    embedding: bool = False  # load for embeddings too
    mmproj: str | None = None  # a projector (mmproj GGUF) loaded beside the model: it takes images and/or audio
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


# --------------------------------------------------------------------------------------------- events


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


# --------------------------------------------------------------------------------------------- models


@dataclass
class ModelInfo:
    """What a loaded model is, as the backend sees it."""

    architecture: str
    n_ctx: int  # context of one sequence in this load
    n_ctx_train: int
    n_layers: int
    n_vocab: int
    chat_template: str | None
    n_gpu_layers: int = 0  # layers actually offloaded
    size_bytes: int = 0  # memory the backend holds (weights + KV), best estimate
    vram_bytes: int = 0  # of which on the GPU
    kv_cache_type: str = "f16"
    draft: str | None = None  # "ngram" / draft model path / None
    n_seq: int = 1  # sequences that can decode at once
    kv_cells: int = 0  # cells in the KV pool (all sequences together)
    recurrent: bool = False  # recurrent / hybrid memory: no partial KV removal, no drafts
    vision: bool = False  # a projector with a vision encoder is loaded: prompts may hold images
    audio: bool = False  # a projector with an audio encoder is loaded: prompts may hold audio clips
    # the GGUF's own pooling (``<arch>.pooling_type``): "mean", "cls", "last" or "rank"; a model that has one is an
    # embedding model (a rank one a reranker): it pools, and cannot generate text (:mod:`backends.pooling`)
    pooling: str | None = None
    n_embd_out: int = 0  # width of a pooled output (an embedding; a rank head: its scores)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def embedding_only(self) -> bool:
        """An embedding or rerank model: it answers pooled outputs, never generated text."""
        return self.pooling is not None


IMAGE_MARKER = "<__media__>"  # where an image goes in a rendered prompt (mtmd's default marker)


def is_image_token(token: int) -> bool:
    """Image positions are negative placeholder ids in a prompt's token list (see :meth:`TokenSource.prompt_media`):
    derived from the image's content hash, so prefix reuse, parking and the disk cache key images by content."""
    return token < 0


AUDIO_MAGIC = {"WAV": lambda b: b[:4] == b"RIFF" and b[8:12] == b"WAVE", "FLAC": lambda b: b[:4] == b"fLaC",
               "MP3": lambda b: b[:3] == b"ID3" or (len(b) > 1 and b[0] == 0xFF and b[1] & 0xE0 == 0xE0)}


def audio_format(data: bytes) -> str | None:
    r""""WAV", "MP3" or "FLAC" when ``data`` starts as one (the test mtmd's decoder makes), else None.

    >>> audio_format(b"RIFF\x00\x00\x00\x00WAVEfmt "), audio_format(b"\x89PNG\r\n\x1a\n")
    ('WAV', None)
    """
    if len(data) < 12:
        return None
    return next((name for name, test in AUDIO_MAGIC.items() if test(data)), None)


def is_audio(data: bytes) -> bool:
    """Whether media bytes are an audio clip (else they are taken for an image)."""
    return audio_format(data) is not None


@dataclass
class MediaWork:
    """What :meth:`TokenSource.encode_images` did for one chunk of a prompt (or since load)."""

    images: int = 0  # images encoded now (0: their embeddings were cached)
    tokens: int = 0  # image tokens those produced
    ns: int = 0  # time the projector took on images
    audio: int = 0  # audio chunks encoded (a clip is one per 30 s, as mtmd cuts it)
    audio_tokens: int = 0  # audio tokens those produced
    audio_ns: int = 0  # time the projector took on audio


@dataclass
class Feed:
    """Tokens to evaluate for one sequence in one step: ``tokens`` at positions ``pos, pos+1, ...``;
    logits are kept for the last ``outputs`` of them (0 = none, ``len(tokens)`` = all). ``pos`` is
    :meth:`TokenSource.positions` of what the sequence holds: its token count, except after an M-RoPE image (whose
    tokens share the image's first position; the source gives each of them its 2-D positions from there)."""

    seq: int
    tokens: list[int]
    pos: int
    outputs: int = 1


class Sampler(Protocol):
    """One request's sampling state (penalties, grammar, RNG), made by :meth:`TokenSource.sampler`."""

    def sample(self, row: int) -> int:
        """Pick the next token from output ``row`` of the last evaluation, and accept it."""

    def sample_logits(self, logits: Any) -> int:
        """Pick (and accept) a token from a saved row of logits (see :meth:`TokenSource.logits`)."""

    def close(self) -> None: ...


class TokenSource(abc.ABC):
    """One loaded model as the decode loop drives it. Every method runs on the loop's one thread.

    Sequence ids ``0 .. n_seq_ids - 1`` name KV sequences in one pool of ``info.kv_cells`` cells; a
    sequence holds at most ``n_ctx`` positions. The loop decides which tokens each sequence holds.
    """

    name: ClassVar[str]
    # set by the decode loop: a source calls it from any thread when it can never run again (an RPC worker it
    # uses died mid-step); the loop fails its requests and abandons the source without calling into it
    on_fatal: Callable[[BaseException], None] | None = None

    def __init__(self, spec: LoadSpec):
        self.spec = spec

    @classmethod
    def available(cls) -> tuple[bool, str]:
        """(usable on this machine, why not and how to install it): the check of this backend's descriptor
        (:meth:`backends.descriptor.Backend.available`), the one the probe shows."""
        return descriptor_of(cls.name).available()

    @classmethod
    def on_thread(cls) -> None:
        """Called first on the decode loop's thread, before anything else runs there (a first-use
        conversion included): a library that keeps per-thread state registers its cleanup here."""
        return None

    # ---- what it is
    @property
    @abc.abstractmethod
    def info(self) -> ModelInfo: ...

    @property
    def n_ctx(self) -> int:
        return self.info.n_ctx

    @property
    def n_seq_ids(self) -> int:
        """Sequence ids the pool can tell apart (active slots plus idle prefixes kept for reuse)."""
        return max(1, self.info.n_seq)

    @property
    def n_batch(self) -> int:
        return self.spec.n_batch

    @property
    def can_batch(self) -> bool:
        """Several sequences in one :meth:`evaluate` run as one batched pass (not one after another)."""
        return False

    @property
    def shared_pool(self) -> bool:
        """All sequences' cells live in one pool whose attention spans them all (llama.cpp's unified KV), so
        cells kept by idle sequences cost the decoding ones work: the loop parks them while others run."""
        return False

    # ---- text
    @abc.abstractmethod
    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        """Token ids of ``text`` without BOS (``special``: control-token strings become control tokens)."""

    @abc.abstractmethod
    def prompt_tokens(self, text: str) -> list[int]:
        """The ids a rendered prompt evaluates to: BOS as the model wants it, special tokens parsed."""

    @abc.abstractmethod
    def detokenize(self, tokens: list[int]) -> str: ...

    @abc.abstractmethod
    def piece(self, token: int) -> bytes:
        """The bytes one token adds to the output (may be part of a UTF-8 character)."""

    @abc.abstractmethod
    def is_eog(self, token: int) -> bool:
        """End of generation (EOS, EOT, ``<|im_end|>`` ...)."""

    @property
    def chat_template(self) -> str | None:
        return self.info.chat_template

    def supports_tools(self) -> bool:
        return bool(self.chat_template) and "tools" in (self.chat_template or "")

    @abc.abstractmethod
    def render(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text the chat template makes of ``messages`` (text-only content)."""

    # ---- images (optional: a backend with a vision projector)
    @property
    def vision(self) -> bool:
        """Whether prompts may hold images (a projector is loaded)."""
        return False

    def vision_problem(self) -> str:
        """Why this load cannot take images (one sentence), asked when a request brings one."""
        return "This model has no vision projector, so it cannot take images."

    @property
    def audio(self) -> bool:
        """Whether prompts may hold audio clips (a projector with an audio encoder is loaded)."""
        return False

    def audio_problem(self) -> str:
        """Why this load cannot take audio (one sentence), asked when a request brings a clip."""
        return "This model has no audio projector, so it cannot take audio."

    def audio_token_count(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` are audio positions (the rest of the negative ids are image positions)."""
        return 0

    def prepare_media(self, media: Sequence[bytes]) -> None:
        """Do the costly, loop-independent part of turning these media into prompt chunks (an audio clip's decode
        and mel spectrogram) now, on the calling thread, so the decode loop does not stall on it when the request
        is admitted. The encoder pass stays with the loop: it is skipped when the clip's KV cells are reused (from
        the pool or the prompt cache on disk). Safe to call from any thread; errors are left for
        :meth:`prompt_media` to report."""
        return None

    def prompt_media(self, text: str, images: list[bytes]) -> list[int]:
        """The ids of a rendered prompt holding one :data:`IMAGE_MARKER` per image: text tokens, and for each
        image as many negative placeholder ids as it takes KV cells (:func:`is_image_token`). Raises
        :class:`UnsupportedError` for bytes that are not a decodable image."""
        raise UnsupportedError(self.vision_problem())

    def encode_images(self, tokens: Sequence[int]) -> MediaWork:
        """Make the embeddings of the images whose placeholders are in ``tokens`` ready for :meth:`evaluate`
        (encoded now, or found in the cache by content hash)."""
        return MediaWork()

    @property
    def media_whole(self) -> bool:
        """An image's positions must be evaluated together, in one step (a projector that needs non-causal
        attention over the image, such as Gemma 3's, or M-RoPE positions, whose image cells share one sequence
        position and so can only be dropped together); the loop then gives the whole image one feed."""
        return False

    def positions(self, tokens: Sequence[int]) -> int:
        """The sequence position that follows ``tokens`` (the first tokens a sequence holds): ``len(tokens)``,
        except where an image takes fewer positions than tokens (M-RoPE: Qwen2-VL's ``nx x ny`` tokens take
        ``max(nx, ny)``). What :meth:`seq_rm` and :meth:`seq_cp` count in, and a :class:`Feed`'s ``pos``."""
        return len(tokens)

    def kv_cut(self, tokens: Sequence[int], n: int) -> tuple[int, int]:
        """To keep only the first ``n`` of the ``tokens`` a sequence holds: (how many it can keep, ``<= n``; the
        position from which its cells go). An image whose cells share a position is kept whole or not at all."""
        return n, n

    def media_span(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` belong to the image of the first one (from that position on)."""
        n = 0
        while n < len(tokens) and is_image_token(tokens[n]):
            n += 1
        return n

    def media_counters(self) -> MediaWork:
        """Images and audio chunks encoded since load (their tokens, the time): the ``/metrics`` counters."""
        return MediaWork()

    # ---- evaluation
    @abc.abstractmethod
    def evaluate(self, feeds: Sequence[Feed]) -> list[list[int]]:
        """Run one step over all ``feeds``; return, per feed, the row handles of its outputs (in order).
        A feed is all text tokens or all image placeholders (the loop cuts prompt chunks there).

        Raises :class:`PoolFullError` (memory unchanged) when the pool has no room for the batch."""

    @abc.abstractmethod
    def sampler(self, sampling: Sampling, fmt: str | dict[str, Any] | None) -> Sampler:
        """A fresh sampler for one request (seed, temperature/top-k/top-p/min-p, penalties, grammar)."""

    @abc.abstractmethod
    def logits(self, row: int) -> Any:
        """A copy of the logits of output ``row`` of the last evaluation (a float32 numpy array)."""

    # ---- KV cells per sequence
    @abc.abstractmethod
    def seq_rm(self, seq: int, p0: int = 0, p1: int = -1) -> bool:
        """Drop positions ``[p0, p1)`` of ``seq`` (``p1=-1``: to the end). False if the memory cannot."""

    @abc.abstractmethod
    def seq_cp(self, src: int, dst: int, n: int) -> bool:
        """Make ``dst`` hold the first ``n`` positions of ``src``; False (``dst`` empty) if the memory cannot."""

    def can_rewind(self) -> bool:
        """Whether the tail of a sequence can be dropped (``seq_rm`` from a position on): what drafts need."""
        return not self.info.recurrent

    # ---- checkpoints: memory that cannot drop its tail (recurrent state, a sliding window kept at window size)
    @property
    def needs_checkpoints(self) -> bool:
        """A sequence's memory cannot be cut back to an earlier position (a recurrent state holds only the
        latest one; a sliding-window cache drops what falls out of its window): a prefix is reused only from a
        :meth:`checkpoint_save` taken when the sequence held exactly it (:mod:`backends.kvpool`)."""
        return False

    def can_cut(self, seq: int, n: int) -> bool:
        """Whether ``seq`` cut to its first ``n`` positions still holds what evaluating on from ``n`` needs (a
        window that has not yet dropped the cells before ``n`` it attends to); always, on plain memory."""
        return not self.needs_checkpoints

    def checkpoint_save(self, seq: int) -> bytes:
        """The part of ``seq``'s state that its cells cannot give back for an earlier position (the recurrent
        state, the window), as it is now."""
        raise UnsupportedError(f"The {self.name} backend takes no checkpoints.")

    def checkpoint_restore(self, src: int, dst: int, n: int, data: bytes) -> bool:
        """Make ``dst`` (emptied first) hold the first ``n`` positions of ``src`` from a checkpoint ``data``
        taken when ``src`` held exactly them; False (``dst`` empty) if the memory refuses it."""
        return False

    # ---- prompt cache on disk (optional)
    def state_key(self) -> str | None:
        """What a saved sequence state depends on besides the model and tokens (build, KV type...);
        None = this backend cannot save sequence states."""
        return None

    def state_save(self, seq: int) -> bytes:
        raise UnsupportedError(f"The {self.name} backend cannot save sequence states.")

    def state_load(self, seq: int, data: bytes) -> bool:
        return False

    # ---- pooled outputs: embeddings and rerank scores (optional; see backends.pooling)
    @property
    def can_pool(self) -> bool:
        """Whether :meth:`pool` evaluates several inputs together (else :meth:`embed` serves embeddings)."""
        return False

    def embed_tokens(self, text: str) -> list[int]:
        """The ids an embedding input evaluates to (the special tokens the model adds around a text: BOS / [CLS],
        [SEP] / EOS)."""
        return self.prompt_tokens(text)

    def rerank_tokens(self, query: str, document: str) -> list[int]:
        """The ids a (query, document) pair evaluates to on a rank head (the GGUF's rerank template, else
        ``[CLS] query [SEP] document`` as the vocabulary adds them)."""
        raise UnsupportedError("This model has no rank head, so it cannot rerank.")

    def tail_tokens(self, *, rerank: bool = False) -> int:
        """How many tokens at the end of an input a cut to fit keeps: the [SEP] / EOS the tokenizer closes every
        input with; for a rerank pair, what follows the document (its closing token, or the rerank template's tail,
        so that a long document is cut, not the prompt around it)."""
        return 0

    def pool_limits(self) -> tuple[int, int]:
        """(most tokens, most inputs) one :meth:`pool` evaluates together."""
        raise UnsupportedError(f"The {self.name} backend cannot pool outputs; embed texts one at a time.")

    def pool(self, inputs: Sequence[Sequence[int]]) -> list[Any]:
        """Evaluate ``inputs`` (each whole, within :meth:`pool_limits`) together, each as a sequence of its own with
        no state kept from before or after, and return each one's pooled output (a float32 numpy array, not
        normalised): the embedding, or on a rank head its scores."""
        raise UnsupportedError(f"The {self.name} backend cannot pool outputs; embed texts one at a time.")

    # ---- the rest
    @abc.abstractmethod
    def embed(self, texts: list[str]) -> list[list[float]]:
        """One L2-normalised vector per text."""

    @abc.abstractmethod
    def close(self) -> None:
        """Free weights and caches. Idempotent."""


# ------------------------------------------------------------------------------------ context policy


def check_logit_bias(bias: dict[int, float], n_vocab: int) -> None:
    """Refuse a ``logit_bias`` that names a token outside the model's vocabulary (ids ``0..n_vocab-1``)."""
    bad = [t for t in bias if not 0 <= t < n_vocab]
    if bad:
        raise UnsupportedError(f"logit_bias names token {bad[0]}, which this model's vocabulary "
                               f"(0-{n_vocab - 1}) does not have.")


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


def message_text(content: Any) -> str:
    """The text of a message's ``content`` (a string, or OpenAI content parts of type text).

    >>> message_text([{"type": "text", "text": "a"}, "b"])
    'ab'
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") in (None, "text"):
                parts.append(str(p.get("text", "")))
            elif isinstance(p, str):
                parts.append(p)
            else:
                raise UnsupportedError("This model takes text only; image and audio parts are not supported.")
        return "".join(parts)
    return str(content)


def text_messages(messages: list[dict[str, Any]], *, images: bool = False) -> list[dict[str, Any]]:
    """Messages with text-only ``content``. A message's ``images`` (raw bytes) are refused in one sentence, or,
    with ``images``, kept and announced by one :data:`IMAGE_MARKER` each before the text (as Ollama does)."""
    out = []
    for m in messages:
        imgs = m.get("images")
        if imgs and not images:
            raise UnsupportedError("This model takes text only; images are not supported.")
        text = message_text(m.get("content"))
        if imgs:
            text = IMAGE_MARKER * len(imgs) + ("\n" + text if text else "")
        out.append({**m, "content": text})
    return out


def message_images(messages: list[dict[str, Any]]) -> list[bytes]:
    """The images of ``messages`` in prompt order (the order of their markers once rendered)."""
    return [bytes(i) for m in messages for i in (m.get("images") or [])]
