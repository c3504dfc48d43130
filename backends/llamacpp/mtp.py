"""Drafts from a model's own multi-token-prediction (MTP, ``nextn``) layers, on llama.cpp.

Qwen3.5/3.6 ``*-MTP-GGUF`` builds carry, after their trunk, one MTP block: a decoder block that reads a token's
embedding beside the trunk's last hidden state at the position before it and predicts the token after it. The
:class:`MtpDrafter` runs that block in a second llama.cpp context on the **same loaded weights**
(``llama_model_params.load_mtp``, ``llama_context_params.ctx_type = LLAMA_CONTEXT_TYPE_MTP``), as llama.cpp's
``common/speculative.cpp`` (``common_speculative_impl_draft_mtp``) does:

* the target context outputs its hidden states (``h_nextn``, the trunk's output after its final norm) for every
  token it evaluates (``llama_set_embeddings_nextn(ctx, true, masked=false)``); :meth:`MtpDrafter.observe` copies
  the rows after each evaluation, per sequence, with the tokens they were computed for;
* the MTP context holds, per sequence, a KV cache of its one block: the token at position ``p`` paired with the
  target's hidden row at ``p - 1`` (zeros at 0), at the same position; :meth:`MtpDrafter.propose` first evaluates
  what it has not seen (the accepted tokens of the last step, a prompt: at most ``max_catchup`` of them, the older
  ones left as holes), then the last sampled token paired with the target's row before it, takes the argmax as the
  first draft and feeds each draft back with the block's own output row (``llama_get_embeddings_nextn_ith`` of the
  MTP context) at the next position, ``k`` times; the draft positions' cells are then dropped again;
* a rejected draft needs nothing special here: rows and cells are kept by the tokens they were computed for, and
  whatever no longer matches the sequence (a trimmed tail, another request's prompt) is dropped before use.

Several sequences draft in one MTP evaluation per draft step (:meth:`MtpDrafter.propose_many`).

The staging API that hands hidden states between the two contexts (``src/llama-ext.h``) is C++ in this build of
libllama: its functions are bound here by their mangled names, checked at load; a build without them is refused
in one sentence.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.contract.errors import UnsupportedError
from backends.contract.media import is_image_token
from backends.contract.source import Feed
from backends.core.kvseq import common_prefix

# llama-ext.h, C++ linkage in libllama (llama-cpp-python 0.3.36): the Itanium-mangled names of
#   void    llama_set_embeddings_nextn(llama_context *, bool value, bool masked)
#   float * llama_get_embeddings_nextn(llama_context *)
#   float * llama_get_embeddings_nextn_ith(llama_context *, int32_t i)
_SYMBOLS = {
    "set_embeddings_nextn": "_Z26llama_set_embeddings_nextnP13llama_contextbb",
    "get_embeddings_nextn": "_Z26llama_get_embeddings_nextnP13llama_context",
    "get_embeddings_nextn_ith": "_Z30llama_get_embeddings_nextn_ithP13llama_contexti",
}
_C_API = ("llama_batch_ext_init", "llama_batch_ext_add_token", "llama_batch_ext_set_pos",
          "llama_batch_ext_set_embd_token", "llama_batch_ext_set_output_logits", "llama_process")


@dataclass
class _NextnApi:
    set_embeddings_nextn: Any
    get_embeddings_nextn: Any
    get_embeddings_nextn_ith: Any


_api: _NextnApi | None = None


def nextn_api() -> _NextnApi:
    """The staging functions, bound once; :class:`UnsupportedError` (one sentence) when this libllama lacks them."""
    global _api
    if _api is not None:
        return _api
    import llama_cpp
    import llama_cpp.llama_cpp as binding

    lib = binding._lib
    missing = [name for name, sym in _SYMBOLS.items() if not hasattr(lib, sym)]
    missing += [name for name in _C_API if not hasattr(llama_cpp, name)]
    if missing or not hasattr(llama_cpp.llama_context_params, "ctx_type"):
        raise UnsupportedError(
            "This build of llama.cpp cannot draft from MTP layers (it lacks "
            f"{', '.join(missing) or 'the MTP context type'}); use --draft none or another llama-cpp-python.")
    ctx_p, f_p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_float)

    def bind(sym: str, args: list[Any], res: Any) -> Any:
        fn = getattr(lib, sym)
        fn.argtypes, fn.restype = args, res
        return fn

    _api = _NextnApi(
        bind(_SYMBOLS["set_embeddings_nextn"], [ctx_p, ctypes.c_bool, ctypes.c_bool], None),
        bind(_SYMBOLS["get_embeddings_nextn"], [ctx_p], f_p),
        bind(_SYMBOLS["get_embeddings_nextn_ith"], [ctx_p, ctypes.c_int32], f_p))
    return _api


class _SeqState:
    """What the drafter knows of one target sequence: the tokens its rows were taken for, the target's hidden rows
    of the last positions (a ring of ``cap`` rows: positions ``lo`` to ``hi - 1`` are known), and the tokens under
    the MTP context's cells. Keeping a row is a copy into the ring, whatever the sequence's length."""

    def __init__(self, cap: int, n_embd: int):
        self.held: list[int] = []  # the target's tokens when its rows were taken
        self.cells: list[int] = []  # tokens under the MTP context's cells (positions < len)
        self._ring = np.zeros((cap, n_embd), dtype=np.float32)
        self.lo = self.hi = 0

    def row(self, pos: int) -> np.ndarray | None:
        if self.lo <= pos < self.hi:
            return self._ring[pos % len(self._ring)]
        return None

    def cut_rows(self, n: int) -> None:
        """Forget the rows at positions ``n`` and after."""
        self.hi = max(min(self.hi, n), 0)
        self.lo = min(self.lo, self.hi)

    def put(self, pos: int, rows: np.ndarray) -> None:
        """Keep ``rows`` as the rows of positions ``pos``... (after :meth:`cut_rows` at ``pos``); older rows beyond
        the ring's size are dropped, and so are all the older ones when there is a gap before ``pos``."""
        cap = len(self._ring)
        if pos != self.hi:
            self.lo = pos
        end = pos + len(rows)
        if len(rows) > cap:
            rows, pos = rows[-cap:], end - cap
        at = pos % cap
        first = min(len(rows), cap - at)
        self._ring[at: at + first] = rows[:first]
        self._ring[: len(rows) - first] = rows[first:]
        self.hi = end
        self.lo = max(self.lo, end - cap)


def mtp_batch(target_batch: int, n_seq_ids: int) -> int:
    """The MTP context's batch: :attr:`MtpDrafter.batch` tokens, at least one per sequence id (a step's first
    drafts are one evaluation), at most the target's.

    >>> mtp_batch(512, 4), mtp_batch(512, 128), mtp_batch(32, 4)
    (64, 128, 32)
    """
    return min(target_batch, max(MtpDrafter.batch, n_seq_ids))


class MtpDrafter:
    """Drafts from the target's own MTP block (see the module's docstring). Made by
    :func:`backends.core.drafting.setup_draft` for ``DraftSpec(kind="mtp")`` on a
    :class:`~backends.llamacpp.source.LlamaCppSource` loaded with its MTP layers; runs on the decode loop's thread."""

    name = "mtp"
    multi_seq = True
    batch = 64  # the MTP context's batch (see mtp_batch)
    keep_rows = 512  # hidden rows kept per sequence (the most a probe catches up on; n_embd floats each)

    def __init__(self, model: Any, target_ctx: Any, *, n_threads: int):
        import llama_cpp

        self._api = nextn_api()
        self._ll = llama_cpp
        n_layers = int(llama_cpp.llama_model_n_layer_nextn(model))
        if n_layers < 1:
            raise UnsupportedError("This model has no multi-token-prediction (MTP) layers loaded to draft from.")
        self.catchup_ns = 0
        self._model, self._tgt = model, target_ctx
        self._n_embd = int(llama_cpp.llama_model_n_embd_out(model))
        self._n_vocab = int(llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model)))
        cp = llama_cpp.llama_context_default_params()
        cp.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
        cp.n_ctx = int(llama_cpp.llama_n_ctx(target_ctx))
        cp.n_seq_max = int(llama_cpp.llama_n_seq_max(target_ctx))
        # a step drafts for at most one sequence id each, and catches up on a few tokens each: a small batch
        # keeps the compute buffer (the logits of a whole batch) small; a longer catch-up goes in chunks
        cp.n_batch = cp.n_ubatch = mtp_batch(int(llama_cpp.llama_n_batch(target_ctx)), int(cp.n_seq_max))
        cp.kv_unified = True
        cp.n_threads = cp.n_threads_batch = n_threads
        cp.no_perf = True
        self._ctx = llama_cpp.llama_init_from_model(model, cp)
        if not self._ctx:
            self._ctx = None
            raise UnsupportedError("llama.cpp could not create the MTP context for this model; use --draft none.")
        self._n_batch = int(llama_cpp.llama_n_batch(self._ctx))
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_ext_init(self._ctx)
        self._pos = (ctypes.c_int32 * 4)()
        self._zeros = np.zeros(self._n_embd, dtype=np.float32)
        self._seqs: dict[int, _SeqState] = {}
        try:
            self._api.set_embeddings_nextn(target_ctx, True, False)  # every token's row: the MTP cache needs them
            self._api.set_embeddings_nextn(self._ctx, True, True)  # only the drafted rows
            try:  # the first evaluation allocates the compute buffers: at load, not in the first step
                self._process([(0, 0, 0, self._zeros)], outputs=1)
            finally:
                llama_cpp.llama_memory_seq_rm(self._mem, 0, -1, -1)
        except BaseException:  # a drafter that does not start leaves nothing behind: the target plain again
            self.close()
            raise

    # ------------------------------------------------------------------ the target's side

    def watch(self, on: bool) -> None:
        """The target produces its hidden rows only while they are observed (see :meth:`Drafter.watch`)."""
        if self._ctx is not None:
            self._api.set_embeddings_nextn(self._tgt, on, False)

    def observe(self, feeds: Sequence[Feed], held: Sequence[list[int]]) -> None:
        """After the target evaluated ``feeds`` (in this order, one batch; ``held[i]``: feed i's sequence's tokens
        now): keep each text feed's hidden rows. A step with image positions keeps nothing (its rows are split
        between two evaluations)."""
        if any(f.tokens and is_image_token(f.tokens[0]) for f in feeds):
            for f, toks in zip(feeds, held, strict=True):
                self._sync(f.seq, toks).cut_rows(f.pos)
            return
        n = sum(len(f.tokens) for f in feeds)
        if n == 0:
            return
        base = self._api.get_embeddings_nextn(self._tgt)
        if not base:
            return
        rows = np.ctypeslib.as_array(base, shape=(n * self._n_embd,)).reshape(n, self._n_embd)
        at = 0
        for f, toks in zip(feeds, held, strict=True):
            k = len(f.tokens)
            st = self._sync(f.seq, toks)
            st.cut_rows(f.pos)
            st.put(f.pos, rows[at: at + k])
            st.held = list(toks)
            at += k

    def _sync(self, seq: int, content: list[int]) -> _SeqState:
        """The state of ``seq`` made consistent with ``content`` (what the target holds before new tokens): rows and
        MTP cells computed for other tokens are dropped."""
        st = self._seqs.get(seq)
        if st is None:
            st = self._seqs[seq] = _SeqState(self.keep_rows, self._n_embd)
        if not (len(st.held) <= len(content) and st.held == content[: len(st.held)]):
            c = common_prefix(st.held, content)
            st.cut_rows(c)
            st.held = st.held[:c]
        if not (len(st.cells) <= len(content) and st.cells == content[: len(st.cells)]):
            c = common_prefix(st.cells, content)
            self._ll.llama_memory_seq_rm(self._mem, seq, c, -1)
            del st.cells[c:]
        return st

    # ------------------------------------------------------------------ drafting

    def propose(self, history: list[int], k: int, max_catchup: int | None = None, seq: int = 0) -> list[int]:
        return self.propose_many([(seq, history, k)], max_catchup)[0]

    def propose_many(self, asks: Sequence[tuple[int, list[int], int]],
                     max_catchup: int | None = None) -> list[list[int]]:
        """Drafts for several sequences at once: ``asks`` = (sequence id, its tokens + the last sampled one, up to
        how many); one MTP evaluation per draft position for all of them."""
        self.catchup_ns = 0
        out: list[list[int]] = [[] for _ in asks]
        pre: list[tuple[int, int, int, np.ndarray]] = []  # (token, position, seq, row): cells to catch up on
        fin: list[tuple[int, int, int, np.ndarray]] = []  # the first draft step of each drafting sequence
        who: list[int] = []
        for i, (seq, history, k) in enumerate(asks):
            pos0 = len(history) - 1
            if k <= 0 or pos0 < 1:
                continue
            st = self._sync(seq, history[:pos0])
            h_last = st.row(pos0 - 1)
            if h_last is None:  # the target's row before the last token is unknown (a prompt from a cache)
                continue
            start = len(st.cells)
            todo = [p for p in range(start, pos0) if p == 0 or st.row(p - 1) is not None]
            if max_catchup is not None and len(todo) > max(int(max_catchup), 2):
                todo = todo[len(todo) - int(max_catchup):]
            for p in todo:
                prev = st.row(p - 1) if p else self._zeros
                assert prev is not None
                pre.append((history[p], p, seq, prev))
            st.cells = list(history[:pos0])  # what the cells stand for once evaluated (holes where skipped)
            fin.append((history[pos0], pos0, seq, h_last))
            who.append(i)
        if not fin:
            return out
        t0 = time.perf_counter_ns()
        entries = pre + fin
        head = max(0, len(entries) - self._n_batch)
        for i in range(0, head, self._n_batch):
            self._process(entries[i: min(i + self._n_batch, head)], outputs=0)
        idx = self._process(entries[head:], outputs=len(fin))
        if len(pre) > 2 * len(fin):  # more than a normal step's accepted tokens: catching up (its share of the time)
            self.catchup_ns = (time.perf_counter_ns() - t0) * len(pre) // len(entries)
        for i in who:  # the last sampled token is in the cells now: the next step keeps it
            seq, history, _ = asks[i]
            self._seqs[seq].cells.append(history[-1])
        alive = list(range(len(fin)))
        step = 0
        while alive:
            nxt: list[tuple[int, int, int, np.ndarray]] = []
            keep: list[int] = []
            for j, b in zip(alive, idx, strict=True):
                i = who[j]
                tok = self._argmax(b)
                out[i].append(tok)
                if len(out[i]) < asks[i][2]:
                    h = self._row(b)
                    nxt.append((tok, fin[j][1] + step + 1, fin[j][2], h))
                    keep.append(j)
            if not nxt:
                break
            idx = self._process(nxt, outputs=len(nxt))
            alive = keep
            step += 1
        for _, pos0, seq, _ in fin:  # drop the draft positions' cells; the verification decides what follows
            self._ll.llama_memory_seq_rm(self._mem, seq, pos0 + 1, -1)
        return out

    def _process(self, entries: Sequence[tuple[int, int, int, np.ndarray]], outputs: int) -> list[int]:
        """Evaluate ``entries`` (token, position, sequence, the hidden row it reads) in the MTP context; the last
        ``outputs`` of them give logits. Returns their batch indices."""
        ll = self._ll
        b = self._batch
        ll.llama_batch_ext_clear(b)
        first_out = len(entries) - outputs
        idx: list[int] = []
        for j, (tok, pos, seq, row) in enumerate(entries):
            i = ll.llama_batch_ext_add_token(b, seq, int(tok))
            if i < 0:
                raise UnsupportedError(f"The MTP batch refused a token ({i}).")
            self._pos[0] = pos
            ll.llama_batch_ext_set_pos(b, i, self._pos)
            r = np.ascontiguousarray(row, dtype=np.float32)
            ll.llama_batch_ext_set_embd_token(b, i, ll.llama_embd(r.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                                                  1, self._n_embd))
            if j >= first_out:
                ll.llama_batch_ext_set_output_logits(b, i, True)
                idx.append(i)
        rc = ll.llama_process(self._ctx, ll.LLAMA_PROCESS_TYPE_DECODE, b)
        if rc != 0:
            raise UnsupportedError(f"llama.cpp failed to evaluate the MTP block (llama_process returned {rc}).")
        return idx

    def _argmax(self, i: int) -> int:
        ptr = self._ll.llama_get_logits_ith(self._ctx, i)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))))

    def _row(self, i: int) -> np.ndarray:
        ptr = self._api.get_embeddings_nextn_ith(self._ctx, i)
        return np.ctypeslib.as_array(ptr, shape=(self._n_embd,)).copy()

    def close(self) -> None:
        ll = self._ll
        if self._ctx is not None:
            self._api.set_embeddings_nextn(self._tgt, False, False)
            ll.llama_batch_ext_free(self._batch)
            ll.llama_free(self._ctx)
            self._ctx = None




def mtp_drafter(src: object) -> MtpDrafter:
    """The MTP drafter of a loaded target (a llama.cpp model loaded with ``DraftSpec(kind="mtp")``), or
    :class:`UnsupportedError` saying why not in one sentence."""
    from backends.llamacpp.source import LlamaCppSource

    if not isinstance(src, LlamaCppSource):
        raise UnsupportedError("Drafting from MTP layers needs the llama.cpp backend; use --draft none.")
    if src.mtp_layers < 1:
        raise UnsupportedError(
            f"This {src.info.architecture} model has no multi-token-prediction (MTP) layers to draft from; "
            "use --draft none.")
    from backends.llamacpp import devices as ggml_devices
    from backends.llamacpp._log import allocations, capture

    capture.lines = []  # the MTP context's buffers (its KV cache, compute and output buffers), as the load's
    try:
        drafter = MtpDrafter(src.model_handle, src.context_handle, n_threads=src.n_threads)
        extra = allocations(capture.lines or [], ggml_devices.added_workers())
    finally:
        capture.lines = None
    alloc = src.info.allocations  # the load's allocations count the MTP context's too
    for dev, kinds in extra.items():
        for kind, n in kinds.items():
            alloc.setdefault(dev, {})[kind] = alloc.get(dev, {}).get(kind, 0) + n
    return drafter


__all__ = ["MtpDrafter", "mtp_batch", "mtp_drafter", "nextn_api"]
