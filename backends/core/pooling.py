"""Pooled outputs of a loaded model: embeddings and rerank scores, evaluated in batches on its decode loop.

An **embedding model** is a GGUF with a pooling head of its own (``<arch>.pooling_type``: mean, cls, last; BERT,
nomic-bert, XLM-RoBERTa, Qwen3-Embedding, EmbeddingGemma); a **reranker** one whose pooling is ``rank`` (a
classifier head: BERT / XLM-RoBERTa cross-encoders, and Qwen3-Reranker, whose converter turns the yes/no logits
into that head and writes the prompt as the GGUF's rerank template). Both answer pooled outputs, never text. A
model without a pooling head (a chat model) still embeds: llama.cpp pools its last hidden states by their mean
in a second context on the same weights.

How a request is served (:func:`embed`, :func:`rerank`), with ``call`` the model's
:meth:`backends.core.loop.LoadedModel.call` (a job run on the decode loop's thread between two decode steps):

1. the inputs are tokenized as the model wants them (BOS / [CLS] and [SEP] / EOS; for a rerank pair, the GGUF's
   rerank template or ``[CLS] query [SEP] document``), the way llama-server does, so the numbers are llama.cpp's;
2. an input longer than the model's context is cut (keeping the closing [SEP] / EOS), or refused with
   ``truncate=False`` (:class:`~backends.contract.errors.ContextOverflowError`, one sentence naming the input);
3. the inputs are packed into batches of at most :meth:`~backends.contract.source.Pooling.pool_limits` tokens and
   sequences, and each batch is **one job** on the loop: one evaluation, each input a sequence of its own, the
   sequences cleared after it (no state is kept from one request, or one batch, to the next). Chat requests of
   the same loaded model decode between two batches, and a batch is sized by time when it runs (about 0.1 s
   while chats decode, 0.5 s otherwise), so a long rerank or embedding never stalls their streams;
4. embeddings are L2-normalised (llama-server's default); rerank scores are the raw outputs of the rank head
   (no sigmoid, as llama-server gives them).

Shortening an embedding (OpenAI's and Ollama's ``dimensions``) is :func:`shorten`: the first ``n`` values,
normalised again, which is only meaningful for a Matryoshka-trained model; whether a model is one is the
catalog's to say (the faces check it).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from backends.contract.errors import ContextOverflowError, InputTooLargeError, RequestCancelled, UnsupportedError
from backends.contract.source import Pooling, TokenSource

T = TypeVar("T")
Call = Callable[[Callable[[TokenSource], Any]], Any]  # LoadedModel.call

POOLING_TYPES = {1: "mean", 2: "cls", 3: "last", 4: "rank"}  # llama_pooling_type (0 = none, -1 = unspecified)


@dataclass
class Pooled:
    """What one embed or rerank request got: vectors (embeddings) or scores (rerank), in input order."""

    vectors: list[list[float]] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    tokens: int = 0  # tokens evaluated over all inputs (after cutting)
    truncated: list[int] = field(default_factory=list)  # indices of the inputs cut to fit the context
    batches: int = 0  # evaluations it took


def fit(tokens: list[int], limit: int, *, tail: int, truncate: bool, what: str) -> tuple[list[int], bool]:
    """``tokens`` cut to ``limit`` keeping their last ``tail`` (the closing [SEP] / EOS, a rerank template's end),
    and whether they were cut; with ``truncate=False`` an input over the limit raises :class:`ContextOverflowError`.

    >>> fit([2, 7, 8, 9, 3], 4, tail=1, truncate=True, what="input 0")
    ([2, 7, 8, 3], True)
    >>> fit([2, 7, 3], 4, tail=1, truncate=False, what="input 0")
    ([2, 7, 3], False)
    >>> fit([1, 2, 3, 4, 5, 6], 4, tail=2, truncate=True, what="input 0")
    ([1, 2, 5, 6], True)
    """
    if len(tokens) <= limit:
        return tokens, False
    if not truncate:
        raise ContextOverflowError(f"{what} has {len(tokens)} tokens but the model's context holds {limit}; shorten "
                                   "it or allow truncation.", prompt_tokens=len(tokens), n_ctx=limit)
    tail = tail if 0 < tail < limit else 0
    return tokens[:limit - tail] + (tokens[-tail:] if tail else []), True


def batches(lengths: Sequence[int], max_tokens: int, max_inputs: int) -> list[list[int]]:
    """Indices of ``lengths`` packed in order into batches of at most ``max_tokens`` tokens and ``max_inputs``
    inputs (every length is at most ``max_tokens``).

    >>> batches([3, 3, 3, 5, 1], max_tokens=6, max_inputs=8)
    [[0, 1], [2], [3, 4]]
    >>> batches([1, 1, 1], max_tokens=8, max_inputs=2)
    [[0, 1], [2]]
    """
    out: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if cur and (used + n > max_tokens or len(cur) >= max_inputs):
            out.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        out.append(cur)
    return out


def normalize(v: Sequence[float]) -> list[float]:
    """``v`` / its L2 norm (a zero vector stays zero).

    >>> normalize([3.0, 4.0])
    [0.6, 0.8]
    """
    n = math.sqrt(sum(float(x) * float(x) for x in v))
    return [float(x) / n for x in v] if n > 0 else [float(x) for x in v]


def shorten(vectors: list[list[float]], dimensions: int | None) -> list[list[float]]:
    """Matryoshka truncation: the first ``dimensions`` values of each vector, normalised again (unchanged when
    ``dimensions`` is None or not below the width).

    >>> shorten([[0.6, 0.0, 0.8]], 2)
    [[1.0, 0.0]]
    """
    if not dimensions:
        return vectors
    return [normalize(v[:dimensions]) if dimensions < len(v) else v for v in vectors]


TOKENIZE_CHUNK = 128  # inputs one job on the loop tokenizes: chat requests of the same model step between two


def _check(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise RequestCancelled("The embedding or rerank request was cancelled.")


def _tokenized(call: Call, count: int, tokens_of: Callable[[TokenSource], Callable[[int], tuple[list[int], bool]]],
               cancel: threading.Event | None, max_tokens: int, what: str) -> list[tuple[list[int], bool]]:
    """Each of ``count`` inputs tokenized and fitted (``tokens_of(source)(i)``), :data:`TOKENIZE_CHUNK` inputs a job
    on the loop, ``cancel`` checked between two; more than ``max_tokens`` in all (0: no cap) raises
    :class:`InputTooLargeError` as soon as the count passes it, before anything is evaluated."""
    out: list[tuple[list[int], bool]] = []
    total = 0
    for start in range(0, max(count, 1), TOKENIZE_CHUNK):  # one job at least: it checks the model
        _check(cancel)
        stop = min(count, start + TOKENIZE_CHUNK)

        def job(s: TokenSource, start: int = start, stop: int = stop) -> list[tuple[list[int], bool]]:
            one = tokens_of(s)
            return [one(i) for i in range(start, stop)]

        chunk = call(job)
        out += chunk
        total += sum(len(t) for t, _ in chunk)
        if max_tokens and total > max_tokens:
            more = "" if stop == count else " so far"
            raise InputTooLargeError(f"The {what} take {total:,} tokens{more}, more than the {max_tokens:,} one "
                                     "request may take; send them in smaller requests.", tokens=total,
                                     limit=max_tokens)
    return out


FIRST_BATCH_TOKENS = 32  # a model's first pooling batch, before the batches' speed is known
BATCH_SECONDS = 0.1  # what one pooling batch may take beside chat streams of the same model (their pause)
IDLE_BATCH_SECONDS = 0.5  # and with nothing else running: what a chat that comes meanwhile waits at most
Busy = Callable[[], bool]  # whether the model has requests decoding or waiting now (LoadedModel's)


@dataclass
class Pace:
    """How fast a model's pooling batches go (tokens a second, 0 while not known): kept by its loaded model across
    requests, so that the first batch of the next request is sized by time too."""

    rate: float = 0.0


def _evaluate(call: Call, inputs: list[list[int]], cancel: threading.Event | None = None,
              busy: Busy | None = None, pace: Pace | None = None) -> tuple[list[Any], int]:
    """Each input's pooled output, evaluated in batches (one job on the loop each, ``cancel`` checked between two);
    (outputs, batches). A batch takes at most what one evaluation takes
    (:meth:`~backends.contract.source.Pooling.pool_limits`) and about :data:`IDLE_BATCH_SECONDS` at the speed the
    batches before it went (``pace``), :data:`BATCH_SECONDS` while the model has chat requests (``busy()``), a whole
    input at least. Whether it is busy is asked **on the loop's thread** when the batch runs, not when it is queued:
    a chat that comes while the batch waits (or while it was sized) is admitted first and then sees only short
    batches. Without ``busy`` (a model that cannot generate: nobody waits for a step) every batch is a whole
    evaluation."""
    max_tokens, max_inputs = call(lambda s: pooler(s).pool_limits())
    out: list[Any] = [None] * len(inputs)
    pace = pace if pace is not None else Pace()  # tokens a second of the batches so far, timed on the loop

    def job(group: list[int]) -> Callable[[TokenSource], tuple[list[int], list[Any], float]]:
        def run(s: TokenSource) -> tuple[list[int], list[Any], float]:
            if busy is None:
                budget = max_tokens
            else:
                seconds = BATCH_SECONDS if busy() else IDLE_BATCH_SECONDS
                budget = int(pace.rate * seconds) if pace.rate else FIRST_BATCH_TOKENS
            lengths = [len(inputs[k]) for k in group]
            taken = [group[k] for k in batches(lengths, max(min(budget, max_tokens), lengths[0]), max_inputs)[0]]
            t0 = time.perf_counter()
            rows = pooler(s).pool([inputs[k] for k in taken])
            return taken, rows, time.perf_counter() - t0

        return run

    i = n = 0
    while i < len(inputs):
        _check(cancel)
        group = batches([len(x) for x in inputs[i:i + max_inputs]], max(max_tokens, len(inputs[i])), max_inputs)[0]
        taken, rows, took = call(job([i + k for k in group]))
        pace.rate = sum(len(inputs[k]) for k in taken) / max(took, 1e-4)
        for k, row in zip(taken, rows, strict=True):
            out[k] = row
        i = taken[-1] + 1
        n += 1
    return out, n


def pooler(src: TokenSource) -> Pooling:
    """``src``'s pooling capability; :class:`~backends.contract.errors.UnsupportedError` when its load has none."""
    p = src.capabilities.pooling
    if p is None:
        raise UnsupportedError(f"The {src.name} backend cannot pool outputs; embed texts one at a time.")
    return p


def _limit(src: TokenSource) -> int:
    return min(src.n_ctx, pooler(src).pool_limits()[0])


def embed(call: Call, texts: list[str], *, truncate: bool = True, cancel: threading.Event | None = None,
          max_tokens: int = 0, busy: Busy | None = None, pace: Pace | None = None) -> Pooled:
    """L2-normalised embeddings of ``texts``, evaluated in batches (see the module's docstring). ``cancel`` stops
    the work between two jobs (:class:`RequestCancelled`); ``max_tokens`` caps the tokens of all inputs together
    (:class:`InputTooLargeError`; 0: no cap); ``busy``: whether chat requests decode on the model now (the batches
    are then short: :func:`_evaluate`), ``pace`` the model's batch speed so far."""

    def tokens_of(s: TokenSource) -> Callable[[int], tuple[list[int], bool]]:
        if s.info.pooling == "rank":
            raise UnsupportedError("This model is a reranker: it scores query-document pairs and makes no embeddings.")
        limit, p = _limit(s), pooler(s)
        tail = p.tail_tokens()
        return lambda i: fit(p.embed_tokens(texts[i]) or s.prompt_tokens(""), limit, tail=tail, truncate=truncate,
                             what=f"Input {i}")

    fitted = _tokenized(call, len(texts), tokens_of, cancel, max_tokens, "inputs")
    inputs = [t for t, _ in fitted]
    rows, n = _evaluate(call, inputs, cancel, busy, pace)
    return Pooled(vectors=[normalize(r) for r in rows], tokens=sum(map(len, inputs)),
                  truncated=[i for i, (_, cut) in enumerate(fitted) if cut], batches=n)


def rerank(call: Call, query: str, documents: list[str], *, truncate: bool = True,
           cancel: threading.Event | None = None, max_tokens: int = 0, busy: Busy | None = None,
           pace: Pace | None = None) -> Pooled:
    """The relevance score of each document to ``query`` (the rank head's raw output), in document order; the query
    is tokenized once (:meth:`~backends.contract.source.Pooling.rerank_tokenizer`). ``cancel`` and ``max_tokens``: as
    :func:`embed`'s (a pair's tokens count the query's), ``busy`` and ``pace``."""
    pair: list[Callable[[str], list[int]]] = []

    def tokens_of(s: TokenSource) -> Callable[[int], tuple[list[int], bool]]:
        if s.info.pooling != "rank":
            raise UnsupportedError("This model has no rank head, so it cannot rerank; use a reranking model.")
        limit, p = _limit(s), pooler(s)
        tail = p.tail_tokens(rerank=True)
        if not pair:
            pair.append(p.rerank_tokenizer(query))
        return lambda i: fit(pair[0](documents[i]), limit, tail=tail, truncate=truncate, what=f"Document {i}")

    fitted = _tokenized(call, len(documents), tokens_of, cancel, max_tokens, "query-document pairs")
    inputs = [t for t, _ in fitted]
    rows, n = _evaluate(call, inputs, cancel, busy, pace)
    return Pooled(scores=[float(r[0]) for r in rows], tokens=sum(map(len, inputs)),
                  truncated=[i for i, (_, cut) in enumerate(fitted) if cut], batches=n)


__all__ = ["POOLING_TYPES", "Pace", "Pooled", "batches", "embed", "fit", "normalize", "rerank", "shorten"]
