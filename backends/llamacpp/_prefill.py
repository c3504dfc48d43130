"""Long prompt chunks evaluated with flash attention on, beside a context that decodes with it off.

On the CPU the plan turns flash attention off (:func:`localllm.planner.layout` ``flash_attn``): llama.cpp's CPU kernel
reads the cached keys one at a time for a batch of fewer than 64 tokens, so decoding and a short next turn deep in a
context go 2-6x faster without it. For a batch of a hundred tokens or more its tiled path is the faster one, and the
faster the deeper: a cold 3,000-token prompt of the default model took 17.6 s without it and 13.0 s with it
(``llama-bench -p 3000 -fa 0,1``). :class:`FlashPrefill` keeps a second context on the same weights, one sequence of
one slot's cells, flash attention on, and evaluates there every prompt chunk of ``PREFILL_MIN`` tokens or more; the
sequence's cells move into the slot's KV stream of the main context when the prompt ends (its last chunk), or when
anything else touches the sequence (:meth:`FlashPrefill.flush`). A prompt that continues a prefix held in the main
context copies the prefix in first.

The move is a sequence state (``llama_state_seq_get_data`` / ``set_data``) re-laid by :func:`relayout`: llama.cpp
stores V transposed without flash attention and refuses a state whose layout differs ("incompatible V
transposition"), and the main context has a stream per slot where this one has one. Moving a prompt's cells out costs
~30 µs a token of the default model (1,500 tokens: 43 ms), against ~4 ms a token to evaluate it.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from backends.contract.errors import BackendError

log = logging.getLogger("backends.llamacpp.prefill")

# Prompt tokens in one step's chunk that go to the flash-attention context: the tiled kernel wins from about 128
# tokens a batch at 3,000 deep (pp128 134 against 118 tok/s; pp64 113 against 116, pp32 22 against 124), and a
# prompt evaluated while others decode comes in chunks of 128 (the loop's prefill_chunk)
PREFILL_MIN = 128
# Cells held in the main context worth copying in for each token of a chunk that continues them: each copy (in, and
# out with the prompt) costs ~30 µs a cell of the default model, where flash attention saves ~0.7 ms of a 128-token
# chunk's ~5 ms a token at the start (pp128 236 against 203 tok/s), ~1 ms at 3,000 deep (134 against 118): a tool
# result of 128 tokens after 4,000 cached ones would lose more in the copies (~0.25 s) than it gains (~0.13 s)
COPY_PER_TOKEN = 8

_U32, _I32 = np.dtype("<u4"), np.dtype("<i4")
_MAGIC = 0xAF143CD8  # llama.cpp's io_magic at the start of a sequence state (src/llama-context.cpp)
_ELEMENT = {0: 4, 1: 2, 30: 2}  # ggml types a V cache without flash attention can have: F32, F16, BF16


class StateLayoutError(ValueError):
    """A sequence state this module cannot re-lay (another llama.cpp's format, a quantized V cache)."""


def _u32(buf: np.ndarray, off: int) -> int:
    if off + 4 > len(buf):
        raise StateLayoutError("the state ends early")
    return int(buf[off:off + 4].view(_U32)[0])


def _sections(buf: np.ndarray, d: int, end: int, count: int) -> tuple[bool, int, list[tuple[int, int, int]]] | None:
    """Parse the data part of a stream's block from ``d``: (V transposed, where the V sections start, and each V
    section as (offset of its values, element size, values a cell)); None where the bytes do not parse to ``end``."""
    if d + 8 > end:
        return None
    trans, n_layer = _u32(buf, d), _u32(buf, d + 4)
    if trans > 1 or not 0 < n_layer < 4096:
        return None
    off = d + 8
    for _ in range(n_layer):  # K: i32 type, u64 row size, count rows
        if off + 12 > end:
            return None
        row = int(buf[off + 4:off + 12].view("<u8")[0])
        off += 12 + row * count
    v0 = off
    vs: list[tuple[int, int, int]] = []
    while off < end:  # V: i32 type, then (u64 row size) or (u32 element size, u32 values a cell), then the values
        if off + 12 > end:
            return None
        if trans:
            el, n = _u32(buf, off + 4), _u32(buf, off + 8)
        else:
            el = _ELEMENT.get(int(buf[off:off + 4].view(_I32)[0]), 0)
            row = int(buf[off + 4:off + 12].view("<u8")[0])
            if not el or row % el:
                return None
            n = row // el
        if el not in (2, 4):
            return None
        vs.append((off + 12, el, n))
        off += 12 + el * n * count
    return (bool(trans), v0, vs) if off == end and len(vs) <= n_layer else None


def relayout(src: np.ndarray, *, n_stream: int, transposed: bool) -> np.ndarray:
    """One sequence's state from ``llama_state_seq_get_data`` (a byte array) re-laid for a context with ``n_stream``
    KV streams whose V cache is ``transposed`` (flash attention off) or not: the cells go to the destination
    sequence's own stream whatever their stream was. Raises :class:`StateLayoutError` for what it cannot read.

    The layout (llama.cpp's ``llama_context::state_seq_get_data``, ``llama_kv_cache::state_write``): u32 magic, i32
    sequence id, u32 streams; per stream u32 cells and, for a stream
    with cells, their positions and sequence ids, then u32 V-transposed, u32 layers, each layer's K rows (i32 type,
    u64 row size, a row a cell), each layer's V: rows the same way, or transposed (i32 type, u32 element size, u32
    values a cell, then value j of every cell for each j)."""
    if len(src) < 12 or _u32(src, 0) != _MAGIC:
        raise StateLayoutError("the state does not start with llama.cpp's sequence-state magic")
    n_in = _u32(src, 8)
    off, s = 12, 0
    while s < n_in and _u32(src, off) == 0:
        off, s = off + 4, s + 1
    if s == n_in:  # no cells
        out = np.zeros(12 + 4 * n_stream, dtype=np.uint8)
        out[:8] = src[:8]
        out[8:12].view(_U32)[0] = n_stream
        return out
    count = _u32(src, off)
    begin, end = off + 4, len(src) - 4 * (n_in - s - 1)  # the block; the streams after it hold none
    if end < begin or src[end:].any():
        raise StateLayoutError("the state holds cells in more than one stream")
    parsed = None
    for cell in (12, 24):  # a cell's position, sequence count and id; with llama.cpp's cell extension 12 more
        meta_end = begin + cell * count
        parsed = _sections(src, meta_end, end, count)
        if parsed is not None:
            break
    if parsed is None:
        raise StateLayoutError("the state's layout is not one this version of localllm reads")
    trans, v0, vs = parsed
    out = np.empty(16 + (end - begin) + 4 * (n_stream - 1), dtype=np.uint8)
    out[:8] = src[:8]  # the magic, the sequence id (which llama.cpp reads past)
    out[8:16].view(_U32)[:] = (n_stream, count)
    o = 16 - begin  # an offset in src + o is the same place in out
    out[begin + o:v0 + o] = src[begin:v0]  # positions, sequence ids, the K rows
    out[meta_end + o:meta_end + o + 4].view(_U32)[0] = int(transposed)
    for vo, el, n in vs:
        h = vo - 12
        out[h + o:h + o + 4] = src[h:h + 4]  # the type
        if transposed:
            out[h + o + 4:h + o + 12].view(_U32)[:] = (el, n)
        else:
            out[h + o + 4:h + o + 12].view("<u8")[0] = el * n
        dt = np.dtype(f"<u{el}")
        values = src[vo:vo + el * n * count].view(dt)
        dst = out[vo + o:vo + o + el * n * count].view(dt)
        if trans == transposed:
            dst[:] = values
        elif transposed:  # rows of a cell -> for each value, that value of every cell
            dst.reshape(n, count)[:] = values.reshape(count, n).T
        else:
            dst.reshape(count, n)[:] = values.reshape(n, count).T
    out[end + o:] = 0
    return out


def _state(ctx: Any, seq: int) -> np.ndarray:
    import llama_cpp

    size = int(llama_cpp.llama_state_seq_get_size(ctx, seq))
    buf = np.empty(size, dtype=np.uint8)
    n = int(llama_cpp.llama_state_seq_get_data(ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, seq))
    if n <= 0:
        raise BackendError(f"llama.cpp could not save the state of sequence {seq}.")
    return buf[:n]


def _load(ctx: Any, seq: int, data: np.ndarray) -> bool:
    import llama_cpp

    ptr = data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
    return int(llama_cpp.llama_state_seq_set_data(ctx, ptr, len(data), seq)) > 0


class FlashPrefill:
    """A context with flash attention on beside ``main`` (one with it off and ``n_stream`` KV streams, a sequence
    id each), on the same model: one sequence of ``n_ctx`` cells, ``n_batch`` tokens a decode. ``seq``: the main
    context's sequence id whose cells it holds ahead of the main context (None: none), ``n`` its tokens.
    ``row_view``: a logits pointer of either context as a float32 array (the main source's own)."""

    def __init__(self, model: Any, main: Any, *, n_ctx: int, n_batch: int, n_stream: int, n_threads: int,
                 n_threads_batch: int, type_k: int, type_v: int, row_view: Callable[[Any], np.ndarray]):
        import llama_cpp

        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_batch, n_batch, 1
        cp.kv_unified = True
        cp.n_threads, cp.n_threads_batch = n_threads, n_threads_batch
        cp.type_k, cp.type_v = type_k, type_v
        cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cp.no_perf = True
        self._ctx = llama_cpp.llama_init_from_model(model, cp)
        if not self._ctx:
            raise BackendError("llama.cpp could not make the flash-attention prefill context.")
        self._main = main
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self._n_batch = n_batch
        self._n_stream = n_stream
        self._row_view = row_view
        self.seq: int | None = None
        self.n = 0
        self.moved_ns = 0  # time spent moving cells between the contexts (both ways)
        self.tokens = 0  # prompt tokens evaluated here

    @property
    def context(self) -> Any:
        return self._ctx

    def check(self, token: int) -> None:
        """Evaluate ``token`` here, move it into the main context's sequence 0 and back (the state layouts this
        module re-lays are the ones this llama.cpp writes), and leave both empty; raises where any step fails."""
        import llama_cpp

        main_mem = llama_cpp.llama_get_memory(self._main)
        try:
            self.seq, self.n = 0, 0
            self._decode([token], 0, 0)
            self.n = 1
            self.flush()
            if int(llama_cpp.llama_memory_seq_pos_max(main_mem, 0)) != 0:
                raise BackendError("the moved cell is not where it belongs")
            self._take(0, 1)
            if int(llama_cpp.llama_memory_seq_pos_max(self._mem, 0)) != 0:
                raise BackendError("the cell moved back is not where it belongs")
        finally:
            self.clear()
            llama_cpp.llama_memory_seq_rm(main_mem, 0, -1, -1)

    def takes(self, seq: int, tokens: int, pos: int) -> bool:
        """Whether a chunk of ``tokens`` of ``seq`` from ``pos`` is evaluated here: ``PREFILL_MIN`` tokens or more,
        continuing what is held here or a prefix of at most ``COPY_PER_TOKEN`` cells a token."""
        return tokens >= PREFILL_MIN and ((seq == self.seq and pos == self.n) or pos <= COPY_PER_TOKEN * tokens)

    def evaluate(self, seq: int, tokens: list[int], pos: int, outputs: int) -> list[Any]:
        """Evaluate ``tokens`` of main sequence ``seq`` from ``pos`` here (its earlier cells copied in first where
        none is held here: the caller moves another sequence's out first, :meth:`flush`); the logits of the last
        ``outputs`` tokens, copied."""
        if self.seq != seq or self.n != pos:
            if self.seq is not None:
                raise BackendError(f"the prefill context holds sequence {self.seq}, not {seq} at {pos}")
            self._take(seq, pos)
        self._decode(tokens, pos, outputs)
        self.n = pos + len(tokens)
        self.tokens += len(tokens)
        return self._rows(len(tokens), outputs)

    def flush(self) -> None:
        """Move the cells held here into the main context's sequence (replacing what it held there)."""
        if self.seq is None:
            return
        import time

        seq, self.seq = self.seq, None
        t0 = time.perf_counter_ns()
        try:
            data = relayout(_state(self._ctx, 0), n_stream=self._n_stream, transposed=True)
            if not _load(self._main, seq, data):
                raise BackendError(f"llama.cpp refused the cells of sequence {seq} evaluated with flash attention "
                                   "on; the sequence is lost")
        finally:
            self._clear_cells()
            self.moved_ns += time.perf_counter_ns() - t0

    def clear(self) -> None:
        """Forget what is held here (its sequence was dropped)."""
        self.seq, self.n = None, 0
        self._clear_cells()

    def close(self) -> None:
        import llama_cpp

        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None

    # ------------------------------------------------------------------ inside

    def _clear_cells(self) -> None:
        import llama_cpp

        llama_cpp.llama_memory_seq_rm(self._mem, 0, -1, -1)
        self.n = 0

    def _take(self, seq: int, pos: int) -> None:
        """Hold main sequence ``seq``, its first ``pos`` cells copied in."""
        import time

        self.clear()
        if pos > 0:
            t0 = time.perf_counter_ns()
            try:
                data = relayout(_state(self._main, seq), n_stream=1, transposed=False)
                if not _load(self._ctx, 0, data):
                    raise BackendError(f"llama.cpp refused the cells of sequence {seq} in the prefill context")
            finally:
                self.moved_ns += time.perf_counter_ns() - t0
            import llama_cpp

            held = int(llama_cpp.llama_memory_seq_pos_max(self._mem, 0)) + 1
            if held != pos:
                self._clear_cells()
                raise BackendError(f"sequence {seq} holds {held} positions where {pos} were expected")
        self.seq, self.n = seq, pos

    def _decode(self, tokens: list[int], pos: int, outputs: int) -> None:
        import llama_cpp

        b = self._batch
        k = len(tokens)
        if k > self._n_batch:
            raise BackendError(f"A step of {k} tokens exceeds the batch size {self._n_batch}.")
        first = k - outputs
        for j, t in enumerate(tokens):
            b.token[j] = t
            b.pos[j] = pos + j
            b.n_seq_id[j] = 1
            b.seq_id[j][0] = 0
            b.logits[j] = j >= first
        b.n_tokens = k
        rc = llama_cpp.llama_decode(self._ctx, b)
        if rc != 0:
            raise BackendError(f"llama.cpp failed to evaluate a prompt chunk (llama_decode returned {rc}).")

    def _rows(self, k: int, outputs: int) -> list[Any]:
        import llama_cpp

        rows = []
        for j in range(k - outputs, k):
            ptr = llama_cpp.llama_get_logits_ith(self._ctx, j)
            if not ptr:
                raise BackendError(f"No logits for prompt row {j}.")
            rows.append(self._row_view(ptr).copy())
        return rows
