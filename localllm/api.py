"""The seams the faces talk through: :class:`Models` (the store's side) and :class:`Runner` (the engine's
side), plus :class:`Advisor` (what fits this machine, in-process only) and the dataclasses they return.

Two implementations, one interface::

    Models / Runner / Advisor   in-process  localllm.local.LocalModels / LocalRunner / LocalAdvisor
                                            (a Store, an Engine, the planner, the catalog, the probe)
    Models / Runner             remote      localllm.client.Client (a localllm or Ollama server, Ollama API)

A face gets both from :func:`localllm.session.open_session` (``--host URL`` picks the remote one) and never
asks which one it got: the CLI (``localllm/cli/``: its commands, ``answer.py``, ``interactive.py``) and
the TUI (``localllm/tui``) use nothing else to list, pull, remove, run and unload models.
:class:`Runner` is the one engine interface they see: adding an engine call is the engine's method, this protocol's
member and its two implementations (``tests/test_runner.py`` checks both against it, member by member). The server
is the engine's own face and takes :class:`localllm.engine.Engine` itself (``localllm.server.protocol``).

Errors are the project's: :class:`~localllm.errors.ModelNotFoundError` for an unknown model,
:class:`~localllm.errors.LocalLLMError` (one sentence) for anything else a user can cause; a backend's
:class:`~backends.contract.errors.BackendError` passes through the in-process runner as it is.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncGenerator, Callable, Generator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Protocol

# The backend contract's types the faces use, from here and nowhere else (a face never imports ``backends``;
# tests/test_layers.py checks it): what a request is, what a generation yields, what it raises.
from backends.contract.errors import (
    BackendError,
    ContextOverflowError,
    InputTooLargeError,
    ModelLoadError,
    RequestCancelled,
    UnsupportedError,
)
from backends.contract.events import Done, Event, Stats, TextChunk, TokenLogprob, ToolCalls
from backends.contract.specs import GenerateRequest, Sampling, ThinkValue
from backends.core.pooling import Pooled
from backends.core.pooling import shorten as shorten_vectors
from backends.core.stream import MAX_TOP_LOGPROBS
from backends.descriptor import KV_CACHE_TYPES
from localllm.modelfile import Modelfile
from localllm.store import PullProgress

if TYPE_CHECKING:
    from localllm.hardware import HardwareInfo
    from localllm.loader import LoadOptions

    EventStream = Generator[Event, None, None]  # a stream of events the consumer may close early
    AsyncEventStream = AsyncGenerator[Event, None]

__all__ = [
    "Advisor", "AsyncEventStream", "CatalogItem", "EventStream", "Fit", "Installed", "Models", "ProgressFn",
    "PullProgress", "Runner", "Loaded", "processor", "until",
    # the backend contract, for the faces
    "BackendError", "ContextOverflowError", "InputTooLargeError", "ModelLoadError", "RequestCancelled",
    "UnsupportedError", "Done", "Event", "Stats", "TextChunk", "TokenLogprob", "ToolCalls", "GenerateRequest",
    "Sampling", "ThinkValue", "Pooled", "shorten_vectors", "MAX_TOP_LOGPROBS", "KV_CACHE_TYPES",
]

ProgressFn = Callable[[PullProgress], None]


# ---------------------------------------------------------------------------------------------- models


@dataclass
class Installed:
    """An installed model: what ``list`` and ``show`` print and the model manager lists.

    A server fills what the Ollama API says (``/api/tags`` for :meth:`Models.list`, ``/api/show`` too for
    :meth:`Models.show`); the fields below ``capabilities`` are known in-process only."""

    name: str
    digest: str = ""  # "sha256:<hex>": the model's (a created model's own, not its base's: store.model_digest)
    size: int = 0  # bytes of the weights file
    modified: datetime | None = None
    formats: list[str] = field(default_factory=list)  # ["GGUF"], ["GGUF", "MLX"]; [] when a server does not say
    architecture: str = ""
    parameters: int = 0  # parameter count (0: unknown)
    parameter_size: str = ""  # the label a server gives ("135M"); see parameter_label
    quantization: str = ""  # "Q4_1", "Q4_K_M"
    context_length: int = 0  # the training context
    embedding_length: int = 0
    n_layers: int = 0
    vocab_size: int = 0
    chat_template: str | None = None
    license: str | None = None
    capabilities: list[str] = field(default_factory=list)  # "completion", "tools", "thinking", ...
    mtp_layers: int = 0  # multi-token-prediction layers in the GGUF (self-speculation: drafted from by default)
    base: str | None = None  # the model a created (derived) one was made from (``details.parent_model``)
    modelfile: str = ""  # a Modelfile that recreates the model (``show --modelfile``, ``/api/show``)
    system: str | None = None  # a created model's SYSTEM
    # in-process only
    path: str | None = None  # the .gguf
    weights_digest: str | None = None  # the .gguf's sha256 (a created model shares its base's)
    source: str = ""
    local: bool = False  # a .gguf path used in place
    quant: str | None = None  # the quant the catalog name asked for
    catalog: str | None = None  # the catalog entry's name
    draft: str | None = None  # the catalog's suggested draft model
    template_note: str | None = None
    mlx_path: str | None = None
    mlx_source: str | None = None  # "mlx-community/X@1a2b3c4d5e6f", "converted from the GGUF"
    mlx_repo: str | None = None
    mlx_revision: str | None = None
    projector_path: str | None = None  # the vision projector (capabilities then include "vision")
    projector_digest: str | None = None
    projector_size: int = 0

    @property
    def short_id(self) -> str:
        return self.digest.removeprefix("sha256:")[:12]

    @property
    def parameter_label(self) -> str:
        """``134.5M``, ``7.6B`` from the count, else the server's label.

        >>> Installed("m", parameters=134_515_008).parameter_label, Installed("m", parameter_size="8B").parameter_label
        ('134.5M', '8B')
        """
        p = self.parameters
        if not p:
            return self.parameter_size
        return f"{p / 1e9:.1f}B" if p >= 1e9 else f"{p / 1e6:.1f}M"

    @property
    def kind(self) -> str:
        """``"embedding"`` or ``"rerank"`` for a model that pools instead of generating text, else ``""`` (what
        ``list`` and the model manager mark).

        >>> Installed("m", capabilities=["rerank"]).kind, Installed("m", capabilities=["completion"]).kind
        ('rerank', '')
        """
        if "completion" in self.capabilities:
            return ""
        return next((c for c in ("rerank", "embedding") if c in self.capabilities), "")


class Models(Protocol):
    """Installed models: list, show, pull (with progress), remove, copy."""

    @property
    def label(self) -> str:
        """Where the models live: ``"in-process"`` or ``"server http://127.0.0.1:11434"``."""

    @property
    def remote(self) -> bool:
        """True for a server (whose answers carry less than the local store knows)."""

    def list(self) -> list[Installed]:
        """Installed models, newest first."""

    def show(self, name: str) -> Installed:
        """One model by name (an alias resolves: ``smollm2`` → ``smollm2:135m``; in-process also a ``.gguf``
        path). Raises :class:`~localllm.errors.ModelNotFoundError`."""

    def pull(self, name: str, *, progress: ProgressFn | None = None, cancel: threading.Event | None = None,
             mlx: bool | None = None, mmproj_file: str | None = None) -> Installed:
        """Download and install ``name``; ``progress`` gets :class:`PullProgress` events (Ollama's phases);
        ``cancel`` stops it (the partial download is kept for a resume). ``mlx``: the catalog's MLX weights
        too (in-process; None = on Apple Silicon). ``mmproj_file``: the Hub repo's projector file to take
        (in-process; default: its ``mmproj*.gguf``, F16 first)."""

    def set_projector(self, name: str, path: str) -> Installed:
        """Give installed ``name`` the vision projector file at ``path`` (in-process only; a server refuses)."""

    def remove(self, name: str) -> str:
        """Remove ``name``; returns the installed name that went (``smollm2`` → ``smollm2:135m``)."""

    def copy(self, src: str, dst: str, *, force: bool = False) -> str:
        """Install ``dst`` as another name for ``src``; returns the new name. An existing ``dst`` is refused
        (:class:`~localllm.errors.LocalLLMError`, one sentence) unless ``force`` replaces it."""

    def create(self, name: str, modelfile: Modelfile, *, progress: ProgressFn | None = None,
               quantize: str | None = None, requantize: bool = False) -> Installed:
        """Install ``name`` as the Modelfile says (a derived model sharing its base's weights; in-process or over
        ``/api/create``, a local ``.gguf`` FROM uploaded to the server's blobs first). ``quantize``: its own
        weights, the source's F32/F16 quantized by llama.cpp to that type (``requantize``: from a quantized one,
        in-process only). Raises
        :class:`~localllm.errors.LocalLLMError` (one sentence) for a Modelfile the store cannot use."""

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------- running


def processor(size: int, size_vram: int) -> str:
    """Ollama's PROCESSOR column.

    >>> processor(100, 0), processor(100, 100), processor(100, 52)
    ('100% CPU', '100% GPU', '48%/52% CPU/GPU')
    """
    if size_vram <= 0 or size <= 0:
        return "100% CPU"
    if size_vram >= size:
        return "100% GPU"
    cpu = round((size - size_vram) / size * 100)
    return f"{cpu}%/{100 - cpu}% CPU/GPU"


def until(expires_at: datetime | None, now: datetime | None = None) -> str:
    """Ollama's UNTIL column: "4 minutes from now", "Never", "Stopping...".

    >>> t = datetime(2026, 1, 1, tzinfo=UTC)
    >>> until(datetime(2026, 1, 1, 0, 4, 30, tzinfo=UTC), t), until(None, t), until(t, t)
    ('4 minutes from now', 'Never', 'Stopping...')
    """
    if expires_at is None or expires_at.year > 2200:
        return "Never"
    now = now or datetime.now(UTC)
    left = (expires_at - now).total_seconds()
    if left <= 0:
        return "Stopping..."
    for unit, seconds in (("day", 86400), ("hour", 3600), ("minute", 60), ("second", 1)):
        if left >= seconds:
            n = int(left // seconds)
            return f"{n} {unit}{'s' if n != 1 else ''} from now"
    return "Less than a second from now"


@dataclass(frozen=True)
class DeviceUse:
    """What a loaded model holds on one llama.cpp device: what llama.cpp allocated there (weights, KV cache,
    compute buffers), beside the planner's estimate."""

    name: str  # "RPC0", "CUDA0"
    size: int  # allocated, bytes
    estimate: int = 0  # the planner's estimate, bytes (0: not planned per device)
    description: str = ""  # "127.0.0.1:50052", "NVIDIA GeForce RTX 4090"


@dataclass
class Loaded:
    """A loaded model, as ``ps`` shows it. A server fills what ``/api/ps`` says; the fields below
    ``expires_at`` are known in-process only (``""`` / 0 / None otherwise)."""

    name: str
    digest: str = ""
    size: int = 0  # bytes in memory (weights + KV)
    size_vram: int = 0  # of which on the GPU
    context_length: int = 0  # tokens per sequence in this load
    expires_at: datetime | None = None  # None = never
    backend: str = ""  # a backend's name (backends.descriptor)
    kv_cache_type: str = ""
    n_gpu_layers: int = 0
    n_layers: int = 0
    draft: str | None = None  # "ngram", "mtp", a draft model's path, None
    drafting: str = ""  # speculative decoding now, one line: "MTP layers: on", "...: paused (not paying)", "off (why)"
    n_threads: int | None = None
    slots: int = 0  # sequences that decode together
    slots_busy: int = 0  # of which decoding a request now
    batched: bool = True  # the slots decode in one pass per step; False: they take turns (MLX with a quantized KV)
    prompt_cache_entries: int = 0  # saved prompt prefixes on disk for this model
    prompt_cache_bytes: int = 0
    kv_cache_bytes: int | None = None  # the KV cache's size (reported, else estimated)
    devices: list[DeviceUse] = field(default_factory=list)  # per llama.cpp device other than the CPU
    plan: str = ""  # the plan it loaded with, in one line (localllm.loader.plan_line), as `probe` prints it
    n_cpu_moe: int = 0  # a mixture of experts: the first N layers' experts stay in RAM (llama.cpp --n-cpu-moe)

    @property
    def short_id(self) -> str:
        return self.digest.removeprefix("sha256:")[:12]

    @property
    def experts_placement(self) -> str:
        """A mixture of experts' experts kept in RAM, in words ("" when none are): the first N layers' (every layer
        offloaded), or fewer layers offloaded with their experts in RAM (llama.cpp's ``-ngl N --n-cpu-moe N``).

        >>> Loaded(name="m", n_cpu_moe=2, n_layers=4, n_gpu_layers=5).experts_placement
        'the first 2 layer(s) of 4'
        >>> Loaded(name="m", n_cpu_moe=4, n_layers=4, n_gpu_layers=3).experts_placement
        '2 of 4 layers and the output layer offloaded, their experts in RAM; the other layers on the CPU'
        """
        n, L, ngl = self.n_cpu_moe, self.n_layers, self.n_gpu_layers
        if not n:
            return ""
        if L and 0 < ngl <= L:  # the last ngl - 1 layers and the output layer offloaded (llama.cpp)
            off = ngl - 1
            k = min(n, L) - (L - off)  # offloaded layers whose experts stay in RAM
            return (f"{off} of {L} layers and the output layer offloaded, "
                    + ("their experts in RAM" if k >= off else f"the experts of the first {k} in RAM")
                    + "; the other layers on the CPU")
        return f"the first {n} layer(s)" + (f" of {L}" if L else "")

    @property
    def processor(self) -> str:
        return processor(self.size, self.size_vram)

    @property
    def until(self) -> str:
        return until(self.expires_at)


def drafting_text(draft: str | None, state: str | None, off: str | None = None) -> str:
    """One line on a loaded model's speculative decoding: the draft, and whether it drafts now or why not.

    >>> drafting_text("mtp", "on")
    'MTP layers: on'
    >>> drafting_text(None, None, "no MTP context")
    'off (no MTP context)'
    """
    if off:
        return f"off ({off})"
    if not draft:
        return ""
    what = {"mtp": "MTP layers", "ngram": "prompt lookup"}.get(draft) or f"draft model {draft.rsplit('/', 1)[-1]}"
    return f"{what}: {state or 'on'}"


@dataclass
class Ranked:
    """One document of a rerank answer: its position in the request, its relevance score (the rank head's raw
    output: higher is more relevant), its text, and whether it was cut to fit the model's context."""

    index: int
    score: float
    document: str
    truncated: bool = False


class Runner(Protocol):
    """Loaded models: generate (a sync or an async stream of events), load, unload, ps, embed, rerank: the one
    engine interface the faces see, in-process (:class:`localllm.local.LocalRunner`) and remote
    (:class:`localllm.client.Client`) alike.

    Events are the engine's: :class:`~localllm.api.TextChunk` (``thinking=True`` for reasoning),
    :class:`~localllm.api.ToolCalls`, and one closing :class:`~localllm.api.Done`. Leaving a stream
    early (``break``, closing it, a cancelled task) or setting ``cancel`` stops the generation at its next
    step; a stream stopped by ``cancel`` still ends with ``Done(finish_reason="cancelled")``."""

    @property
    def label(self) -> str: ...

    @property
    def remote(self) -> bool: ...

    def generate(self, name: str, request: GenerateRequest, options: LoadOptions | None = None, *,
                 cancel: threading.Event | None = None, keep_alive: float | None = None) -> EventStream:
        """The events of ``request`` on ``name`` (loaded on demand), in the caller's thread."""

    def agenerate(self, name: str, request: GenerateRequest, options: LoadOptions | None = None, *,
                  cancel: threading.Event | None = None, keep_alive: float | None = None) -> AsyncEventStream:
        """:meth:`generate` for asyncio callers (the loop is never blocked)."""

    def load(self, name: str, options: LoadOptions | None = None, *, keep_alive: float | None = None) -> Loaded:
        """Load ``name`` now (or find it loaded with compatible options)."""

    def unload(self, name: str) -> bool:
        """Unload ``name`` once its generations end; True if it was loaded."""

    def ps(self) -> list[Loaded]:
        """Loaded models, the one that expires last first."""

    def rerank(self, name: str, query: str, documents: list[str], options: LoadOptions | None = None, *,
               keep_alive: float | None = None, truncate: bool = True) -> list[Ranked]:
        """``documents`` scored for ``query`` by a reranking model, most relevant first."""

    def embed(self, name: str, texts: list[str], options: LoadOptions | None = None, *,
              keep_alive: float | None = None) -> list[list[float]]:
        """One L2-normalised embedding per text."""

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------- advice


@dataclass
class Fit:
    """The planner's verdict for one model on this machine."""

    model: str = ""  # the installed name it was planned for ("" for a catalog estimate)
    backend: str = ""  # a backend's name (backends.descriptor)
    verdict: str = ""  # "gpu" | "partial" | "cpu" | "too_big"; "" when unknown
    text: str = "?"  # "fits on GPU", "partial offload 20/32 layers", "CPU", "too big"; "≈ CPU" estimated
    n_gpu_layers: int = 0
    n_ctx: int = 0
    kv_cache_type: str = ""
    reasons: list[str] = field(default_factory=list)  # the planner's, one line per decision
    estimated: bool = False  # from the download size only (the GGUF is not on this machine)


@dataclass
class CatalogItem:
    """A catalog entry with its verdict for this machine."""

    name: str
    size: int = 0  # bytes of the default quant, roughly
    description: str = ""
    draft: str | None = None
    installed: bool = False
    fit: Fit = field(default_factory=Fit)
    family: str = ""  # "qwen3.5"
    params: str = ""  # the alias's size: "35b-a3b", "e4b", "micro"
    capabilities: list[str] = field(default_factory=list)  # "tools", "thinking", "vision", "audio"
    think_levels: list[str] = field(default_factory=list)  # reasoning levels the template takes; [] = on/off
    moe: str = ""  # "35b-a3b": total and active parameters of a mixture of experts; "" for a dense model
    mtp: str = ""  # "layers" | "head": multi-token prediction for self-speculation; "" when none is known
    split_parts: int = 1  # >1: the Hub holds it as split files (pull refuses)

    def capability_text(self) -> str:
        """``"thinking(low/medium/high),tools"``: the capabilities, with reasoning levels where there are some."""
        return ",".join(f"{c}({'/'.join(self.think_levels)})" if c == "thinking" and self.think_levels else c
                         for c in self.capabilities)


class Advisor(Protocol):
    """What this machine is and what fits it (the planner, the catalog, the hardware probe): in-process only."""

    def fit(self, name: str) -> Fit:
        """The plan for an installed model (raises :class:`~localllm.errors.LocalLLMError` when it cannot)."""

    def catalog(self) -> list[CatalogItem]:
        """Every catalog entry with its verdict: exact for installed models, else estimated from the size."""

    def hardware(self) -> HardwareInfo:
        """The probe of this machine."""
