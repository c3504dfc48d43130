"""The llama.cpp source's sequence memory beyond the core: whole sequence states as bytes (the prompt cache on
disk, parking) and partial checkpoints for memory that cannot drop its tail (a recurrent state, a sliding window): the
:class:`~backends.contract.source.SequenceStates` and :class:`~backends.contract.source.Checkpoints` capabilities."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

from backends.contract.errors import BackendError

if TYPE_CHECKING:
    from backends.contract.source import ModelInfo
    from backends.contract.specs import LoadSpec


class LlamaSequenceStates:
    """llama.cpp's implementation of :class:`~backends.contract.source.SequenceStates` (and of
    :class:`~backends.contract.source.Checkpoints`), mixed into :class:`~backends.llamacpp.source.LlamaCppSource`
    (its context, memory and load facts)."""

    if TYPE_CHECKING:
        spec: LoadSpec
        flash_attn: bool
        _ctx: Any
        _mem: Any
        _info: ModelInfo
        _n_swa: int
        _pooling: str | None
        _recurrent: bool

        @property
        def _windowed(self) -> bool: ...

        def _flush_prefill(self, seq: int | None = None, *, drop: bool = False) -> None: ...

    # ------------------------------------------------------------------ sequence states (prompt cache)

    def state_key(self) -> str | None:
        import llama_cpp

        if self._pooling is not None:
            return None
        mem = (" mem=recurrent" if self._recurrent else "") + (f" swa={self._n_swa}" if self._windowed else "")
        return (f"llama.cpp-{getattr(llama_cpp, '__version__', '?')} kv={self.spec.kv_cache_type} "
                f"fa={int(self.flash_attn)} unified=1 gpu_layers={self._info.n_gpu_layers}{mem}")

    def state_save(self, seq: int) -> bytes:
        import llama_cpp

        self._flush_prefill(seq)
        size = int(llama_cpp.llama_state_seq_get_size(self._ctx, seq))
        buf = (ctypes.c_uint8 * size)()
        n = int(llama_cpp.llama_state_seq_get_data(self._ctx, buf, size, seq))
        return bytes(memoryview(buf)[:n])

    def state_load(self, seq: int, data: bytes) -> bool:
        import llama_cpp

        self._flush_prefill(seq, drop=True)
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        return int(llama_cpp.llama_state_seq_set_data(self._ctx, buf, len(data), seq)) > 0

    def copy_state(self, src: int, dst: int) -> bool:
        """Load the cells of ``src`` into ``dst`` through host memory (between KV streams: llama.cpp copies only
        whole streams there, and only at the next decode)."""
        import llama_cpp

        self._flush_prefill(src)
        self._flush_prefill(dst, drop=True)
        size = int(llama_cpp.llama_state_seq_get_size(self._ctx, src))
        buf = (ctypes.c_uint8 * size)()
        n = int(llama_cpp.llama_state_seq_get_data(self._ctx, buf, size, src))
        return n > 0 and int(llama_cpp.llama_state_seq_set_data(self._ctx, buf, n, dst)) > 0

    # ------------------------------------------------------------------ checkpoints (partial states)

    def checkpoint_save(self, seq: int) -> bytes:
        import llama_cpp

        self._flush_prefill(seq)
        flags = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        size = int(llama_cpp.llama_state_seq_get_size_ext(self._ctx, seq, flags))
        buf = (ctypes.c_uint8 * size)()
        n = int(llama_cpp.llama_state_seq_get_data_ext(self._ctx, buf, size, seq, flags))
        if n <= 0:
            raise BackendError(f"llama.cpp could not save the partial state of sequence {seq}.")
        return bytes(memoryview(buf)[:n])

    def can_cut(self, seq: int, n: int) -> bool:
        """Recurrent state: never. A window: while its oldest cell is at most ``n - n_swa`` (llama-server's test),
        the cells the tokens after ``n`` attend to are all there."""
        if self._recurrent:
            return False
        if not self._windowed:
            return True
        import llama_cpp

        lo = int(llama_cpp.llama_memory_seq_pos_min(self._mem, seq))
        return 0 <= lo <= max(0, n - self._n_swa)

    def checkpoint_restore(self, src: int, dst: int, n: int, data: bytes) -> bool:
        """The attention cells of ``src`` below ``n`` copied into ``dst`` (``seq_cp``), then the partial state
        loaded over them: measured equal to evaluating the prefix cold (max logit difference 0.0)."""
        import llama_cpp

        llama_cpp.llama_memory_seq_rm(self._mem, dst, -1, -1)
        llama_cpp.llama_memory_seq_cp(self._mem, src, dst, 0, n)
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        ok = int(llama_cpp.llama_state_seq_set_data_ext(self._ctx, buf, len(data), dst,
                                                         llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)) > 0
        if not ok:
            llama_cpp.llama_memory_seq_rm(self._mem, dst, -1, -1)
        return ok
