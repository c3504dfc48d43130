"""The decode loop's counters since load and gauges now (:meth:`backends.core.loop.LoadedModel.metrics`)."""

from __future__ import annotations

from dataclasses import dataclass


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
    kv_checkpoints: int = 0  # checkpoints kept in host memory (memory without rewind: hybrid, sliding window)
    kv_checkpoint_bytes: int = 0
    prompt_tokens_evaluated: int = 0
    prompt_tokens_cached: int = 0  # reused from the pool instead of evaluated (copied prefixes included)
    prompt_tokens_copied: int = 0  # of those, copied from another sequence (seq_cp)
    prompt_tokens_flash: int = 0  # of those evaluated, in the flash-attention prefill context (llama.cpp on the CPU)
    prefill_move_ns: int = 0  # moving their cells between that context and the main one
    generated_tokens: int = 0
    draft_proposed: int = 0
    draft_accepted: int = 0
    steps: int = 0
    consumer_wait_ns: int = 0  # steps spent letting consumers finish with the previous step's tokens (CPU-bound loads)
    batched_tokens: int = 0  # tokens evaluated over all steps
    evictions: int = 0  # idle sequences dropped to make room
    requests: int = 0
    drafting: str | None = None  # None, or the controller's state
    prompt_cache_entries: int = 0  # on disk (the model's directory)
    prompt_cache_bytes: int = 0
    prompt_cache_hits: int = 0
    prompt_cache_misses: int = 0
    prompt_tokens_restored: int = 0  # prompt tokens restored from disk instead of evaluated
    images_encoded: int = 0  # by the vision projector (an image whose embeddings or KV cells are kept: not again)
    image_tokens_encoded: int = 0
    image_encode_ns: int = 0
    audio_chunks_encoded: int = 0  # by the audio projector (a clip is a chunk per 30 s; one kept: not again)
    audio_tokens_encoded: int = 0
    audio_encode_ns: int = 0
    pooled_inputs: int = 0  # embedding inputs and rerank documents evaluated (backends.core.pooling)
    pooled_tokens: int = 0  # their tokens
