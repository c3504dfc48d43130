"""The thread half of a loaded model (:class:`backends.core.loop.LoadedModel` is the handle): the decode thread's loop,
its load and shutdown, admission, the step (gather, evaluate, sample, emit, end) and the jobs other threads queue
on it (:meth:`Scheduler.call`). The steps are described in :mod:`backends.core.loop`."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from backends.contract.errors import BackendError, PoolFullError, UnsupportedError
from backends.contract.media import is_image_token
from backends.contract.metrics import LoopMetrics
from backends.contract.source import Capabilities, Feed, TokenSource, positions_of
from backends.contract.specs import LoadSpec, ToolCallFormat
from backends.core._speculative import SpecController
from backends.core.drafting import Speculation, open_with_draft
from backends.core.kvpool import KVPool
from backends.core.prompt_cache import PromptCache, PromptCacheSpec
from backends.core.slot import Slot, SlotState

log = logging.getLogger("backends.core.loop")
T = TypeVar("T")

SETTLE_MIN = 2  # decoding streams from which a step lets their consumers finish first (Scheduler._settle)
SETTLE_MAX_NS = 4_000_000  # how long a step waits for them at most
_PREFILL, _READY, _DECODE = SlotState.PREFILL, SlotState.READY, SlotState.DECODE  # globals: enum lookups cost more


class Scheduler:
    """The state of a loaded model's decode thread and what runs on it; :class:`backends.core.loop.LoadedModel` sets
    the state up and starts the thread (every attribute below is set in its ``__init__``)."""

    spec: LoadSpec
    name: str
    slots: int
    prefill_chunk: int
    _source_class: type[TokenSource]
    _source: TokenSource | None
    _caps: Capabilities
    _positions: Callable[[Sequence[int]], int]
    _spec: Speculation | None  # the drafter and its controllers, with a draft
    _pool: KVPool | None
    _fills_cpu: bool  # the source's evaluation keeps every core busy: consumers settle between steps
    _incoming: deque[Slot]
    _jobs: queue.SimpleQueue[Callable[[], None]]
    _wake: threading.Condition
    _active: list[Slot]
    _closing: bool
    _abandoned: bool  # its source died (on_fatal): the thread may be stuck in C for good
    _counters: LoopMetrics
    _load_error: BaseException | None
    _pcache_spec: PromptCacheSpec | None
    _before_load: Callable[[], None] | None
    _ready: threading.Event
    _thread: threading.Thread

    @property
    def source(self) -> TokenSource:
        assert self._source is not None
        return self._source

    @property
    def pool(self) -> KVPool:
        """The KV pool's sequences and bookkeeping (touch it on the loop thread only: through :meth:`call`)."""
        assert self._pool is not None
        return self._pool

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

    @property
    def prompt_cache(self) -> PromptCache | None:
        """The prompt cache on disk (None when off, or when this backend cannot save sequence states)."""
        return self._pool.prompt_cache if self._pool is not None else None

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
            self._fills_cpu = src.fills_cpu
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
        if self._fills_cpu and len(decoding) >= SETTLE_MIN:
            self._settle()
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

    def _settle(self) -> None:
        """Let the consumers finish with the last step's tokens before the next evaluation, on a source whose
        evaluation fills the CPU and with ``SETTLE_MIN`` streams or more (``SETTLE_MAX_NS`` at most in all).
        Work on another thread during an evaluation (the server turning a token into JSON and writing it, ~0.1 ms)
        preempts one of llama.cpp's threads while the others wait for it at their next barrier: on 2 cores, 1 ms of
        it stretched a step of 8 streams by 3-8 ms; between the steps it costs what it takes. A consumer that does
        not keep up (a slow client) is not waited for again until it has (benchmarks/README.md, issue 47)."""
        t0 = time.perf_counter_ns()
        deadline = t0 + SETTLE_MAX_NS
        for r in self._active:
            if r.lagging:
                r.lagging = not r.channel.settle(0)
            elif not r.channel.settle(max(0, deadline - time.perf_counter_ns()) / 1e9):
                r.lagging = True
        self._counters.consumer_wait_ns += time.perf_counter_ns() - t0

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


__all__ = ["Scheduler"]
