"""One decode loop per loaded model: many sequences, one batched evaluation per step, one thread.

:class:`LoadedModel` owns a :class:`~backends.base.TokenSource` on a thread of its own (llama.cpp's CPU
threads belong to the thread that calls it; MLX streams are thread-local), made and closed there too.
Requests arrive through :meth:`LoadedModel.submit` and leave as a :class:`~backends.channel.Channel` of
events. Each step of the loop:

1. admits waiting requests while a slot is free: renders and fits the prompt
   (:class:`~backends.stream.RequestStream`), picks a KV sequence — the one whose cached tokens share
   the longest prefix with the prompt; a prefix held by another sequence (a shared system prompt) is
   copied (``seq_cp``) instead of evaluated again;
2. gathers one token from every decoding sequence (plus drafted tokens when speculative decoding is on
   and only one sequence decodes), then chunks of pending prompts under the step's token budget
   (chunked prefill: a long prompt never stalls the streams in flight);
3. runs one ``evaluate`` for all of them; when the pool is full it frees the least recently used idle
   sequences and retries, and a prompt that still does not fit waits;
4. samples each sequence with its own sampler, verifies drafts, feeds the tokens to each request's
   stream (stops, UTF-8, tools, thinking, limits) and sends the events;
5. ends finished, cancelled and failed requests at once: their slot is free the same step, the cells of
   a cancelled or failed sequence are dropped, a finished sequence's cells stay as an idle prefix for
   the next request until the pool needs them (least recently used first); while several requests run
   (or one beside 512+ idle tokens), idle sequences are parked in host memory instead (attention spans
   every cell up to the highest in use) and copied back when their conversation returns.

Speculative decoding is a step policy: while exactly one sequence decodes (and no grammar constrains
it), a draft (a second model with the same vocabulary, or prompt lookup) proposes tokens that are
verified in the same evaluation; with several sequences decoding, drafting pauses (the batch already
fills the machine). An adaptive controller switches drafting off where it does not pay.

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
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from backends.base import (
    BackendError,
    Event,
    Feed,
    GenerateRequest,
    LoadSpec,
    ModelInfo,
    PoolFullError,
    Sampler,
    Sampling,
    TokenSource,
    UnsupportedError,
)
from backends.channel import Channel
from backends.prompt_cache import PromptCache, PromptCacheSpec
from backends.stream import RequestStream

log = logging.getLogger("backends.loop")
T = TypeVar("T")

JOIN_MIN = 64  # shared prompt tokens worth waiting for another request's prefill (half of it: worth a copy)
DEFAULT_PREFILL_CHUNK = 128  # prompt tokens per step while other sequences decode
PARK_ALONE = 512  # idle tokens in the pool that a request running alone parks (two of llama.cpp's 256-cell steps)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists.

    >>> common_prefix([1, 2, 3], [1, 2, 4, 5])
    2
    """
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# ------------------------------------------------------------------------------------------ state


@dataclass
class _Seq:
    """One KV sequence id and what its cells hold (positions ``0 .. len(tokens)-1``)."""

    id: int
    tokens: list[int] = field(default_factory=list)
    owner: _Req | None = None
    last_used: float = 0.0
    prompt_logits: tuple[int, Any] | None = None  # (prompt length, logits after it) for exact repeats
    parked: bytes | None = None  # its KV state, moved to host memory while other sequences decode (no cells)

    def in_pool(self) -> bool:
        """Whether its tokens are in the pool's cells (an idle sequence may be parked in host memory)."""
        return bool(self.tokens) and self.parked is None


@dataclass
class _Req:
    stream: RequestStream
    channel: Channel[Event]
    t_submit: int
    seq: _Seq | None = None
    sampler: Sampler | None = None
    last: int | None = None  # sampled, sent, not yet evaluated
    saved: Any = None  # logits to sample the first token from (prompt fully cached)
    admitted: int = 0  # ns
    no_join: bool = False  # the backend cannot copy cells (recurrent memory): never wait for another prefill


@dataclass
class LoopMetrics:
    """Counters since load, and gauges now (a snapshot; see :meth:`LoadedModel.metrics`)."""

    slots: int = 0
    slots_busy: int = 0
    waiting: int = 0
    kv_cells: int = 0  # the pool
    kv_tokens_active: int = 0  # tokens held by sequences of running requests
    kv_tokens_idle: int = 0  # tokens kept in the pool by idle sequences for reuse
    kv_tokens_parked: int = 0  # tokens of idle sequences parked in host memory (restored on reuse)
    kv_parked_bytes: int = 0
    prompt_tokens_evaluated: int = 0
    prompt_tokens_cached: int = 0  # reused from the pool instead of evaluated (copied prefixes included)
    prompt_tokens_copied: int = 0  # of those, copied from another sequence (seq_cp)
    generated_tokens: int = 0
    draft_proposed: int = 0
    draft_accepted: int = 0
    steps: int = 0
    batched_tokens: int = 0  # tokens evaluated over all steps
    evictions: int = 0  # idle sequences dropped to make room
    requests: int = 0
    drafting: str | None = None  # None, or the controller's state
    prompt_cache_entries: int = 0  # on disk (the model's directory)
    prompt_cache_bytes: int = 0
    prompt_cache_hits: int = 0
    prompt_cache_misses: int = 0
    prompt_tokens_restored: int = 0  # prompt tokens restored from disk instead of evaluated


# ------------------------------------------------------------------------------------------ drafts


class _NgramDrafter:
    """Prompt lookup: the tokens that followed the last occurrence of the current n-gram."""

    name = "ngram"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.catchup_ns = 0

    def propose(self, history: list[int], k: int, max_catchup: int | None = None) -> list[int]:
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(history) <= n:
                continue
            tail = history[-n:]
            for i in range(len(history) - n - 1, -1, -1):
                if history[i : i + n] == tail:
                    return history[i + n : i + n + k]
        return []

    def close(self) -> None:
        pass


class _ModelDrafter:
    """A second, smaller model proposes tokens greedily; its one sequence follows the target's history
    (the common prefix is kept, only new tokens are evaluated).

    ``max_catchup`` bounds that catch-up: with more unseen tokens pending (the prompt, or a stretch decoded
    plainly while drafting was off), only the last ``max_catchup`` are evaluated and the older ones skipped.
    The draft's context then has a hole, which costs it some foresight but keeps a probe cheap; the holes
    are remembered (where, in the draft's own positions, and how many target tokens were skipped), so later
    calls map the target's sequence onto the draft's cache; a history that differs before a hole drops it.
    ``catchup_ns`` tells the controller what the last call spent catching up."""

    def __init__(self, source: TokenSource, p_min: float = 0.0):
        self.source = source
        self.name = source.spec.model_path
        self.tokens: list[int] = []  # what the draft's sequence holds (the target's history minus the holes)
        self.p_min = p_min
        self.catchup_ns = self.catchup_tokens = 0
        self._holes: list[tuple[int, int]] = []
        self._greedy = source.sampler(Sampling(temperature=0, repeat_penalty=1.0), None)
        try:  # the first evaluation of a context allocates its buffers: at load, not in the first probe
            source.evaluate([Feed(0, source.prompt_tokens("")[:1] or [0], 0, 1)])
            source.seq_rm(0)
        except Exception:  # noqa: BLE001 - a warm-up only
            pass

    def _eval(self, toks: list[int], outputs: int) -> list[int]:
        rows: list[int] = []
        step = self.source.n_batch
        for i in range(0, len(toks), step):
            chunk = toks[i : i + step]
            last = i + step >= len(toks)
            rows = self.source.evaluate([Feed(0, chunk, len(self.tokens), outputs if last else 0)])[0]
            self.tokens.extend(chunk)
        return rows

    def _view(self, history: list[int]) -> list[int]:
        for at, skipped in self._holes:
            if len(history) <= at:
                break
            history = history[:at] + history[at + skipped :]
        return history

    def propose(self, history: list[int], k: int, max_catchup: int | None = None) -> list[int]:
        self.catchup_ns = self.catchup_tokens = 0
        view = self._view(history)
        k = min(k, self.source.n_ctx - len(view) - 1)
        if k <= 0 or not view:
            return []
        keep = common_prefix(self.tokens, view)
        if any(at >= keep for at, _ in self._holes):  # the history changed before a hole: forget it
            self._holes = [h for h in self._holes if h[0] < keep]
            view = self._view(history)
        if keep >= len(view):
            keep = len(view) - 1  # evaluate the last token again for fresh logits
        if not self.source.seq_rm(0, keep):
            self.source.seq_rm(0)
            keep, self._holes, view = 0, [], list(history)
        del self.tokens[keep:]
        new = view[keep:]
        if max_catchup is not None and len(new) > max(int(max_catchup), 2):
            skip = len(new) - int(max_catchup)
            self._holes.append((len(self.tokens), skip))
            new = new[skip:]
        t0 = time.perf_counter_ns()
        rows = self._eval(new, 1)
        if len(new) > 2:  # more than a normal step's one or two tokens: catching up
            self.catchup_ns, self.catchup_tokens = time.perf_counter_ns() - t0, len(new)
        out: list[int] = []
        while True:
            if self.p_min > 0 and not self._confident(rows[-1]):
                break
            tok = self._greedy.sample(rows[-1])
            out.append(tok)
            if len(out) >= k:
                break
            rows = self._eval([tok], 1)
        return out

    def _confident(self, row: int) -> bool:
        import numpy as np

        x = np.asarray(self.source.logits(row), dtype=np.float64)
        return bool(1.0 / np.exp(x - x.max()).sum() >= self.p_min)

    def close(self) -> None:
        self._greedy.close()
        self.source.close()


def vocab_problem(target: TokenSource, draft: TokenSource) -> str | None:
    """Why ``draft`` cannot draft for ``target`` (one sentence), or None when every token id means the same
    bytes to both (sizes may differ by padding: up to 128 ids)."""
    nt, nd = target.info.n_vocab, draft.info.n_vocab
    if abs(nt - nd) > 128:
        return (f"The draft model's vocabulary ({nd} tokens) differs from the model's ({nt}); "
                "a draft must share the tokenizer.")
    for i in range(min(nt, nd)):
        if target.piece(i) != draft.piece(i):
            return (f"The draft model tokenizes differently from the model (token {i} differs); "
                    "a draft must share the tokenizer.")
    return None


# ------------------------------------------------------------------------------------------ the loop

_live: weakref.WeakSet[LoadedModel] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Close every model still loaded before the interpreter finalizes (native threads and objects
    must not be torn down by the garbage collector at exit)."""
    for m in list(_live):
        try:
            m.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


class LoadedModel:
    """A model loaded on its own decode thread, serving up to ``spec.n_seq`` requests at once.

        >>> from backends.registry import load                                   # doctest: +SKIP
        >>> m = load("llamacpp", LoadSpec("smollm2.gguf", n_ctx=2048, n_seq=4))  # doctest: +SKIP
        >>> for ev in m.generate(GenerateRequest(prompt="Once upon")):           # doctest: +SKIP
        ...     print(ev)
        >>> m.close()                                                            # doctest: +SKIP

    ``generate`` (sync) and ``agenerate`` (asyncio) stream events; leaving either early cancels the
    request at the next step. ``call(fn)`` runs ``fn(source)`` on the loop thread between steps.
    """

    def __init__(self, source_class: type[TokenSource], spec: LoadSpec, *, name: str = "model",
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, prompt_cache: PromptCacheSpec | None = None,
                 before_load: Callable[[], None] | None = None):
        self.spec = spec
        self.name = name
        self.slots = max(1, spec.n_seq)
        self.prefill_chunk = max(1, int(spec.extra.get("prefill_chunk", prefill_chunk)))
        self._source_class = source_class
        self._source: TokenSource | None = None
        self._drafter: _NgramDrafter | _ModelDrafter | None = None
        self._controller: Any = None
        self._incoming: deque[_Req] = deque()
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Condition()
        self._active: list[_Req] = []
        self._seqs: list[_Seq] = []
        self._closing = False
        self._closed = threading.Event()
        self._counters = LoopMetrics()
        self._load_error: BaseException | None = None
        self._pcache_spec = prompt_cache
        self._pcache: PromptCache | None = None
        self._can_park = False  # set at load: a batched pool that can save sequence states
        self._parked_tokens = 0
        self._park_budget = 0  # tokens parked at most: half the pool
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
        req = _Req(RequestStream(request, t), ch, t)
        with self._wake:
            self._incoming.append(req)
            self._wake.notify_all()
        return ch

    def generate(self, request: GenerateRequest, cancel: threading.Event | None = None) -> Iterator[Event]:
        """Stream events for ``request`` (the last is :class:`~backends.base.Done`)."""
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
        return self.call(lambda s: s.embed(texts))

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        return self.call(lambda s: s.tokenize(text, special=special))

    def detokenize(self, tokens: list[int]) -> str:
        return self.call(lambda s: s.detokenize(tokens))

    @property
    def controller(self) -> Any:
        """The speculative-decoding controller (None without a draft)."""
        return self._controller

    @property
    def busy(self) -> int:
        """Requests running or waiting now."""
        return len(self._active) + len(self._incoming)

    def metrics(self) -> LoopMetrics:
        m = LoopMetrics(**vars(self._counters))
        m.slots = self.slots
        m.slots_busy = len(self._active)
        m.waiting = len(self._incoming)
        m.kv_cells = self.source.info.kv_cells if self._source is not None else 0
        for s in list(self._seqs):
            if s.owner is not None:
                m.kv_tokens_active += len(s.tokens)
            elif s.parked is not None:
                m.kv_tokens_parked += len(s.tokens)
                m.kv_parked_bytes += len(s.parked)
            else:
                m.kv_tokens_idle += len(s.tokens)
        if self._controller is not None:
            m.drafting = "on" if self._controller.drafting else "paused (not paying)"
        if self._pcache is not None:
            st = self._pcache.stats
            m.prompt_cache_entries, m.prompt_cache_bytes = st.entries, st.bytes
            m.prompt_cache_hits, m.prompt_cache_misses = st.hits, st.misses
        return m

    @property
    def prompt_cache(self) -> PromptCache | None:
        """The prompt cache on disk (None when off, or when this backend cannot save sequence states)."""
        return self._pcache

    def close(self) -> None:
        """Cancel what is running, free the model on its thread and join the thread. Idempotent."""
        with self._wake:
            self._closing = True
            self._wake.notify_all()
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
        try:
            while True:
                self._run_jobs()
                with self._wake:
                    if self._closing:
                        break
                    if not self._active and not self._incoming:
                        self._wake.wait(0.5)
                        continue
                self._admit()
                if self._active:
                    self._step()
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
        spec = self.spec
        self._source_class.on_thread()
        if self._before_load is not None:  # e.g. a first-use conversion, on the thread that will run the model
            self._before_load()
        src = self._source_class(spec)
        self._source = src
        try:
            self._seqs = [_Seq(i) for i in range(src.n_seq_ids)]
            d = spec.draft
            if d is not None:
                self._setup_draft(src, d)
            pc, state_key = self._pcache_spec, src.state_key()
            self._can_park = src.shared_pool and state_key is not None and not spec.extra.get("no_park")
            self._park_budget = max(1, src.info.kv_cells // 2)
            if pc is not None and pc.max_bytes > 0 and state_key is not None:
                self._pcache = PromptCache(pc.root, key=f"{pc.model_key} {state_key}", max_bytes=pc.max_bytes,
                                           min_tokens=pc.min_tokens, budget_root=pc.budget_root)
        except BaseException:
            src.close()
            raise

    def _setup_draft(self, src: TokenSource, d: Any) -> None:
        from backends._speculative import SpecController

        if not src.can_rewind():
            raise UnsupportedError(
                f"Speculative decoding is not available for this {src.info.architecture} model: its cache "
                "(recurrent/hybrid memory or a sliding window) is not trimmable, so rejected draft tokens cannot be "
                "rolled back; use --draft none.")
        if d.kind == "ngram":
            self._drafter = _NgramDrafter()
            src.info.draft = "ngram"
        elif d.kind == "model":
            if not d.path:
                raise UnsupportedError("A draft model needs a path to its file.")
            dspec = LoadSpec(model_path=d.path, n_ctx=src.n_ctx, n_seq=1, n_gpu_layers=d.n_gpu_layers,
                             n_threads=self.spec.n_threads, n_batch=self.spec.n_batch, verbose=self.spec.verbose,
                             extra={k: v for k, v in self.spec.extra.items() if k in ("use_mmap",)})
            try:
                dsrc = self._source_class(dspec)
            except BackendError as e:
                raise type(e)(f"The draft model could not be loaded: {e}") from None
            problem = vocab_problem(src, dsrc)
            if problem is None and not dsrc.can_rewind():
                problem = ("The draft model's cache (recurrent/hybrid or sliding window) cannot roll back "
                           "rejected tokens.")
            if problem:
                dsrc.close()
                raise UnsupportedError(problem)
            self._drafter = _ModelDrafter(dsrc, p_min=float(self.spec.extra.get("draft_p_min", 0.0)))
            src.info.draft = d.path
            src.info.size_bytes += dsrc.info.size_bytes
        else:
            raise UnsupportedError(f"Unknown draft kind {d.kind!r}; use a model or ngram.")
        # draft_always: draft every step whatever the timings say (tests of exactness)
        self._controller = SpecController(max(1, d.num_draft), margin=0.0 if self.spec.extra.get("draft_always")
                                          else 0.97)

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
        try:
            if self._pcache is not None:
                self._pcache.close()  # the entries being written are finished, not lost
            if self._drafter is not None:
                self._drafter.close()
            if self._source is not None:
                self._source.close()
        finally:
            self._closed.set()

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
            try:
                prompt = req.stream.prepare(src)
                req.sampler = src.sampler(req.stream.request.sampling, req.stream.request.format)
            except BackendError as e:
                req.channel.fail(e)
                continue
            except Exception as e:  # noqa: BLE001 - a template or tokenizer crash: one sentence
                req.channel.fail(BackendError(f"The model could not prepare this request: {e}"))
                continue
            req.admitted = time.perf_counter_ns()
            req.stream.stats.queue_duration = req.admitted - req.t_submit
            self._place(req, prompt)
            self._active.append(req)
            self._counters.requests += 1

    @staticmethod
    def _close_cancelled(r: _Req) -> None:
        """End a request that was cancelled before it was admitted (it holds no sequence yet)."""
        for ev in r.stream.close("cancelled"):
            r.channel.put(ev)
        r.channel.close()

    def _victim(self) -> _Seq | None:
        """The sequence a new request may take: an empty one, else the idle one used least recently."""
        empty = [s for s in self._seqs if s.owner is None and not s.tokens]
        if empty:
            return empty[0]
        idle = [s for s in self._seqs if s.owner is None]
        return min(idle, key=lambda s: s.last_used) if idle else None

    def _free_seq(self) -> _Seq | None:
        """An empty sequence id: an empty one, else the least recently used idle one, emptied."""
        victim = self._victim()
        if victim is not None and victim.tokens:
            self._drop(victim)
            self._counters.evictions += 1
        return victim

    def _drop(self, s: _Seq) -> None:
        if s.parked is None:
            self.source.seq_rm(s.id)
        self._unpark_forget(s)
        s.tokens = []
        s.prompt_logits = None

    # ------------------------------------------------------------------ parking idle KV in host memory

    def _park_idle(self) -> None:
        """Move idle sequences' KV out of the pool while several requests run. In a unified pool every step's
        attention spans the cells up to the highest one in use, so cells kept for reuse cost each decoding
        row some work (~15% of throughput at 8 streams with 2,500 kept cells on a 135M model). Parked, a
        sequence's state waits in host memory (at most half the pool's worth of tokens, least recently used
        out first) and is loaded back by a copy when its conversation returns. A request running alone parks
        the idle sequences only once they hold ``PARK_ALONE`` tokens or more (a single stream beside 1,000
        idle cells decodes ~20% slower). Loaded back, a sequence's cells may sit elsewhere in the pool, and
        attention then sums in another order: the last bits can differ from what it would have computed."""
        src = self.source
        budget = self._park_budget
        for s in sorted((s for s in self._seqs if s.owner is None and s.in_pool()), key=lambda s: s.last_used,
                        reverse=True):
            n = len(s.tokens)
            if n > budget:
                self._drop(s)
                continue
            while self._parked_tokens + n > budget:
                old = min((p for p in self._seqs if p.parked is not None), key=lambda p: p.last_used)
                self._drop(old)
                self._counters.evictions += 1
            try:
                data = src.state_save(s.id)
            except Exception as e:  # noqa: BLE001 - a state that cannot be taken: the cells just go
                log.debug("could not park sequence %d: %s", s.id, e)
                self._drop(s)
                continue
            src.seq_rm(s.id)
            s.parked = data
            self._parked_tokens += n

    def _idle_in_pool(self) -> int:
        return sum(len(s.tokens) for s in self._seqs if s.owner is None and s.parked is None)

    def _unpark_forget(self, s: _Seq) -> None:
        if s.parked is not None:
            s.parked = None
            self._parked_tokens -= len(s.tokens)

    def _unpark(self, s: _Seq) -> bool:
        """Load a parked sequence back into the pool; False (and the sequence empty) when it does not fit."""
        data = s.parked
        assert data is not None
        self._unpark_forget(s)
        try:
            ok = self.source.state_load(s.id, data)
        except Exception as e:  # noqa: BLE001 - treated as a miss
            log.debug("could not restore parked sequence %d: %s", s.id, e)
            ok = False
        if not ok:
            self.source.seq_rm(s.id)
            s.tokens = []
            s.prompt_logits = None
        return ok

    def _place(self, req: _Req, prompt: list[int]) -> None:
        """Give ``req`` a sequence and reuse the longest cached prefix of its prompt."""
        src = self.source
        while True:
            best, best_n = None, 0
            for s in self._seqs:
                n = common_prefix(s.tokens, prompt)
                if n > best_n or (n == best_n and best is not None and n > 0 and best.owner is not None
                                  and s.owner is None):
                    best, best_n = s, n
            if best is None or best.parked is None or self._unpark(best):
                break  # (a parked sequence that no longer fits the pool is emptied: look again)
        seq: _Seq | None = None
        copied = 0
        if best is not None and best.owner is None and (best_n == len(best.tokens) or best_n == len(prompt)):
            seq = best  # the same conversation continuing (or the same prompt again)
        elif best is not None and best_n > 0:
            # a shared prefix (a system prompt): copy it into the sequence this request may take, which is
            # an empty one, else the idle one used least recently (that may be ``best`` itself: then trim it)
            target = self._victim()
            if target is best:
                seq = best
            elif target is not None:
                if target.tokens:
                    self._counters.evictions += 1
                self._unpark_forget(target)
                ok = src.seq_cp(best.id, target.id, best_n)  # empties the target first
                target.tokens = list(best.tokens[:best_n]) if ok else []
                target.prompt_logits = None
                seq, copied = target, (best_n if ok else 0)
        if seq is None:
            seq = self._free_seq()
            if seq is None:  # cannot happen: there are more sequence ids than slots
                raise BackendError("No free sequence in the KV pool.")
        seq.owner = req
        req.seq = seq
        keep = common_prefix(seq.tokens, prompt)
        saved = seq.prompt_logits
        if keep == len(prompt) and saved is not None and saved[0] == len(prompt):
            req.saved = saved[1]  # exact repeat: sample from the saved row
        elif keep >= len(prompt):
            keep = len(prompt) - 1  # the last prompt token is evaluated again for its logits
        if keep < len(seq.tokens):
            if not src.seq_rm(seq.id, keep):
                src.seq_rm(seq.id)  # recurrent memory: no partial removal
                keep = 0
            del seq.tokens[keep:]
        if not (saved is not None and saved[0] <= keep):
            seq.prompt_logits = None
        if req.saved is None and self._pcache is not None and self._pcache.wants(len(prompt)):
            keep = self._restore(seq, prompt, keep, req)
        req.stream.stats.prompt_cached_tokens = keep
        self._counters.prompt_tokens_cached += keep
        self._counters.prompt_tokens_copied += min(copied, keep)

    def _restore(self, seq: _Seq, prompt: list[int], keep: int, req: _Req) -> int:
        """Load the longest prefix of ``prompt`` saved on disk into ``seq`` when it beats ``keep``."""
        assert self._pcache is not None
        n, data = self._pcache.lookup(prompt)
        if data is None or n <= keep:
            return keep
        if not self.source.state_load(seq.id, data):
            self._pcache.discard(self._pcache._path(prompt[:n]), "the backend refused it")
            self.source.seq_rm(seq.id)
            seq.tokens = []
            seq.prompt_logits = None
            return 0
        seq.tokens = list(prompt[:n])
        seq.prompt_logits = None
        keep = min(n, len(prompt) - 1)  # logits are not saved: the last prompt token is evaluated again
        if keep < n:
            self.source.seq_rm(seq.id, keep)
            del seq.tokens[keep:]
        req.stream.stats.prompt_restored_tokens = keep
        self._counters.prompt_tokens_restored += keep
        self._pcache.stats.restored_tokens += keep
        return keep

    def _save_prefixes(self, r: _Req) -> None:
        """After a request ends: save the KV state of its long prefixes (where the system prompt ends, and
        the whole prompt: the next turn of a chat starts with it) unless the disk already has them. The
        copy is taken here, on the loop thread, once the request's answer is complete (about 50 ms for 2,000
        tokens of an f16 cache on a small model: the other streams wait one step that long); the file is written
        in the background."""
        pc, seq = self._pcache, r.seq
        if pc is None or seq is None:
            return
        points = sorted({n for n in (*r.stream.cache_points, len(r.stream.prompt))
                         if pc.wants(n) and n <= len(seq.tokens)})
        for n in points:
            toks = seq.tokens[:n]
            if pc.has(toks):
                continue
            tmp = next((s for s in self._seqs if s.owner is None and not s.tokens and s is not seq), None)
            if tmp is None:
                return
            try:
                if n == len(seq.tokens):
                    data = self.source.state_save(seq.id)
                elif self.source.seq_cp(seq.id, tmp.id, n):
                    data = self.source.state_save(tmp.id)
                    self.source.seq_rm(tmp.id)
                else:
                    continue
            except Exception as e:  # noqa: BLE001 - a cache that cannot be saved costs nothing but the miss
                log.warning("prompt cache: could not take the state of %d tokens: %s", n, e)
                return
            pc.save(toks, data)

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
            if r.saved is not None:
                assert r.sampler is not None
                logits, r.saved = r.saved, None
                tok = r.sampler.sample_logits(logits)
                lp = r.stream.logprob(logits, tok) if r.stream.wants_logprobs else None
                self._emit(r, [tok], [lp])
        if not self._active:
            return
        if self._can_park and (len(self._active) > 1 or self._idle_in_pool() >= PARK_ALONE):
            self._park_idle()
        budget = src.n_batch
        t_step = time.perf_counter_ns()  # the step's cost includes drafting (a draft model's catch-up too)
        catchup = 0
        feeds: list[Feed] = []
        owners: list[tuple[_Req, str, list[int]]] = []  # (request, "decode"|"prefill", drafts)
        decoding = [r for r in self._active if r.last is not None]
        spec_on = (self._drafter is not None and self._controller is not None and len(self._active) == 1
                   and len(decoding) == 1 and not decoding[0].stream.request.format)
        for r in decoding:
            assert r.seq is not None and r.last is not None
            drafts: list[int] = []
            if spec_on:
                drafts = self._propose(r)
                catchup = self._drafter.catchup_ns if self._drafter is not None else 0
            feeds.append(Feed(r.seq.id, [r.last, *drafts], len(r.seq.tokens), 1 + len(drafts)))
            owners.append((r, "decode", drafts))
            budget -= 1 + len(drafts)
        cap = budget if not decoding else min(budget, self.prefill_chunk)
        for r in self._active:
            if r.last is not None or cap <= 0:
                continue
            assert r.seq is not None
            if self._join(r):
                continue  # an earlier request is evaluating the same prefix: copy it when it is there
            rest = r.stream.prompt[len(r.seq.tokens):]
            chunk = rest[:cap]
            feeds.append(Feed(r.seq.id, chunk, len(r.seq.tokens), 1 if len(chunk) == len(rest) else 0))
            owners.append((r, "prefill", []))
            cap -= len(chunk)
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
            if kind == "prefill":
                c.prompt_tokens_evaluated += len(f.tokens)
        for f, (r, kind, drafts), out_rows in zip(feeds, owners, rows, strict=True):
            if r not in self._active or not out_rows:
                continue
            try:
                self._sample(r, kind, drafts, f, out_rows, step_ns, catchup)
            except Exception as e:  # noqa: BLE001 - one sequence failing ends only its stream
                log.warning("a request on %s failed: %s", self.name, e, exc_info=log.isEnabledFor(logging.DEBUG))
                self._end(r, "error", error=e)

    def _join(self, r: _Req) -> bool:
        """Share a prefix with the requests around ``r`` while it is still being evaluated: copy what another
        sequence already holds of ``r``'s prompt (a system prompt that an earlier request has evaluated since
        ``r`` was admitted), and return True (``r`` waits this step) while an earlier request is still
        evaluating a longer shared prefix. Four clients that send the same long system prompt at once thus
        evaluate it once, not four times side by side."""
        seq = r.seq
        assert seq is not None
        prompt = r.stream.prompt
        have, limit = len(seq.tokens), len(prompt) - 1  # the last prompt token is evaluated for its logits
        if r.no_join or limit - have < JOIN_MIN:
            return False
        for q in self._active:  # the requests admitted before r
            if q is r:
                break
            if q.seq is None or q.last is not None:
                continue
            n = min(common_prefix(q.stream.prompt, prompt), limit)
            if n - have >= JOIN_MIN and len(q.seq.tokens) < n:
                return True
        best, best_n = None, have
        for s in self._seqs:
            if s is not seq and s.in_pool():
                n = min(common_prefix(s.tokens, prompt), limit)
                if n > best_n:
                    best, best_n = s, n
        if best is not None and best_n - have >= JOIN_MIN // 2:
            if not self.source.seq_cp(best.id, seq.id, best_n):
                seq.tokens, seq.prompt_logits, r.no_join = [], None, True  # the copy emptied it
                return False
            seq.tokens, seq.prompt_logits = list(best.tokens[:best_n]), None
            gained = best_n - have
            r.stream.stats.prompt_cached_tokens += gained
            self._counters.prompt_tokens_cached += gained
            self._counters.prompt_tokens_copied += gained
        return False

    def _evaluate(self, feeds: list[Feed], owners: list[tuple[_Req, str, list[int]]]) -> list[list[int]] | None:
        """Evaluate, freeing idle sequences (LRU) or deferring prompt chunks while the pool is full."""
        src = self.source
        while True:
            try:
                return src.evaluate(feeds)
            except PoolFullError:
                idle = sorted((s for s in self._seqs if s.owner is None and s.in_pool()), key=lambda s: s.last_used)
                if idle:
                    self._drop(idle[0])
                    self._counters.evictions += 1
                    continue
                keep = [i for i, (_, kind, _) in enumerate(owners) if kind == "decode"]
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

    def _propose(self, r: _Req) -> list[int]:
        ctl, drafter = self._controller, self._drafter
        assert ctl is not None and drafter is not None and r.seq is not None and r.last is not None
        room = min(r.stream.max_new - len(r.stream.generated) - 1, self.source.n_ctx - len(r.seq.tokens) - 2)
        k = min(ctl.n_draft(), room)
        if k <= 0:
            return []
        history = [*r.seq.tokens, r.last]
        return [int(t) for t in drafter.propose(history, k, max_catchup=ctl.max_catchup())[:k]]

    def _sample(self, r: _Req, kind: str, drafts: list[int], f: Feed, out_rows: list[int], step_ns: int,
                catchup: int = 0) -> None:
        src = self.source
        sampler = r.sampler
        assert sampler is not None and r.seq is not None
        want_lp = r.stream.wants_logprobs
        toks: list[int] = []
        lps: list[Any] = []
        for j, row in enumerate(out_rows):
            lg = src.logits(row) if want_lp or (kind == "prefill" and j == len(out_rows) - 1) else None
            tok = sampler.sample(row)
            toks.append(tok)
            lps.append(r.stream.logprob(lg, tok) if want_lp else None)
            if kind == "prefill" and lg is not None:
                r.seq.prompt_logits = (len(r.stream.prompt), lg)
            if j >= len(drafts) or tok != drafts[j] or src.is_eog(tok):
                break
        if drafts:
            accepted = len(toks) - 1
            r.stream.stats.draft_proposed += len(drafts)
            r.stream.stats.draft_accepted += accepted
            self._counters.draft_proposed += len(drafts)
            self._counters.draft_accepted += accepted
            keep = f.pos + 1 + accepted
            if keep < len(r.seq.tokens):
                src.seq_rm(r.seq.id, keep)
                del r.seq.tokens[keep:]
        if kind == "decode" and self._controller is not None and len(self._active) == 1:
            self._controller.record(proposed=len(drafts), accepted=len(toks) - 1 if drafts else 0,
                                    emitted=len(toks), ns=step_ns, overhead_ns=catchup)
        self._emit(r, toks, lps)

    def _emit(self, r: _Req, toks: list[int], lps: list[Any]) -> None:
        """Feed sampled tokens to the request's stream; end it when it is complete."""
        stream = r.stream
        for tok, lp in zip(toks, lps, strict=True):
            for ev in stream.push(tok, lp):
                r.channel.put(ev)
            self._counters.generated_tokens += 1
            if stream.finish is not None:
                break
        r.last = toks[-1] if stream.finish is None else None
        if stream.finish is None and r.seq is not None and len(r.seq.tokens) + 1 >= self.source.n_ctx:
            stream.finish = "length"  # the sequence's context is full
        if stream.finish is not None:
            self._end(r, stream.finish)

    def _end(self, r: _Req, reason: Any, error: BaseException | None = None) -> None:
        if r in self._active:
            self._active.remove(r)
        seq = r.seq
        save = False
        if seq is not None:
            seq.owner = None
            seq.last_used = time.monotonic()
            if reason in ("cancelled", "error"):
                self._drop(seq)  # a stream that did not finish: its cells are freed now
            else:
                save = self._pcache is not None
            r.stream.stats.context_used = len(seq.tokens)
        if r.sampler is not None:
            r.sampler.close()
            r.sampler = None
        if error is not None:  # the consumer gets the exception after what was already sent
            if not isinstance(error, BackendError):
                error = BackendError(f"The model failed while generating: {error}")
            r.channel.fail(error)
            return
        for ev in r.stream.close(reason):
            r.channel.put(ev)
        r.channel.close()
        if save:  # after the answer is complete: the client never waits for the copy of the state
            self._save_prefixes(r)


__all__ = ["LoadedModel", "LoopMetrics", "common_prefix", "vocab_problem"]
