"""Step 1 of a plan: how many bytes a load takes — weights per layer, KV cache, compute buffers, overhead.

Memory, as the peers count it (``reference/tui-and-runners.md`` §3)::

    total = weights   (tensor bytes per layer from the GGUF; token embeddings stay on the CPU,
                       the output layer goes to the GPU last, a tied one is duplicated there)
          + KV cache  (info.kv_bytes_per_token(type) × n_ctx, split with the layers)
          + compute   (Ollama's GraphSize formulas, fs/ggml/ggml.go; matches llama.cpp's own
                       compute buffer within a few % for the default model)
          + overhead  (457 MiB per CUDA GPU, Ollama's cudaMinimumMemory; 128 MiB for the process)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from backends.descriptor import KV_CACHE_TYPES
from localllm.ggufinfo import GGUFInfo
from localllm.hardware import BACKEND_CHOICES, GiB, MiB

KV_TYPES = KV_CACHE_TYPES
BACKENDS = BACKEND_CHOICES  # "auto" and every registered backend's name
DEFAULT_CTX = 4096  # llama.cpp --fit's floor (--fit-ctx) and Ollama's default num_ctx
# the smallest num_ctx a request may ask for: llama.cpp pads contexts to 256 tokens; below that a chat template
# alone may not fit
MIN_CTX = 256
MIN_AUTO_CTX = 512  # the smallest context the planner shrinks to on its own
N_UBATCH = 512  # llama.cpp's default physical batch: the compute buffer scales with it
CUDA_OVERHEAD = 457 * MiB  # per GPU: CUDA context + cuBLAS (Ollama's cudaMinimumMemory)
HOST_OVERHEAD = 128 * MiB  # the process itself (measured: Python + llama.cpp ≈ 48 MiB RSS)
DEFAULT_PARALLEL = 4  # slots when num_parallel is not set and the pool fits (LM Studio's and llama-server's 4)
MAX_PARALLEL = 64
GPU_MARGIN = 512 * MiB  # free VRAM left alone per GPU (other processes, fragmentation)
FA_HEAD_DIMS = {64, 80, 96, 112, 128, 256}  # head sizes llama.cpp's CUDA/Metal FA kernels cover


def _gb(n: float) -> str:
    """Bytes as GiB, the unit GPU and RAM sizes are sold in (a "24 GB" card is 24 GiB)."""
    return f"{n / GiB:.1f} GiB" if abs(n) >= GiB else f"{n / MiB:.0f} MiB"


@dataclass
class MemoryEstimate:
    """Bytes. ``total == weights + kv_cache + compute + overhead == gpu + cpu``."""

    weights: int
    kv_cache: int
    compute: int
    overhead: int
    total: int
    gpu: int  # on the GPU (VRAM; on Apple Silicon the Metal working set)
    cpu: int  # in system RAM
    draft: int = 0  # of the above, what the draft model takes (its weights, KV cache and compute buffer)
    mtp: int = 0  # of the above, what drafting from the model's own MTP layers adds (:func:`mtp_bytes`)
    rollback: int = 0  # of the above, the rollback states any draft needs on recurrent memory (:func:`rollback_bytes`)
    prefill: int = 0  # of the above, the flash-attention context for long prompt chunks (one slot's KV, its buffer)

    def __add__(self, other: MemoryEstimate) -> MemoryEstimate:
        return MemoryEstimate(*(a + b for a, b in zip(asdict(self).values(), asdict(other).values(), strict=True)))

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def describe(self, n_ctx: int, kv_type: str) -> str:
        """``"5.9 GiB: weights 4.6 GiB + KV cache 512 MiB (4,096 tokens, f16) + compute 266 MiB + ..."``"""
        text = (f"{_gb(self.total)}: weights {_gb(self.weights)} + KV cache {_gb(self.kv_cache)} "
                f"({n_ctx:,} tokens, {kv_type}) + compute {_gb(self.compute)} + overhead {_gb(self.overhead)}")
        text += f" (draft model {_gb(self.draft)} included)" if self.draft else ""
        text += f" (MTP drafting {_gb(self.mtp)} included)" if self.mtp else ""
        text += f" (the prefill context {_gb(self.prefill)} included)" if self.prefill else ""
        return text + (f" (draft rollback states {_gb(self.rollback)} included)" if self.rollback else "")



# ------------------------------------------------------------------------------------------ weights


@dataclass(frozen=True)
class _Weights:
    embd: int  # token embeddings: llama.cpp keeps the input layer on the CPU
    output: int  # output layer (+ final norm); a tied one is the embedding matrix again
    tied: bool
    layers: tuple[int, ...]  # per repeating layer, blk.0 first
    experts: tuple[int, ...] = ()  # of each layer's bytes, its expert tensors' (a mixture of experts; () = dense)

    def moved(self, first: int, last: int, n_cpu_moe: int) -> int:
        """Expert bytes of layers ``first..last-1`` that stay on the CPU with ``n_cpu_moe`` (the first N layers')."""
        return sum(self.experts[first:min(last, n_cpu_moe)]) if self.experts else 0

    @property
    def total(self) -> int:
        return self.embd + sum(self.layers) + (0 if self.tied else self.output)


def _weights(info: GGUFInfo) -> _Weights:
    """Per-layer weight bytes: from ``info.extra["tensor_bytes"]`` (``read_gguf`` records the tensor
    table's split), else estimated from the file size, the parameter count and the embedding shape
    (assuming an untied output layer)."""
    tb = (info.extra or {}).get("tensor_bytes")
    if isinstance(tb, dict) and tb.get("layers"):
        layers = tuple(int(x) for x in tb["layers"])
        if len(layers) == info.n_layers:
            embd = int(tb.get("token_embd") or 0)
            tied = tb.get("output") is None
            output = (embd if tied else int(tb["output"])) + int(tb.get("other") or 0)
            experts = info.expert_bytes
            return _Weights(embd=embd, output=output, tied=tied, layers=layers,
                            experts=experts if len(experts) == len(layers) else ())
    size = max(int(info.file_size), 0)
    bytes_per_param = size / info.parameters if info.parameters else 0.6
    embd = int(info.vocab_size * info.n_embd * bytes_per_param)
    embd = min(embd, size // 4)  # keep the guess sane when metadata is sparse
    rest = max(size - 2 * embd, 0)
    per_layer = rest // max(info.n_layers, 1)
    return _Weights(embd=embd, output=embd, tied=False, layers=(per_layer,) * info.n_layers)


# ------------------------------------------------------------------------------------------ compute


def _graph(info: GGUFInfo, n_ctx: int, flash_attn: bool, batch: int = N_UBATCH, span: int | None = None) -> int:
    """Compute buffer, after Ollama's ``GraphSize`` (fs/ggml/ggml.go, the llama branch, full offload: llama.cpp
    always offloads the output layer first), for a physical batch of ``batch`` tokens; ``span``: the cells one
    token's attention covers (the whole pool, ``n_ctx``, unless each sequence has a KV stream of its own)."""
    b = min(n_ctx, batch)
    e, v, h = info.n_embd, info.vocab_size, max(info.n_head, 1)
    attn = 4 * b * (1 + 4 * e + (0 if flash_attn else (span or n_ctx) * (1 + h)))
    return int(max(attn, 4 * b * (e + v)))


def by_stream(info: GGUFInfo, slots: int, kv_unified: bool = False) -> bool:
    """llama.cpp gives each slot a KV stream of its own (``kv_unified`` off, as localllm loads plain attention with
    several slots; :mod:`backends.llamacpp.source`): not for sliding-window, recurrent or hybrid memory, pooling
    models, one slot, or a unified pool asked for (``LOCALLLM_KV_UNIFIED``)."""
    return (slots > 1 and not kv_unified and not info.pooling and not info.swa_layers and not info.sliding_window
            and not info.recurrent_layers and not info.is_recurrent and not info.is_hybrid)


def _default_flash_attn(kv_cache_type: str) -> bool:
    return kv_cache_type != "f16"


def estimate(info: GGUFInfo, n_ctx: int, kv_cache_type: str = "f16", n_gpu_layers: int = 0, *,
             flash_attn: bool | None = None, device: str = "cuda", n_gpus: int = 1, slots: int = 1,
             swa_full: bool = False, n_cpu_moe: int = 0, mtp_draft: int = 0, num_draft: int = 0,
             kv_unified: bool = False, prefill_flash: bool = False) -> MemoryEstimate:
    """Memory to load ``info`` with ``n_ctx`` tokens of context (all ``slots`` slots) and ``n_gpu_layers``
    offloaded (llama.cpp's meaning; negative = all), the expert tensors of the first ``n_cpu_moe`` layers kept in
    RAM (llama.cpp's ``--n-cpu-moe``). ``flash_attn=None``: on when the V cache is quantized. The
    KV cache is what llama.cpp allocates (:meth:`GGUFInfo.memory_bytes`): sliding-window layers at their window
    (unless ``swa_full``), recurrent layers one state per sequence. Without flash attention the score matrix spans a
    sequence's KV stream (``n_ctx / slots``; :func:`by_stream`), the whole pool where it is unified (``kv_unified``).
    ``mtp_draft``: tokens drafted a step from the model's own MTP layers (0: none), whose context and rows count too
    (:func:`mtp_bytes`). ``num_draft``: tokens any draft (a draft model, n-gram, MTP) proposes a step (0: no
    drafting; ``mtp_draft`` where it is 0): on recurrent/hybrid memory llama.cpp keeps that many rollback states of
    each sequence (:func:`rollback_bytes`). ``prefill_flash``: on the CPU, a second context with flash attention on
    for long prompt chunks (``LoadSpec.prefill_flash_attn``): one slot's KV cache and its compute buffer more.

    >>> from localllm.ggufinfo import GGUFInfo
    >>> llama8b = GGUFInfo(path="", file_size=4_920_739_232, architecture="llama", name="8B",
    ...     n_layers=32, n_embd=4096, n_head=32, n_head_kv=8, head_dim_k=128, head_dim_v=128,
    ...     context_length=131072, vocab_size=128256, file_type="Q4_K_M", parameters=8_030_261_248,
    ...     chat_template=None, license=None)
    >>> estimate(llama8b, 8192).kv_cache // MiB      # 128 KiB per token
    1024
    """
    kv_cache_type = kv_cache_type.lower()
    if flash_attn is None:
        flash_attn = _default_flash_attn(kv_cache_type)
    n_layers = max(info.n_layers, 1)
    ngl = n_layers + 1 if n_gpu_layers < 0 else min(n_gpu_layers, n_layers + 1)
    # llama.cpp's -ngl N: the output layer and the last N - 1 layers (src/llama-model.cpp: i_gpu_start)
    layers_gpu, output_gpu = max(ngl - 1, 0), ngl > 0
    w = _weights(info)
    split = len(w.layers) - layers_gpu  # llama.cpp offloads the last layers first
    moved = w.moved(split, len(w.layers), n_cpu_moe)  # offloaded layers' experts that stay in RAM
    gpu_w = sum(w.layers[split:]) + (w.output if output_gpu else 0) - moved
    cpu_w = sum(w.layers[:split]) + w.embd + (0 if (output_gpu or w.tied) else w.output) + moved
    kv = info.memory_bytes(n_ctx, kv_cache_type, slots=slots, swa_full=swa_full)
    kv_gpu = kv * layers_gpu // n_layers
    graph = _graph(info, n_ctx, flash_attn, span=n_ctx // slots if by_stream(info, slots, kv_unified) else n_ctx)
    if ngl == 0:
        gpu_c, cpu_c = 0, graph
    elif layers_gpu >= n_layers or device == "metal":  # Ollama: on Metal partial offload costs what full does
        gpu_c, cpu_c = graph, 4 * min(n_ctx, N_UBATCH) * info.n_embd
    else:  # the CPU runs the first layers: its buffer as large as a layer's (counted as the whole graph's)
        gpu_c, cpu_c = graph, graph
    if moved:  # the CPU runs those experts: its buffer holds their activations (gate, up, down of the used ones)
        cpu_c = max(cpu_c, moe_cpu_compute(info, n_ctx))
    gpu_o = (CUDA_OVERHEAD * max(n_gpus, 1) if device == "cuda" else 0) if ngl else 0
    host = HOST_OVERHEAD + checkpoint_bytes(info, n_ctx, kv_cache_type, slots)  # checkpoints live in host memory
    m = mtp_bytes(info, n_ctx, kv_cache_type, slots, mtp_draft, flash_attn) if mtp_draft and info.mtp_layers else {}
    rollback = rollback_bytes(info, slots, num_draft or (mtp_draft if info.mtp_layers else 0))
    kv += rollback
    kv_gpu += rollback * layers_gpu // n_layers  # with the recurrent layers, as their states
    if m:  # the MTP context's cache and compute buffer with the MTP layers (the last: offloaded first)
        on_gpu = layers_gpu > 0
        kv += m["cache"]
        kv_gpu += m["cache"] if on_gpu else 0
        gpu_c, cpu_c = (gpu_c + m["compute"], cpu_c) if on_gpu else (gpu_c, cpu_c + m["compute"])
        host += m["rows"]
    prefill = 0
    if prefill_flash and ngl == 0:  # one slot's cells, flash attention on (its score rows: no n_ctx-wide buffer)
        one = n_ctx // max(slots, 1)
        p_kv, p_c = info.memory_bytes(one, kv_cache_type, slots=1, swa_full=swa_full), _graph(info, one, True)
        kv, cpu_c, prefill = kv + p_kv, cpu_c + p_c, p_kv + p_c
    gpu = gpu_w + kv_gpu + gpu_c + gpu_o
    cpu = cpu_w + (kv - kv_gpu) + cpu_c + host
    return MemoryEstimate(weights=gpu_w + cpu_w, kv_cache=kv, compute=gpu_c + cpu_c, overhead=gpu_o + host,
                          total=gpu + cpu, gpu=gpu, cpu=cpu, mtp=sum(m.values()), rollback=rollback, prefill=prefill)


def rollback_bytes(info: GGUFInfo, slots: int, num_draft: int) -> int:
    """The rollback states a draft of ``num_draft`` tokens a step needs on ``info``'s recurrent/hybrid memory (any
    draft: a draft model, n-gram, MTP; :mod:`backends.llamacpp.source` sets ``n_rs_seq = num_draft``, the most a step
    rolls back): llama.cpp keeps ``1 + n_rs_seq`` states of each sequence id (src/llama-memory-recurrent.cpp),
    ``n_rs_seq`` more than a plain load, two sequence ids a slot; 0 without recurrent layers or without a draft.

    >>> from localllm.ggufinfo import GGUFInfo
    >>> q = GGUFInfo(path="", file_size=0, architecture="qwen35", name=None, n_layers=65, n_embd=5120, n_head=24,
    ...     n_head_kv=4, head_dim_k=256, head_dim_v=256, context_length=262144, vocab_size=248320,
    ...     file_type="Q4_K_M", parameters=0, chat_template=None, license=None, mtp_layers=1, recurrent_layers=48,
    ...     recurrent_bytes=48 * 2_162_688)
    >>> rollback_bytes(q, 1, 4) // MiB, rollback_bytes(q, 1, 0)
    (792, 0)
    """
    if not (info.recurrent_layers and num_draft > 0):
        return 0
    return info.recurrent_bytes * 2 * max(slots, 1) * num_draft


def rollback_reason(info: GGUFInfo, slots: int, num_draft: int, kind: str = "") -> str:
    """The plan's line on the rollback states a draft needs on recurrent/hybrid memory (``probe``,
    ``run --verbose``)."""
    n = rollback_bytes(info, slots, num_draft)
    what = {"model": "a draft model", "ngram": "n-gram drafting", "mtp": "MTP drafting"}.get(kind, "drafting")
    ids = 2 * max(slots, 1)
    return (f"draft rollback states: +{n / MiB:.1f} MiB for {what} on recurrent memory ({num_draft} more states of "
            f"each of its {ids} sequence ids, {info.recurrent_bytes / MiB:.1f} MiB each: llama.cpp's n_rs_seq, the "
            "most a step rolls back); --draft none: without them")


def mtp_bytes(info: GGUFInfo, n_cells: int, kv_cache_type: str, slots: int, num_draft: int,
              flash_attn: bool = True) -> dict[str, int]:
    """What drafting ``num_draft`` tokens a step from ``info``'s own MTP layers adds to a llama.cpp load of
    ``n_cells`` context cells (all slots), as :class:`backends.llamacpp.mtp.MtpDrafter` and llama.cpp allocate it:

    * ``cache``: the MTP context's KV cache, as long as the target's (``kv_unified``), of the MTP layers only
      (llama.cpp filters the trunk's layers out of an MTP context, src/llama-model.cpp ``create_memory``);
    * ``rows``: the drafter's rings of the target's hidden rows, ``keep_rows`` × n_embd floats a sequence id it has
      drafted for (at most two a slot: a request may take any of the pool's);
    * ``compute``: the MTP context's compute buffer (its block and the output head over its batch, which is
      small: :func:`backends.llamacpp.mtp.mtp_batch`) and its output buffer (a row of logits per sequence id).

    >>> from localllm.ggufinfo import GGUFInfo
    >>> q = GGUFInfo(path="", file_size=0, architecture="qwen35", name=None, n_layers=65, n_embd=5120, n_head=24,
    ...     n_head_kv=4, head_dim_k=256, head_dim_v=256, context_length=262144, vocab_size=248320,
    ...     file_type="Q4_K_M", parameters=0, chat_template=None, license=None, mtp_layers=1, recurrent_layers=48,
    ...     recurrent_bytes=48 * 2_162_688)
    >>> {k: v // MiB for k, v in mtp_bytes(q, 8192, "f16", 1, 4).items()}
    {'cache': 32, 'rows': 20, 'compute': 63}

    The target's rollback states on recurrent/hybrid memory are every draft's, not MTP's: :func:`rollback_bytes`.
    """
    from backends.llamacpp.mtp import MtpDrafter, mtp_batch

    ids = 2 * max(slots, 1)  # localllm gives llama.cpp two sequence ids a slot
    cache = int(info.mtp_layers * info.kv_bytes_per_layer_token(kv_cache_type) * n_cells)
    rows = MtpDrafter.keep_rows * info.n_embd * 4 * ids
    compute = _graph(info, n_cells, flash_attn, batch=mtp_batch(N_UBATCH, ids))
    compute += 4 * info.vocab_size * ids
    return {"cache": cache, "rows": rows, "compute": compute}


def mtp_reason(info: GGUFInfo, n_cells: int, kv_cache_type: str, slots: int, num_draft: int,
               flash_attn: bool = True) -> str:
    """The plan's line on MTP drafting (``probe``, ``run --verbose``): what it adds, and how to plan without it."""
    m = mtp_bytes(info, n_cells, kv_cache_type, slots, num_draft, flash_attn)

    def gb(n: int) -> str:
        return f"{n / MiB:.1f} MiB" if n < 10 * MiB else _gb(n)

    parts = [f"its cache {gb(m['cache'])}", f"hidden rows {gb(m['rows'])}", f"its compute buffer {gb(m['compute'])}"]
    return (f"MTP drafting ({num_draft} tokens a step from the model's {info.mtp_layers} MTP "
            f"layer{'s' if info.mtp_layers != 1 else ''}): +{gb(sum(m.values()))} ({', '.join(parts)}); "
            "--draft none: without it")


def moe_cpu_compute(info: GGUFInfo, n_ctx: int) -> int:
    """The CPU's compute buffer when it runs some layers' experts: per row of the batch, the used experts' gate,
    up and activation rows and a few n_embd rows (within 10 % of llama.cpp's on the made gpt-oss of the tests:
    measured -7.7 % on tests/test_moe_placement.py's)."""
    b = min(n_ctx, N_UBATCH)
    return 4 * b * (3 * info.n_ff_exp * max(info.n_experts_used, 1) + 6 * info.n_embd)


def checkpoint_bytes(info: GGUFInfo, n_ctx: int, kv_cache_type: str, slots: int) -> int:
    """Host memory the checkpoints of a windowed or recurrent model may take at most (``backends.core.kvpool``'s
    :class:`~backends.core.kvseq.CheckpointPolicy`: per slot, 16 checkpoints of one sequence's recurrent state and
    window, within 256 MiB); 0 for a plain transformer. ``n_ctx``: all slots' cells."""
    from backends.core.kvseq import CheckpointPolicy

    pol = CheckpointPolicy()
    swa = info.swa_layers if info.sliding_window else 0
    if not (swa or info.recurrent_layers):
        return 0
    per_layer = info.kv_bytes_per_layer_token(kv_cache_type)
    window = min(n_ctx // max(slots, 1), (info.sliding_window or 0) + N_UBATCH)
    one = info.recurrent_bytes // 2 + int(swa * window * per_layer)  # (recurrent_bytes: two sequence ids a slot)
    return max(slots, 1) * min(pol.bytes_per_slot, pol.per_seq * one)


def memory_layout_reason(info: GGUFInfo, n_cells: int, kv_cache_type: str, slots: int, swa_full: bool) -> str:
    """One line on a windowed or recurrent model's memory (``probe``, ``run --verbose``).

    >>> from localllm.ggufinfo import GGUFInfo
    >>> g = GGUFInfo(path="", file_size=0, architecture="gemma3", name=None, n_layers=18, n_embd=640, n_head=4,
    ...     n_head_kv=1, head_dim_k=256, head_dim_v=256, context_length=32768, vocab_size=262144,
    ...     file_type="Q4_K_M", parameters=0, chat_template=None, license=None, sliding_window=512, swa_layers=15)
    >>> memory_layout_reason(g, 32768, "f16", 1, False)  # doctest: +ELLIPSIS
    'memory layout: 15 of 18 layers windowed (512 tokens): KV cache 118.5 MiB instead of 576.0 MiB (...); check...'
    """
    kv = info.memory_bytes(n_cells, kv_cache_type, slots=slots, swa_full=swa_full)
    parts = []
    if info.swa_layers and info.sliding_window:
        parts.append(f"{info.swa_layers} of {info.n_layers} layers windowed ({info.sliding_window:,} tokens)"
                     + (", cached whole (LOCALLLM_SWA_FULL=1)" if swa_full else ""))
    if info.recurrent_layers:
        parts.append(f"{info.recurrent_layers} of {info.n_layers} layers recurrent "
                     f"({info.recurrent_bytes / MiB:.1f} MiB of state a sequence, no KV cache)")
    text = "memory layout: " + "; ".join(parts) + f": KV cache {kv / MiB:.1f} MiB"
    if info.swa_layers and info.sliding_window and not swa_full:
        full = info.memory_bytes(n_cells, kv_cache_type, slots=slots, swa_full=True)
        text += f" instead of {full / MiB:.1f} MiB (LOCALLLM_SWA_FULL=1)"
    ck = checkpoint_bytes(info, n_cells, kv_cache_type, slots)
    return text + (f"; checkpoints up to {ck / MiB:.1f} MiB of host memory" if ck else "")


def _mlx_estimate(info: GGUFInfo, n_ctx: int, kv_cache_type: str, on_gpu: bool,
                  weights_bytes: int | None = None) -> MemoryEstimate:
    """MLX keeps everything in one (unified) pool. ``weights_bytes``: the MLX weights' own size (the
    directory, or a conversion's requantized estimate); without it, the GGUF's size stands in."""
    weights = int(weights_bytes) if weights_bytes else int(info.file_size)
    kv = int(info.kv_bytes_per_token(kv_cache_type) * n_ctx)
    compute = _graph(info, n_ctx, True)  # fused scaled-dot-product attention
    total = weights + kv + compute + HOST_OVERHEAD
    return MemoryEstimate(weights=weights, kv_cache=kv, compute=compute, overhead=HOST_OVERHEAD, total=total,
                          gpu=total - HOST_OVERHEAD if on_gpu else 0,
                          cpu=HOST_OVERHEAD if on_gpu else total)

