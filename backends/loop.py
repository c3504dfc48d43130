"""One decode loop per loaded model: many sequences, one batched evaluation per step, one thread.

:class:`LoadedModel` owns a :class:`~backends.source.TokenSource` on a thread of its own (llama.cpp's CPU
threads belong to the thread that calls it; MLX streams are thread-local), made and closed there too.
Requests arrive through :meth:`LoadedModel.submit` and leave as a :class:`~backends.channel.Channel` of
events. Each step of the loop:

1. admits waiting requests while a slot is free: renders and fits the prompt
   (:class:`~backends.stream.RequestStream`) and has the KV pool (:class:`~backends.kvpool.KVPool`) place
   it — the sequence whose cached tokens share the longest prefix with the prompt; a prefix held by
   another sequence (a shared system prompt) is copied (``seq_cp``) instead of evaluated again; on memory that
   cannot drop its tail (a hybrid's recurrent state, a sliding window) a prefix comes back from a checkpoint;
2. gathers one token from every decoding sequence (plus drafted tokens where speculative decoding drafts),
   then chunks of pending prompts under the step's token budget
   (chunked prefill: a long prompt never stalls the streams in flight); a chunk ends where the pool wants a
   checkpoint of the sequence (a message's start, an image's, every N tokens, the prompt's end), taken after it;
3. runs one ``evaluate`` for all of them; when the pool is full it frees the least recently used idle
   sequences and retries, and a prompt that still does not fit waits;
4. samples each sequence with its own sampler, verifies drafts, feeds the tokens to each request's
   stream (stops, UTF-8, tools, thinking, limits) and sends the events;
5. ends finished, cancelled and failed requests at once: their slot is free the same step, and whatever
   ended them, the tokens their sequence evaluated stay as an idle prefix for the next request until the
   pool needs them (least recently used first) and their long prefixes are owed to the prompt cache on
   disk (copied out of the pool once the model has idled ``PromptCacheSpec.idle_s``, or before their cells
   change or go, or at close: never between a turn's end and the next turn's start; the cache's writer hashes
   and writes only while no request runs); while several requests run (or one beside 512+ idle tokens),
   idle sequences are parked in host memory instead (attention spans every cell up to the highest in use)
   and copied back when their conversation returns.

Each request is a :class:`~backends.slot.Slot` in an explicit state that only its transitions change
(:mod:`backends.slot`); what a load can do beyond the core contract is read once from its capabilities.

Speculative decoding is a step policy (:class:`~backends.drafting.Speculation`): a draft proposes tokens that
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

from backends import pooling
from backends._speculative import SpecController
from backends.channel import Channel
from backends.drafting import Speculation, open_with_draft
from backends.errors import BackendError, PoolFullError, UnsupportedError
from backends.events import Event
from backends.kvpool import KVPool
from backends.media import is_audio, is_image_token
from backends.metrics import LoopMetrics
from backends.pooling import Pooled
from backends.prompt_cache import PromptCache, PromptCacheSpec
from backends.slot import Slot, SlotState
from backends.source import Capabilities, Feed, ModelInfo, TokenSource, positions_of
from backends.specs import GenerateRequest, LoadSpec, ToolCallFormat
from backends.stream import RequestStream, message_images

log = logging.getLogger("backends.loop")
T = TypeVar("T")

DEFAULT_PREFILL_CHUNK = 128  # prompt tokens per step while other sequences decode
_PREFILL, _READY, _DECODE = SlotState.PREFILL, SlotState.READY, SlotState.DECODE  # globals: enum lookups cost more


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


class LoadedModel:
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
        self._incoming: deque[Slot] = deque()
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Condition()
        self._active: list[Slot] = []
        self._closing = False
        self._abandoned = False  # its source died (on_fatal): the thread may be stuck in C for good
        self._counters = LoopMetrics()
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
    def source(self) -> TokenSource:
        assert self._source is not None
        return self._source

    @property
    def info(self) -> ModelInfo:
        return self.source.info

    @property
    def pool(self) -> KVPool:
        """The KV pool's sequences and bookkeeping (touch it on the loop thread only: through :meth:`call`)."""
        assert self._pool is not None
        return self._pool

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
        """Stream events for ``request`` (the last is :class:`~backends.events.Done`)."""
        return iter(self.submit(request, cancel))

    def agenerate(self, request: GenerateRequest, cancel: threading.Event | None = None) -> AsyncIterator[Event]:
        return self.submit(request, cancel).__aiter__()

    def call(self, fn: Callable[[TokenSource], T]) -> T:
        """Run ``fn(source)`` on the loop thread (between steps) and return its result."""
        if threading.current_thread() is self._thread:
            return fn(self.source)
        if self._closing:
            raise BackendError("This model has been unloaded.")
        box: list[tuple[bool, Any]] = []
        done = threading.Event()

        def job() -> None:
            try:
                box.append((True, fn(self.source)))
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                box.append((False, e))
            finally:
                done.set()

        self._jobs.put(job)
        with self._wake:
            self._wake.notify_all()
        while not done.wait(0.5):
            if not self._thread.is_alive():
                raise BackendError("This model has been unloaded.")
        ok, value = box[0]
        if ok:
            return value  # type: ignore[no-any-return]
        raise value

    def embed(self, texts: list[str]) -> list[list[float]]:
        return self.embed_many(texts).vectors

    def embed_many(self, texts: list[str], *, truncate: bool = True, cancel: threading.Event | None = None,
                   max_tokens: int = 0) -> Pooled:
        """Embeddings of ``texts`` (and the tokens they took), tokenized and evaluated in batches between decode
        steps (:mod:`backends.pooling`: ``cancel`` stops it between two, ``max_tokens`` caps the tokens of all
        inputs); a backend that cannot pool embeds them in one job."""
        if self._caps.pooling is None:
            vectors = self.call(lambda s: s.embed(texts))
            return self._count(Pooled(vectors=vectors), len(texts))
        return self._count(pooling.embed(self.call, texts, truncate=truncate, cancel=cancel, max_tokens=max_tokens,
                                         busy=self._decoding), len(texts))

    def rerank(self, query: str, documents: list[str], *, truncate: bool = True,
               cancel: threading.Event | None = None, max_tokens: int = 0) -> Pooled:
        """Relevance scores of ``documents`` to ``query`` from a rank head, in batches between decode steps
        (``cancel``, ``max_tokens``: as :meth:`embed_many`'s)."""
        return self._count(pooling.rerank(self.call, query, documents, truncate=truncate, cancel=cancel,
                                          max_tokens=max_tokens, busy=self._decoding), len(documents))

    def _decoding(self) -> bool:
        """Whether requests decode (or wait to) on this model now: pooling batches keep short beside them."""
        return bool(self._active or self._incoming)

    def _count(self, pooled: Pooled, inputs: int) -> Pooled:
        self._counters.pooled_inputs += inputs  # read as a snapshot by metrics(); a lost race costs one count
        self._counters.pooled_tokens += pooled.tokens
        return pooled

    def tokenize(self, text: str, *, special: bool = False, images: list[bytes] | None = None) -> list[int]:
        """``text``'s token ids; with ``images``, ``text`` holds an :data:`~backends.media.IMAGE_MARKER` per image
        and each image is as many placeholder ids as the positions it takes (a load with a projector)."""
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

    @property
    def prompt_cache(self) -> PromptCache | None:
        """The prompt cache on disk (None when off, or when this backend cannot save sequence states)."""
        return self._pool.prompt_cache if self._pool is not None else None

    def abandon(self, err: BaseException) -> None:
        """The source can never run again (called from any thread): every request fails with ``err`` now, and
        nothing calls into the source again (its thread may be stuck in C: it is left, not joined)."""
        with self._wake:
            self._closing = self._abandoned = True
            pending = self._active + list(self._incoming)
            self._incoming.clear()
            self._wake.notify_all()
        for r in pending:
            r.channel.fail(err if isinstance(err, BackendError) else BackendError(str(err)))
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

    # ------------------------------------------------------------------ thread

    def _main(self) -> None:
        try:
            self._load()
        except BaseException as e:  # noqa: BLE001 - raised in the caller of __init__
            self._load_error = e
            self._ready.set()
            return
        self._ready.set()
        pc = self.prompt_cache
        idle_s = self._pcache_spec.idle_s if self._pcache_spec is not None else 0.0
        busy = False
        last_busy = time.monotonic()
        try:
            while True:
                self._run_jobs()
                with self._wake:
                    if self._closing:
                        break
                    idle = not self._active and not self._incoming
                    if idle and pc is not None and self.pool.owes():
                        wait = last_busy + idle_s - time.monotonic()
                        if wait > 0:
                            self._wake.wait(min(0.5, wait))
                            continue
                    elif idle:
                        self._wake.wait(0.5)
                        continue
                if idle:  # (the prompt cache is owed prefixes and the model has idled idle_s)
                    self.pool.save_owed()  # one at a time: a request that comes meanwhile waits for one copy
                    continue
                if pc is not None and not busy:
                    busy = True
                    pc.decoding(True)  # its writer yields to the steps
                self._admit()
                if self._active:
                    self._step()
                if not self._active and not self._incoming:
                    busy, last_busy = False, time.monotonic()
                    if pc is not None:
                        pc.decoding(False)
        except BaseException as e:  # noqa: BLE001 - a crash of the loop: every request gets it
            log.exception("decode loop of %s crashed", self.name)
            err = e if isinstance(e, BackendError) else BackendError(f"The model failed while generating: {e}")
            for r in self._active + list(self._incoming):
                r.channel.fail(err)
            self._active.clear()
            self._incoming.clear()
        finally:
            self._shutdown()

    def _load(self) -> None:
        self._source_class.on_thread()
        if self._before_load is not None:  # e.g. a first-use conversion, on the thread that will run the model
            self._before_load()
        src, spec, self._spec = open_with_draft(self._source_class, self.spec)  # spec: without a draft that failed
        self.spec = spec
        self._source = src
        src.on_fatal = self.abandon
        try:
            self._caps = caps = src.capabilities
            self._positions = positions_of(caps.media)
            pc, state_key = self._pcache_spec, caps.states.state_key() if caps.states is not None else None
            cache = None
            if pc is not None and pc.max_bytes > 0 and state_key is not None:
                cache = PromptCache(pc.root, key=f"{pc.model_key} {state_key}", max_bytes=pc.max_bytes,
                                    min_tokens=pc.min_tokens, budget_root=pc.budget_root)
            can_park = src.shared_pool and state_key is not None and spec.tuning.park
            self._pool = pool = KVPool(src, prompt_cache=cache, can_park=bool(can_park))
            if cache is not None:
                cache.before_flush = lambda: self._save_owed_now(pool)
        except BaseException:
            src.close()
            raise

    def _save_owed_now(self, pool: KVPool) -> None:
        """Copy out every prefix the pool owes the prompt cache (a flush of the cache), on the loop thread."""
        def save(_src: TokenSource) -> None:
            while pool.save_owed():
                pass

        try:
            self.call(save)
        except BackendError:  # unloaded meanwhile: the close saved them
            pass

    def _shutdown(self) -> None:
        for r in self._active + list(self._incoming):
            self._end(r, "cancelled")
        self._active.clear()
        self._incoming.clear()
        while True:  # calls queued behind the close see a clear error
            try:
                self._jobs.get_nowait()()
            except queue.Empty:
                break
        if self._pool is not None:
            self._pool.close()  # the entries being written are finished, not lost
        try:
            if self._spec is not None:
                self._spec.drafter.close()
        finally:
            if self._source is not None:
                self._source.close()

    def _run_jobs(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            job()

    # ------------------------------------------------------------------ admission

    def _admit(self) -> None:
        src = self.source
        with self._wake:  # requests whose consumer left while they waited leave the queue at once
            gone = [r for r in self._incoming if r.channel.cancel.is_set()]
            for r in gone:
                self._incoming.remove(r)
        for r in gone:
            self._close_cancelled(r)
        while True:
            with self._wake:
                if not self._incoming or len(self._active) >= self.slots:
                    break
                req = self._incoming.popleft()
            if req.channel.cancel.is_set():
                self._close_cancelled(req)
                continue
            if src.info.embedding_only:  # the faces say so first; a library caller learns it here
                req.finish()
                req.channel.fail(UnsupportedError(
                    f"This is {'a reranking' if src.info.pooling == 'rank' else 'an embedding'} model: it cannot "
                    "generate text."))
                continue
            try:
                prompt = req.stream.prepare(src)
                asked = req.stream.request
                fmt: Any = asked.format
                if fmt in (None, "", "text") and asked.tools and asked.messages is not None:
                    # a call, once begun, is constrained to the tools offered
                    fmt = ToolCallFormat(list(asked.tools), json_tags="<function=" not in (src.chat_template or ""))
                req.sampler = src.sampler(asked.sampling, fmt)
            except Exception as e:  # noqa: BLE001 - a template or tokenizer crash: one sentence
                req.finish()
                req.channel.fail(e if isinstance(e, BackendError) else
                                 BackendError(f"The model could not prepare this request: {e}"))
                continue
            now = time.perf_counter_ns()
            req.stream.stats.queue_duration = now - req.t_submit
            placed = self.pool.place(req, prompt)
            req.admit(placed.seq, placed.logits, self.pool.checkpoint_points(
                prompt, [*req.stream.cache_points, placed.diverged], chat=req.stream.request.messages is not None),
                now)
            req.stream.stats.prompt_cached_tokens = placed.cached
            req.stream.stats.prompt_restored_tokens = placed.restored
            self._active.append(req)
            self._counters.requests += 1

    @staticmethod
    def _close_cancelled(r: Slot) -> None:
        """End a request that was cancelled before it was admitted (it holds no sequence yet)."""
        r.finish()
        for ev in r.stream.close("cancelled"):
            r.channel.put(ev)
        r.channel.close()

    # ------------------------------------------------------------------ one step

    def _step(self) -> None:
        src = self.source
        # requests that left: cancelled by their consumer
        for r in list(self._active):
            if r.channel.cancel.is_set():
                self._end(r, "cancelled")
        if not self._active:
            return
        # first tokens from saved logits (a fully cached prompt): no evaluation
        for r in list(self._active):
            if r.state is _READY:
                assert r.sampler is not None
                logits = r.take_saved()
                tok = r.sampler.sample_logits(logits)
                lp = r.stream.logprob(logits, tok) if r.stream.wants_logprobs else None
                self._emit(r, [tok], [lp])
        if not self._active:
            return
        self.pool.park_idle(len(self._active))
        budget = src.n_batch
        t_step = time.perf_counter_ns()  # the step's cost includes drafting (a draft model's catch-up too)
        catchup = 0
        proposed: dict[int, list[int]] = {}
        feeds: list[Feed] = []
        owners: list[tuple[Slot, SlotState, list[int]]] = []  # (request, DECODE or PREFILL, drafts)
        decoding = [r for r in self._active if r.state is _DECODE]
        ctl: SpecController | None = None
        if self._spec is not None:
            ctl, proposed = self._spec.step(decoding, len(self._active), src.n_ctx)
            catchup = self._spec.drafter.catchup_ns if proposed else 0
        for r in decoding:
            assert r.seq is not None and r.last is not None
            drafts = proposed.get(id(r), [])
            feeds.append(Feed(r.seq.id, [r.last, *drafts], self._positions(r.seq.tokens), 1 + len(drafts)))
            owners.append((r, _DECODE, drafts))
            budget -= 1 + len(drafts)
        cap = budget if not decoding else min(budget, self.prefill_chunk)
        room = budget  # the step's tokens left, beyond the prefill chunk: a whole image may take them
        for r in list(self._active):
            if r.state is not _PREFILL or cap <= 0:
                continue
            assert r.seq is not None
            ahead = [(q.stream.prompt, q.seq) for q in self._active[:self._active.index(r)]
                     if q.seq is not None and q.state is _PREFILL]
            wait, gained = self.pool.join(r.seq, r.stream.prompt, ahead)
            r.stream.stats.prompt_cached_tokens += gained
            if wait:
                continue  # an earlier request is evaluating the same prefix: copy it when it is there
            held = len(r.seq.tokens)
            rest = r.stream.prompt[held:]
            nxt = next((p for p in r.points if p > held), len(r.stream.prompt))  # a checkpoint is taken there
            chunk = rest[:min(cap, nxt - held)]
            st = r.stream.stats
            if st.image_tokens or st.audio_tokens:  # a feed is all text or all media positions (separate decodes)
                media = self._caps.media
                assert media is not None  # the prompt holds media: the stream checked the projector
                img = is_image_token(chunk[0])
                cut = next((i for i, t in enumerate(chunk) if is_image_token(t) != img), len(chunk))
                chunk = chunk[:cut]
                if img and media.media_whole:  # one whole image per feed (non-causal attention over it)
                    span = media.media_span(rest)
                    if span > src.n_batch:
                        self._end(r, "error", error=BackendError(
                            f"An image takes {span} positions, more than one step evaluates ({src.n_batch})."))
                        continue
                    if span > room:
                        continue  # a later step has room for all of it
                    chunk = rest[:span]
                if img:
                    try:
                        work = media.encode_images(chunk)  # the vision tower, only for images not encoded before
                    except Exception as e:  # noqa: BLE001 - a bad image ends only its own request
                        self._end(r, "error", error=e)
                        continue
                    st.images_encoded += work.images
                    st.image_encode_duration += work.ns
                    st.audio_chunks_encoded += work.audio
                    st.audio_encode_duration += work.audio_ns
            feeds.append(Feed(r.seq.id, chunk, self._positions(r.seq.tokens), 1 if len(chunk) == len(rest) else 0))
            owners.append((r, _PREFILL, []))
            cap -= len(chunk)
            room -= len(chunk)
        if not feeds:
            return
        rows = self._evaluate(feeds, owners)
        if rows is None:
            return
        step_ns = time.perf_counter_ns() - t_step
        c = self._counters
        c.steps += 1
        for f, (r, kind, _) in zip(feeds, owners, strict=True):
            assert r.seq is not None
            r.seq.tokens.extend(f.tokens)
            c.batched_tokens += len(f.tokens)
            if kind is _PREFILL:
                c.prompt_tokens_evaluated += len(f.tokens)
                if r.points and len(r.seq.tokens) in r.points:
                    self.pool.checkpoint(r.seq)
        if self._spec is not None:  # a drafter that reads the target's hidden states (MTP) takes them now
            self._spec.observe(feeds, [r.seq.tokens if r.seq is not None else [] for r, _, _ in owners])
        judged: list[tuple[int, int, int]] = []  # (proposed, accepted, emitted) of the decoding sequences
        for f, (r, kind, drafts), out_rows in zip(feeds, owners, rows, strict=True):
            if r not in self._active or not out_rows:
                continue
            try:
                verdict = self._sample(r, kind, drafts, f, out_rows)
                if kind is _DECODE:
                    judged.append(verdict)
            except Exception as e:  # noqa: BLE001 - one sequence failing ends only its stream
                log.warning("a request on %s failed: %s", self.name, e, exc_info=log.isEnabledFor(logging.DEBUG))
                self._end(r, "error", error=e)
        if self._spec is not None and ctl is not None and judged and all(kind is _DECODE for _, kind, _ in owners):
            self._spec.record(ctl, proposed=sum(j[0] for j in judged), accepted=sum(j[1] for j in judged),
                              emitted=sum(j[2] for j in judged), ns=step_ns, overhead_ns=catchup,
                              streams=len(judged), rejected=sum(1 for j in judged if j[1] < j[0]))

    def _evaluate(self, feeds: list[Feed], owners: list[tuple[Slot, SlotState, list[int]]]) -> list[list[int]] | None:
        """Evaluate, freeing idle sequences (LRU) or deferring prompt chunks while the pool is full."""
        src = self.source
        while True:
            try:
                return src.evaluate(feeds)
            except PoolFullError:
                if self.pool.make_room():
                    continue
                keep = [i for i, (_, kind, _) in enumerate(owners) if kind is _DECODE]
                if len(keep) < len(feeds) and keep:  # prompts wait; the streams in flight go on
                    feeds[:] = [feeds[i] for i in keep]
                    owners[:] = [owners[i] for i in keep]
                    continue
                # nothing else to free: the longest request gives way with a clear error
                victim = max(self._active, key=lambda r: len(r.seq.tokens) if r.seq else 0)
                self._end(victim, "error", error=BackendError(
                    "The KV cache is full: this request does not fit beside the others; retry, or load the model "
                    "with a larger context (num_ctx) or fewer parallel slots (num_parallel)."))
                return None
            except Exception as e:  # noqa: BLE001 - the step failed: its requests end, the loop goes on
                log.warning("evaluation failed on %s: %s", self.name, e)
                for r, _, _ in owners:
                    self._end(r, "error", error=e)
                return None

    def _sample(self, r: Slot, kind: SlotState, drafts: list[int], f: Feed,
                out_rows: list[int]) -> tuple[int, int, int]:
        """Sample ``r``'s rows, verify its drafts, emit; (drafts proposed, accepted, tokens emitted)."""
        src = self.source
        sampler = r.sampler
        assert sampler is not None and r.seq is not None
        want_lp = r.stream.wants_logprobs
        toks: list[int] = []
        lps: list[Any] = []
        for j, row in enumerate(out_rows):
            lg = src.logits(row) if want_lp or (kind is _PREFILL and j == len(out_rows) - 1) else None
            tok = sampler.sample(row)
            toks.append(tok)
            lps.append(r.stream.logprob(lg, tok) if want_lp else None)
            if kind is _PREFILL and lg is not None:
                r.seq.prompt_logits = (len(r.stream.prompt), lg)
            if j >= len(drafts) or tok != drafts[j] or src.is_eog(tok):
                break
        if drafts:
            accepted = len(toks) - 1
            r.stream.stats.draft_proposed += len(drafts)
            r.stream.stats.draft_accepted += accepted
            self._counters.draft_proposed += len(drafts)
            self._counters.draft_accepted += accepted
            self.pool.trim(r.seq, len(r.seq.tokens) - len(f.tokens) + 1 + accepted)
        self._emit(r, toks, lps)
        return len(drafts), len(toks) - 1 if drafts else 0, len(toks)

    def _emit(self, r: Slot, toks: list[int], lps: list[Any]) -> None:
        """Feed sampled tokens to the request's stream; end it when it is complete."""
        stream = r.stream
        for tok, lp in zip(toks, lps, strict=True):
            for ev in stream.push(tok, lp):
                r.channel.put(ev)
            self._counters.generated_tokens += 1
            if stream.finish is not None:
                break
        if stream.finish is None:
            r.decoded(toks[-1])
        if stream.finish is None and r.seq is not None and len(r.seq.tokens) + 1 >= self.source.n_ctx:
            stream.finish = "length"  # the sequence's context is full
        if stream.finish is not None:
            self._end(r, stream.finish)

    def _end(self, r: Slot, reason: Any, error: BaseException | None = None) -> None:
        """End ``r`` (finished, cancelled or failed). Its sequence stays as an idle prefix whatever the reason
        (the evaluated prompt is the valuable part: the next request with the same system prompt copies it),
        and its long prefixes are owed to the prompt cache on disk (copied out later, see the module's step 5)."""
        if r in self._active:
            self._active.remove(r)
        r.finish()
        seq = r.seq
        if seq is not None:
            self.pool.release(seq, failed=error is not None)
            r.stream.stats.context_used = len(seq.tokens)
        if r.sampler is not None:
            r.sampler.close()
            r.sampler = None
        if error is not None:  # the consumer gets the exception after what was already sent
            if not isinstance(error, BackendError):
                error = BackendError(f"The model failed while generating: {error}")
            r.channel.fail(error)
        else:
            for ev in r.stream.close(reason):
                r.channel.put(ev)
            r.channel.close()
        if seq is not None:  # no copy now: the next request (the next turn, sent at once) never waits for it
            self.pool.owe_prefixes(seq, r.stream.prompt, r.stream.cache_points)


__all__ = ["LoadedModel", "LoopMetrics"]
