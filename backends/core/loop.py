"""One decode loop per loaded model: many sequences, one batched evaluation per step, one thread.

:class:`LoadedModel` (the handle; the thread's half is :class:`~backends.core.scheduler.Scheduler`) owns a
:class:`~backends.contract.source.TokenSource` on a thread of its own (llama.cpp's CPU
threads belong to the thread that calls it; MLX streams are thread-local), made and closed there too.
Requests arrive through :meth:`LoadedModel.submit` and leave as a :class:`~backends.core.channel.Channel` of
events. Each step of the loop:

1. admits waiting requests while a slot is free: renders and fits the prompt
   (:class:`~backends.core.stream.RequestStream`) and has the KV pool (:class:`~backends.core.kvpool.KVPool`) place
   it — the sequence whose cached tokens share the longest prefix with the prompt; a prefix held by
   another sequence (a shared system prompt) is copied (``seq_cp``) instead of evaluated again; on memory that
   cannot drop its tail (a hybrid's recurrent state, a sliding window) a prefix comes back from a checkpoint;
2. gathers one token from every decoding sequence (plus drafted tokens where speculative decoding drafts),
   then chunks of pending prompts under the step's token budget
   (chunked prefill: a long prompt never stalls the streams in flight); a chunk ends where the pool wants a
   checkpoint of the sequence (a message's start, an image's, every N tokens, the prompt's end), taken after it;
3. runs one ``evaluate`` for all of them (where the evaluation fills the CPU and two or more streams decode, after
   letting their consumers finish with the last step's tokens: their work beside llama.cpp's threads stalls
   them, :meth:`~backends.core.scheduler.Scheduler._settle`); when the pool is full it frees the least recently
   used idle sequences and retries, and a prompt that still does not fit waits;
4. samples each sequence with its own sampler, verifies drafts, feeds the tokens to each request's
   stream (stops, UTF-8, tools, thinking, limits) and sends the events;
5. ends finished, cancelled and failed requests at once: their slot is free the same step, and whatever
   ended them, the tokens their sequence evaluated stay as an idle prefix for the next request until the
   pool needs them (least recently used first) and their long prefixes are owed to the prompt cache on
   disk (copied out of the pool once the model has idled ``PromptCacheSpec.idle_s``, or before their cells
   change or go, or at close: never between a turn's end and the next turn's start; the cache's writer hashes
   and writes only while no request runs); in a unified pool, while several requests run (or one beside 512+
   idle tokens), idle sequences are parked in host memory instead (attention spans every cell up to the highest
   in use) and copied back when their conversation returns.

Each request is a :class:`~backends.core.slot.Slot` in an explicit state that only its transitions change
(:mod:`backends.core.slot`); what a load can do beyond the core contract is read once from its capabilities.

Speculative decoding is a step policy (:class:`~backends.core.drafting.Speculation`): a draft proposes tokens that
are verified in the same evaluation, while one sequence decodes, or several at once where the drafter serves
them all (MTP); adaptive controllers switch drafting off where it does not pay.

Determinism: a seeded request repeated gives the same text (a fully cached prompt samples from the saved
logits of its last token instead of evaluating it again). Batched with others, F32 targets give the solo
output (tested); quantized kernels are not batch-invariant and agree closely but can flip a near-tie. In
the shared pool, other requests can leave free cells in another order, so a sequence's new tokens may be
stored out of position order; attention then sums in another order and the last bits can differ: a
repeat after other traffic agrees closely, identity is not promised.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, TypeVar

from backends.contract.errors import BackendError, UnsupportedError
from backends.contract.events import Event
from backends.contract.media import is_audio
from backends.contract.metrics import LoopMetrics
from backends.contract.source import Capabilities, ModelInfo, TokenSource
from backends.contract.specs import GenerateRequest, LoadSpec
from backends.core import pooling
from backends.core._speculative import SpecController
from backends.core.channel import Channel
from backends.core.drafting import Speculation
from backends.core.kvpool import KVPool
from backends.core.pooling import Pooled
from backends.core.prompt_cache import PromptCacheSpec
from backends.core.scheduler import Scheduler
from backends.core.slot import Slot, SlotState
from backends.core.stream import RequestStream, message_images

log = logging.getLogger("backends.core.loop")
T = TypeVar("T")

DEFAULT_PREFILL_CHUNK = 128  # prompt tokens per step while other sequences decode


# ------------------------------------------------------------------------------------------ the loop

_live: weakref.WeakSet[LoadedModel] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Close every model still loaded before the interpreter finalizes (not torn down by the collector at exit)."""
    for m in list(_live):
        try:
            m.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


class LoadedModel(Scheduler):
    """A model loaded on its own decode thread, serving up to ``spec.slots`` requests at once::

        from backends.registry import load
        m = load("llamacpp", LoadSpec("smollm2.gguf", n_ctx=2048, slots=4))
        for ev in m.generate(GenerateRequest(prompt="Once upon")):
            print(ev)
        m.close()

    ``generate`` (sync) and ``agenerate`` (asyncio) stream events; leaving either early cancels the
    request at the next step. ``call(fn)`` runs ``fn(source)`` on the loop thread between steps.
    """

    def __init__(self, source_class: type[TokenSource], spec: LoadSpec, *, name: str = "model",
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, prompt_cache: PromptCacheSpec | None = None,
                 before_load: Callable[[], None] | None = None):
        self.spec = spec
        self.name = name
        self.slots = max(1, spec.slots)
        self.prefill_chunk = max(1, spec.tuning.prefill_chunk or prefill_chunk)
        self._source_class = source_class
        self._source: TokenSource | None = None
        self._caps = Capabilities()
        self._positions: Callable[[Sequence[int]], int] = len
        self._spec: Speculation | None = None  # the drafter and its controllers, with a draft
        self._pool: KVPool | None = None
        self._fills_cpu = False
        self._incoming: deque[Slot] = deque()
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Condition()
        self._active: list[Slot] = []
        self._closing = False
        self._abandoned = False  # its source died (on_fatal): the thread may be stuck in C for good
        self._counters = LoopMetrics()
        self._pace = pooling.Pace()  # how fast its pooling batches go, across requests
        self._load_error: BaseException | None = None
        self._pcache_spec = prompt_cache
        self._before_load = before_load
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name=f"localllm-model-{name}", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            self._thread.join()
            raise self._load_error
        _live.add(self)

    # ------------------------------------------------------------------ public

    @property
    def info(self) -> ModelInfo:
        return self.source.info

    @property
    def closed(self) -> bool:
        return self._closing

    def submit(self, request: GenerateRequest, cancel: threading.Event | None = None,
               t_submit_ns: int | None = None) -> Channel[Event]:
        """Queue ``request``; its events arrive on the returned channel (errors raised from it)."""
        ch: Channel[Event] = Channel(cancel)
        if self._closing:
            ch.fail(BackendError("This model has been unloaded."))
            return ch
        t = t_submit_ns if t_submit_ns is not None else time.perf_counter_ns()
        clips = [m for m in (request.images or []) + message_images(list(request.messages or [])) if is_audio(m)]
        media = self._caps.media if clips else None
        req = (Slot.loading_media if media is not None else Slot)(RequestStream(request, t), ch, t)

        def enqueue() -> None:
            with self._wake:
                if self._closing:  # unloaded while its clips were prepared: the loop will not drain it any more
                    req.finish()
                    ch.fail(BackendError("This model has been unloaded."))
                    return
                if req.state is SlotState.LOADING_MEDIA:
                    req.queue()
                self._incoming.append(req)
                self._wake.notify_all()

        if media is None:  # no clips (or no projector: the loop's tokenize refuses them in one sentence)
            enqueue()
            return ch

        def prepare() -> None:  # a clip's decode and mel spectrogram (~1 s a 30 s chunk) off the loop and the caller
            try:
                media.prepare_media(clips)
            except Exception:  # noqa: BLE001 - the loop's tokenize reports a bad clip in one sentence
                log.debug("preparing audio failed", exc_info=True)
            finally:
                enqueue()

        threading.Thread(target=prepare, name="localllm-media", daemon=True).start()
        return ch

    def generate(self, request: GenerateRequest, cancel: threading.Event | None = None) -> Iterator[Event]:
        """Stream events for ``request`` (the last is :class:`~backends.contract.events.Done`)."""
        return iter(self.submit(request, cancel))

    def agenerate(self, request: GenerateRequest, cancel: threading.Event | None = None) -> AsyncIterator[Event]:
        return self.submit(request, cancel).__aiter__()

    def embed(self, texts: list[str]) -> list[list[float]]:
        return self.embed_many(texts).vectors

    def embed_many(self, texts: list[str], *, truncate: bool = True, cancel: threading.Event | None = None,
                   max_tokens: int = 0) -> Pooled:
        """Embeddings of ``texts`` (and the tokens they took), tokenized and evaluated in batches between decode
        steps (:mod:`backends.core.pooling`: ``cancel`` stops it between two, ``max_tokens`` caps the tokens of all
        inputs); a backend that cannot pool embeds them in one job."""
        if self._caps.pooling is None:
            vectors = self.call(lambda s: s.embed(texts))
            return self._count(Pooled(vectors=vectors), len(texts))
        return self._count(pooling.embed(self.call, texts, truncate=truncate, cancel=cancel, max_tokens=max_tokens,
                                         busy=self._busy_for_pooling(), pace=self._pace), len(texts))

    def rerank(self, query: str, documents: list[str], *, truncate: bool = True,
               cancel: threading.Event | None = None, max_tokens: int = 0) -> Pooled:
        """Relevance scores of ``documents`` to ``query`` from a rank head, in batches between decode steps
        (``cancel``, ``max_tokens``: as :meth:`embed_many`'s)."""
        return self._count(pooling.rerank(self.call, query, documents, truncate=truncate, cancel=cancel,
                                          max_tokens=max_tokens, busy=self._busy_for_pooling(), pace=self._pace),
                           len(documents))

    def _decoding(self) -> bool:
        """Whether requests decode (or wait to) on this model now: pooling batches keep short beside them."""
        return bool(self._active or self._incoming)

    def _busy_for_pooling(self) -> Callable[[], bool] | None:
        """What pooling batches ask before they run: a model that can generate may have chats to keep waiting
        briefly; an embedding or rerank model has none (its batches are whole evaluations)."""
        return None if self.source.info.embedding_only else self._decoding

    def _count(self, pooled: Pooled, inputs: int) -> Pooled:
        self._counters.pooled_inputs += inputs  # read as a snapshot by metrics(); a lost race costs one count
        self._counters.pooled_tokens += pooled.tokens
        return pooled

    def tokenize(self, text: str, *, special: bool = False, images: list[bytes] | None = None) -> list[int]:
        """``text``'s token ids; with ``images``, ``text`` holds an :data:`~backends.contract.media.IMAGE_MARKER` per
        image and each image is as many placeholder ids as the positions it takes (a load with a projector)."""
        if not images:
            return self.call(lambda s: s.tokenize(text, special=special))

        def media(s: TokenSource) -> list[int]:
            m = s.capabilities.media
            if m is None:
                raise UnsupportedError(s.vision_problem())
            return m.prompt_media(text, list(images))

        return self.call(media)

    def detokenize(self, tokens: list[int]) -> str:
        return self.call(lambda s: s.detokenize(tokens))

    @property
    def controller(self) -> Any:
        """The speculative-decoding controller (None without a draft)."""
        return self._spec.controller if self._spec is not None else None

    @property
    def speculation(self) -> Speculation | None:
        """The drafter and its controllers (None without a draft); used on the decode thread."""
        return self._spec

    @property
    def wide_controllers(self) -> dict[int, SpecController]:
        """The controllers of steps where several sequences draft at once, by how many sequences (a copy)."""
        return dict(self._spec.wide) if self._spec is not None else {}

    @property
    def busy(self) -> int:
        """Requests running or waiting now."""
        return len(self._active) + len(self._incoming)

    def slot_states(self) -> list[SlotState]:
        """The state of each request in the loop now, running ones first, then those waiting (as llama-server's
        ``/slots`` lists its slots); asked on the loop thread, between steps."""
        return self.call(lambda _: [r.state for r in [*self._active, *self._incoming]])

    def metrics(self) -> LoopMetrics:
        m = LoopMetrics(**vars(self._counters))
        m.slots = self.slots
        m.slots_busy = len(self._active)
        m.waiting = len(self._incoming)
        m.kv_cells = self.source.info.kv_cells if self._source is not None else 0
        if self._pool is not None:
            u, pc = self._pool.usage(), self._pool.counters
            m.kv_tokens_active, m.kv_tokens_idle, m.kv_tokens_parked = u.active, u.idle, u.parked
            m.kv_parked_bytes = u.parked_bytes
            m.kv_checkpoints, m.kv_checkpoint_bytes = u.checkpoints, u.checkpoint_bytes
            m.prompt_tokens_cached, m.prompt_tokens_copied = pc.prompt_tokens_cached, pc.prompt_tokens_copied
            m.prompt_tokens_restored, m.evictions = pc.prompt_tokens_restored, pc.evictions
        if self._source is not None:
            m.prompt_tokens_flash, m.prefill_move_ns = self.source.prefill_counters()
        if self._caps.media is not None:
            mw = self._caps.media.media_counters()
            m.images_encoded, m.image_tokens_encoded, m.image_encode_ns = mw.images, mw.tokens, mw.ns
            m.audio_chunks_encoded, m.audio_tokens_encoded, m.audio_encode_ns = mw.audio, mw.audio_tokens, mw.audio_ns
        if self._spec is not None:
            m.drafting = "on" if self._spec.controller.drafting else "paused (not paying)"
        if self.prompt_cache is not None:
            st = self.prompt_cache.stats
            m.prompt_cache_entries, m.prompt_cache_bytes = st.entries, st.bytes
            m.prompt_cache_hits, m.prompt_cache_misses = st.hits, st.misses
        return m

    def abandon(self, err: BaseException) -> None:
        """:meth:`Scheduler.abandon`, and the model is no longer closed at exit (its thread is left)."""
        super().abandon(err)
        _live.discard(self)

    def close(self) -> None:
        """Cancel what is running, free the model on its thread and join the thread. Idempotent."""
        with self._wake:
            self._closing = True
            self._wake.notify_all()
        if self._abandoned:
            _live.discard(self)
            return
        if threading.current_thread() is not self._thread:
            self._thread.join()
        _live.discard(self)

    def __enter__(self) -> LoadedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

__all__ = ["LoadedModel", "LoopMetrics"]
