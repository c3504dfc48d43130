"""The token-source contract: a backend is a *token source*; everything per request lives above it, once.

A backend loads quantized weights from a plain :class:`~backends.contract.specs.LoadSpec` and answers the decode
loop's questions — what it is, tokenize, render a chat, **evaluate these tokens for these sequences**, sample a row,
keep / drop / copy a sequence's KV cells — and nothing else (:class:`TokenSource`, the core every source implements:
fourteen abstract members, the rest defaults it may override). What only some loads can do is a capability of its
own, a Protocol a source implements or not, and a load says which it has in one typed record
(:attr:`TokenSource.capabilities`, a :class:`Capabilities`):

* :class:`MediaInput` — images and audio in prompts (a projector is loaded);
* :class:`Checkpoints` — memory that cannot drop its tail (a recurrent state, a sliding window): a prefix comes
  back from a checkpoint taken when the sequence held exactly it;
* :class:`SequenceStates` — a sequence's state saved as bytes and loaded back (the prompt cache on disk, parking);
* :class:`Pooling` — pooled outputs, several inputs in one evaluation (embeddings, rerank scores).

The decode loop, the KV pool and the pooling code ask for a capability through that record, never by probing
attributes. Drafting needs of the target only that a sequence's tail can be dropped (:meth:`TokenSource.can_rewind`).

Above the source, in this package: :mod:`backends.core.stream` (per request: prompt fitting, stop strings, UTF-8, tool
calls, thinking, limits, stats and the closing ``Done``), :mod:`backends.core.loop` (one decode loop per loaded
model: continuous batching, chunked prefill, speculative decoding as a step policy, each request's slot in an
explicit state), :mod:`backends.core.kvpool` (the KV pool), :mod:`backends.core.drafting`, :mod:`backends.core.channel`,
:mod:`backends.descriptor` and :mod:`backends.registry`. Adding a backend is one package (``backends/<name>/``, its
:class:`TokenSource` subclass and what only it needs) plus one descriptor line in :mod:`backends.descriptor`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from backends.contract.media import MediaWork, is_image_token
from backends.contract.specs import LoadSpec, Sampling, ToolCallFormat
from backends.descriptor import get as descriptor_of

FALLBACK_CHAT_TEMPLATE = (  # ChatML, for models without a chat template (base models: chat is of little use)
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


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
    draft_off: str = ""  # why a default draft (MTP) is not running, "" when it runs or none was asked
    slots: int = 1  # sequences that can decode at once
    kv_cells: int = 0  # cells in the KV pool (all sequences together)
    recurrent: bool = False  # recurrent / hybrid memory: no partial KV removal, no drafts
    vision: bool = False  # a projector with a vision encoder is loaded: prompts may hold images
    audio: bool = False  # a projector with an audio encoder is loaded: prompts may hold audio clips
    # the GGUF's own pooling (``<arch>.pooling_type``): "mean", "cls", "last" or "rank"; a model that has one is an
    # embedding model (a rank one a reranker): it pools, and cannot generate text (:mod:`backends.core.pooling`)
    pooling: str | None = None
    n_embd_out: int = 0  # width of a pooled output (an embedding; a rank head: its scores)
    # what the backend measured or chose at load (0 / "" / None: not reported)
    kv_bytes: int = 0  # the KV cache allocated (all sequences)
    weights_bytes: int = 0
    projector: str | None = None  # the projector file loaded beside the model
    projector_bytes: int = 0
    n_params: int = 0
    description: str = ""  # the library's one-line description of the model
    device: str = ""  # where it runs, where the library names one device (MLX)
    flash_attn: bool | None = None
    n_threads: int = 0
    n_seq_ids: int = 0  # sequence ids of the pool (slots plus idle prefixes kept)
    kv_streams: bool = False  # a KV stream per sequence id (llama.cpp's kv_unified off), not one unified pool
    sliding_window: int = 0  # the window of sliding-window layers (0: none)
    swa_full: bool = False  # those layers keep the whole context
    batched: bool = True  # several sequences decode in one batched pass
    # per device, what the library allocated at load, from its own lines: {"RPC0": {"weights": b, "kv": b}}
    allocations: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def embedding_only(self) -> bool:
        """An embedding or rerank model: it answers pooled outputs, never generated text."""
        return self.pooling is not None


@dataclass
class Feed:
    """Tokens to evaluate for one sequence in one step: ``tokens`` at positions ``pos, pos+1, ...``;
    logits are kept for the last ``outputs`` of them (0 = none, ``len(tokens)`` = all). ``pos`` is
    :meth:`MediaInput.positions` of what the sequence holds: its token count, except after an M-RoPE image (whose
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
    """One loaded model as the decode loop drives it: the core every source implements (what a load can do
    beyond it: :attr:`capabilities`). Every method runs on the loop's one thread.

    A source implements the fourteen abstract members: what it is (:attr:`info`); text (:meth:`tokenize`,
    :meth:`prompt_tokens`, :meth:`detokenize`, :meth:`piece`, :meth:`is_eog`, :meth:`render`); evaluation
    (:meth:`evaluate`, :meth:`sampler`, :meth:`logits`); a sequence's KV cells (:meth:`seq_rm`, :meth:`seq_cp`); and
    :meth:`embed`, :meth:`close`. It inherits defaults for the rest and overrides those its load answers otherwise:
    the backend (:attr:`name`, :meth:`available`, :meth:`on_thread`, :attr:`on_fatal`, :attr:`spec`), sizes and
    batching (:attr:`n_ctx`, :attr:`n_seq_ids`, :attr:`n_batch`, :attr:`can_batch`, :attr:`shared_pool`,
    :attr:`fills_cpu`), the chat
    (:attr:`chat_template`, :meth:`supports_tools`), :meth:`can_rewind`, why media are refused
    (:meth:`vision_problem`, :meth:`audio_problem`), :meth:`prefill_counters` and :attr:`capabilities`.

    Sequence ids ``0 .. n_seq_ids - 1`` name KV sequences in a pool of ``info.kv_cells`` cells (one shared pool,
    or a stream of its own each: ``info.kv_streams``); a sequence holds at most ``n_ctx`` positions. The loop
    decides which tokens each sequence holds.
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
        return max(1, self.info.slots)

    @property
    def n_batch(self) -> int:
        return self.spec.n_batch

    @property
    def can_batch(self) -> bool:
        """Several sequences in one :meth:`evaluate` run as one batched pass (not one after another)."""
        return False

    @property
    def fills_cpu(self) -> bool:
        """Its evaluation keeps every core the process may use busy (llama.cpp on the CPU, a thread per core), so work
        on another thread during it stalls it: the loop lets consumers finish with a step's tokens before the next."""
        return False

    def prefill_counters(self) -> tuple[int, int]:
        """(prompt tokens evaluated in a separate prefill context, nanoseconds spent moving their cells into the
        main one) since load: llama.cpp's flash-attention prefill on the CPU (:mod:`backends.llamacpp._prefill`);
        (0, 0) where there is none."""
        return 0, 0

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

    # ---- evaluation
    @abc.abstractmethod
    def evaluate(self, feeds: Sequence[Feed]) -> list[list[int]]:
        """Run one step over all ``feeds``; return, per feed, the row handles of its outputs (in order).
        A feed is all text tokens or all image placeholders (the loop cuts prompt chunks there).

        Raises :class:`PoolFullError` (memory unchanged) when the pool has no room for the batch."""

    @abc.abstractmethod
    def sampler(self, sampling: Sampling, fmt: str | dict[str, Any] | ToolCallFormat | None) -> Sampler:
        """A fresh sampler for one request (seed, temperature/top-k/top-p/min-p, penalties, grammar). ``fmt`` a
        :class:`~backends.contract.specs.ToolCallFormat`: tools are offered and no format asked; a source that cannot
        constrain a call from where it starts treats it as None."""

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

    def vision_problem(self) -> str:
        """Why this load cannot take images (one sentence), asked when a request brings one and the load takes none
        (no :class:`MediaInput`, or one without a working vision encoder: a source with a projector answers it)."""
        return "This model has no vision projector, so it cannot take images."

    def audio_problem(self) -> str:
        """Why this load cannot take audio (one sentence), as :meth:`vision_problem` for a clip."""
        return "This model has no audio projector, so it cannot take audio."

    # ---- optional capabilities
    @property
    def capabilities(self) -> Capabilities:
        """What this load can do beyond the core (:class:`Capabilities`); by default, the capability protocols
        the class implements. A source whose capabilities depend on the load (a projector, the memory's kind)
        answers its own record."""
        return Capabilities.of(self)

    # ---- the rest
    @abc.abstractmethod
    def embed(self, texts: list[str]) -> list[list[float]]:
        """One L2-normalised vector per text."""

    @abc.abstractmethod
    def close(self) -> None:
        """Free weights and caches. Idempotent."""


# ------------------------------------------------------------------------------------------ capabilities


@runtime_checkable
class MediaInput(Protocol):
    """Images and audio in prompts: a load with a projector. Without one, a prompt is text only, a sequence's
    positions are its token count and any cut is exact (what the loop and the pool assume then)."""

    @property
    def vision(self) -> bool:
        """Whether prompts may hold images (a projector with a vision encoder that works; why not:
        :meth:`TokenSource.vision_problem`)."""

    @property
    def audio(self) -> bool:
        """Whether prompts may hold audio clips (a projector with an audio encoder that works; why not:
        :meth:`TokenSource.audio_problem`)."""

    def audio_token_count(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` are audio positions (the rest of the negative ids are image positions)."""

    def prepare_media(self, media: Sequence[bytes]) -> None:
        """Do the costly, loop-independent part of turning these media into prompt chunks (an audio clip's decode
        and mel spectrogram) now, on the calling thread, so the decode loop does not stall on it when the request
        is admitted. The encoder pass stays with the loop: it is skipped when the clip's KV cells are reused (from
        the pool or the prompt cache on disk). Safe to call from any thread; errors are left for
        :meth:`prompt_media` to report."""

    def prompt_media(self, text: str, images: list[bytes]) -> list[int]:
        """The ids of a rendered prompt holding one :data:`~backends.contract.media.IMAGE_MARKER` per image: text
        tokens, and for each image as many negative placeholder ids as it takes KV cells
        (:func:`~backends.contract.media.is_image_token`). Raises :class:`~backends.contract.errors.UnsupportedError`
        for bytes that are not a decodable image."""

    def encode_images(self, tokens: Sequence[int]) -> MediaWork:
        """Make the embeddings of the images whose placeholders are in ``tokens`` ready for
        :meth:`TokenSource.evaluate` (encoded now, or found in the cache by content hash)."""

    @property
    def media_whole(self) -> bool:
        """An image's positions must be evaluated together, in one step (a projector that needs non-causal
        attention over the image, such as Gemma 3's, or M-RoPE positions, whose image cells share one sequence
        position and so can only be dropped together); the loop then gives the whole image one feed."""

    def positions(self, tokens: Sequence[int]) -> int:
        """The sequence position that follows ``tokens`` (the first tokens a sequence holds): ``len(tokens)``,
        except where an image takes fewer positions than tokens (M-RoPE: Qwen2-VL's ``nx x ny`` tokens take
        ``max(nx, ny)``). What :meth:`TokenSource.seq_rm` and :meth:`TokenSource.seq_cp` count in, and a
        :class:`Feed`'s ``pos``."""

    def kv_cut(self, tokens: Sequence[int], n: int) -> tuple[int, int]:
        """To keep only the first ``n`` of the ``tokens`` a sequence holds: (how many it can keep, ``<= n``; the
        position from which its cells go). An image whose cells share a position is kept whole or not at all."""

    def media_span(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` belong to the image of the first one (from that position on)."""

    def media_counters(self) -> MediaWork:
        """Images and audio chunks encoded since load (their tokens, the time): the ``/metrics`` counters."""


@runtime_checkable
class Checkpoints(Protocol):
    """A sequence's memory cannot be cut back to an earlier position (a recurrent state holds only the latest
    one; a sliding-window cache drops what falls out of its window): a prefix is reused only from a
    :meth:`checkpoint_save` taken when the sequence held exactly it (:mod:`backends.core.kvpool`)."""

    def can_cut(self, seq: int, n: int) -> bool:
        """Whether ``seq`` cut to its first ``n`` positions still holds what evaluating on from ``n`` needs (a
        window that has not yet dropped the cells before ``n`` it attends to)."""

    def checkpoint_save(self, seq: int) -> bytes:
        """The part of ``seq``'s state that its cells cannot give back for an earlier position (the recurrent
        state, the window), as it is now."""

    def checkpoint_restore(self, src: int, dst: int, n: int, data: bytes) -> bool:
        """Make ``dst`` (emptied first) hold the first ``n`` positions of ``src`` from a checkpoint ``data``
        taken when ``src`` held exactly them; False (``dst`` empty) if the memory refuses it."""


@runtime_checkable
class SequenceStates(Protocol):
    """A sequence's whole state as bytes and back: the prompt cache on disk, and parking idle sequences."""

    def state_key(self) -> str | None:
        """What a saved state depends on besides the model and tokens (build, KV type...); None: this load's
        memory cannot be saved after all (its capabilities then have no ``states``)."""

    def state_save(self, seq: int) -> bytes: ...

    def state_load(self, seq: int, data: bytes) -> bool:
        """Load :meth:`state_save`'s bytes into ``seq``; False if the memory refuses them."""


@runtime_checkable
class Pooling(Protocol):
    """Pooled outputs, several inputs evaluated together (:mod:`backends.core.pooling`): embeddings, and on a rank head
    rerank scores. A source without it serves embeddings through :meth:`TokenSource.embed` alone."""

    def embed_tokens(self, text: str) -> list[int]:
        """The ids an embedding input evaluates to (the special tokens the model adds around a text: BOS / [CLS],
        [SEP] / EOS)."""

    def rerank_tokens(self, query: str, document: str) -> list[int]:
        """The ids a (query, document) pair evaluates to on a rank head (the GGUF's rerank template, else
        ``[CLS] query [SEP] document`` as the vocabulary adds them); :class:`~backends.contract.errors.UnsupportedError`
        without a rank head."""

    def rerank_tokenizer(self, query: str) -> Callable[[str], list[int]]:
        """:meth:`rerank_tokens` of ``query`` as a function of the document, the query tokenized once where that
        gives the same ids (a rerank of many documents)."""

    def tail_tokens(self, *, rerank: bool = False) -> int:
        """How many tokens at the end of an input a cut to fit keeps: the [SEP] / EOS the tokenizer closes every
        input with; for a rerank pair, what follows the document (its closing token, or the rerank template's tail,
        so that a long document is cut, not the prompt around it)."""

    def pool_limits(self) -> tuple[int, int]:
        """(most tokens, most inputs) one :meth:`pool` evaluates together."""

    def pool(self, inputs: Sequence[Sequence[int]]) -> list[Any]:
        """Evaluate ``inputs`` (each whole, within :meth:`pool_limits`) together, each as a sequence of its own with
        no state kept from before or after, and return each one's pooled output (a float32 numpy array, not
        normalised): the embedding, or on a rank head its scores."""


@dataclass(frozen=True)
class Capabilities:
    """What one load can do beyond the core contract: each field the object that does it (the source itself, as
    a rule), or None."""

    media: MediaInput | None = None
    checkpoints: Checkpoints | None = None
    states: SequenceStates | None = None
    pooling: Pooling | None = None

    @classmethod
    def of(cls, source: object) -> Capabilities:
        """The capability protocols ``source``'s class implements."""
        return cls(media=source if isinstance(source, MediaInput) else None,
                   checkpoints=source if isinstance(source, Checkpoints) else None,
                   states=source if isinstance(source, SequenceStates) and source.state_key() is not None else None,
                   pooling=source if isinstance(source, Pooling) else None)


def positions_of(media: MediaInput | None) -> Callable[[Sequence[int]], int]:
    """The position count of a sequence's tokens for a load (``len``, where prompts are text only)."""
    return media.positions if media is not None else len


def cut_of(media: MediaInput | None) -> Callable[[Sequence[int], int], tuple[int, int]]:
    """How a load cuts a sequence's tokens to ``n`` (:meth:`MediaInput.kv_cut`; exact where prompts are text only)."""
    return media.kv_cut if media is not None else _exact_cut


def _exact_cut(tokens: Sequence[int], n: int) -> tuple[int, int]:
    return n, n


def media_span(tokens: Sequence[int]) -> int:
    """How many leading ``tokens`` are media placeholders (what :meth:`MediaInput.media_span` counts by default)."""
    n = 0
    while n < len(tokens) and is_image_token(tokens[n]):
        n += 1
    return n
