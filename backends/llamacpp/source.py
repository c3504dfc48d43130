"""GGUF models through llama.cpp (llama-cpp-python's low-level API): a token source for the decode loop.

One ``llama_context`` holds every sequence of a loaded model: ``n_seq_max`` sequence ids over one
**unified** KV pool of ``n_ctx × slots`` cells (a sequence may use up to ``n_ctx`` of them), so a shared
prefix is copied between sequences by tagging its cells (``llama_memory_seq_cp``), not by evaluating
it again. :meth:`LlamaCppSource.evaluate` puts the tokens of several sequences into one ``llama_batch``
and runs one ``llama_decode``; each request samples with its own sampler chain (seed, temperature,
top-k/top-p/min-p, penalties, a grammar for JSON / JSON Schema). Flash attention is left to llama.cpp
(``LLAMA_FLASH_ATTN_TYPE_AUTO``: on where the build and the model support it).

Everything per request (stops, UTF-8, tools, limits, stats) is :mod:`backends.core.stream`'s; the step
scheduling is :mod:`backends.core.loop`'s. Every method here runs on the loop's one thread.

Traps of llama-cpp-python 0.3.36 handled here (see shared/reference/batching-and-cache.md): more than
``n_batch`` tokens in one decode aborts the process (the loop never sends more), ``seed=0`` means
"random" in llama-cpp-python's constructor (we build the sampler chain ourselves with the exact seed),
a quantized V cache needs flash attention, an unflagged row has no logits, and llama.cpp's own logging
levels are mapped wrongly by llama-cpp-python (we install our own callback).

What a load reads beyond the core of :class:`~backends.contract.specs.LoadSpec`: ``chat_template``, ``lora``,
``devices`` and ``tensor_split``, ``head_dims``, ``use_mmap``, ``n_threads_batch``, ``swa_full``, and of its ``tuning``
``n_seq_ids`` and ``grammar``. By concern, beside this module: :mod:`backends.llamacpp.checks` (files, host, KV types),
:mod:`backends.llamacpp.sampling`, :mod:`backends.llamacpp._log`, and the capabilities mixed into the source: media
(:mod:`backends.llamacpp._vision`), sequence states and checkpoints (:mod:`backends.llamacpp._state`), pooled outputs
(:mod:`backends.llamacpp._pool`), text: tokens and the chat template (:mod:`backends.llamacpp._text`).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.contract.errors import BackendError, ModelLoadError, PoolFullError
from backends.contract.media import is_image_token
from backends.contract.source import Capabilities, Feed, ModelInfo, TokenSource
from backends.contract.specs import LoadSpec, LoraAdapter, Sampling, ToolCallFormat
from backends.core.stream import check_logit_bias
from backends.llamacpp._log import allocations, capture, forget_recent, install_log_router, log_callback, native_reason
from backends.llamacpp._pool import LlamaPooling
from backends.llamacpp._prefill import FlashPrefill
from backends.llamacpp._state import LlamaSequenceStates
from backends.llamacpp._text import LlamaText
from backends.llamacpp._vision import LlamaMediaInput
from backends.llamacpp.checks import (
    KV_BYTES_PER_ELEM,
    KV_GGML_TYPE,
    amx_build,
    check_gguf_file,
    check_kv_type,
    flash_attn_enabled,
    load_error,
    metadata_of,
    physical_cores,
    pooling_of,
    usable_cores,
)
from backends.llamacpp.sampling import ChainSampler, make_sampler

if TYPE_CHECKING:
    from backends.llamacpp._vision import LoadedProjector  # noqa: F401 - imported for real where a projector loads

log = logging.getLogger("backends.llamacpp")

MiB = 1 << 20

_backend_initialised = False


def _init_library(source: TokenSource, spec: LoadSpec) -> None:
    """llama.cpp usable here (else :class:`ModelLoadError` with how to install it), its backends initialised once
    per process, and its log routed to ours."""
    ok, why = source.available()
    if not ok:
        raise ModelLoadError(why)
    import llama_cpp

    global _backend_initialised
    if not _backend_initialised:
        llama_cpp.llama_backend_init()
        _backend_initialised = True
    install_log_router(spec.verbose)


class LlamaCppSource(LlamaText, LlamaMediaInput, LlamaSequenceStates, LlamaPooling, TokenSource):
    """One GGUF model in one llama.cpp context: ``spec.slots`` slots over a unified KV pool."""

    name = "llamacpp"

    # ------------------------------------------------------------------ load

    def __init__(self, spec: LoadSpec):
        """The load in named steps, in this order: the library, the checks of the spec and the file, the weights
        (:meth:`_load_model`), what the vocabulary and the metadata say (:meth:`_read_model`), the context
        (:meth:`_context_params`, :meth:`_make_context`: LoRA on it), the tokens and flags read once
        (:meth:`_read_tokens`), the projector (:meth:`_load_projector`), the devices' allocations and the RPC
        watch (:meth:`_watch_devices`). What fails after the weights loaded closes what was made."""
        super().__init__(spec)
        _init_library(self, spec)
        self._closed = False
        self._model: Any = None
        self._ctx: Any = None
        self._loras: list[tuple[Any, float]] = []  # LoRA adapters on the weights, with their scales
        self._batch: Any = None
        self._embed: tuple[Any, Any, int, int] | None = None  # (context, batch, tokens, sequences) for pooling
        self._pooling: str | None = None
        self._proj: LoadedProjector | None = None  # when spec.mmproj names one
        self._ebatch: Any = None  # a llama_batch with embd, for image positions
        self._saved_rows: list[Any] = []
        self._streams = False
        self._prefill: FlashPrefill | None = None  # long prompt chunks, flash attention on (spec.prefill_flash_attn)
        self._alloc: dict[str, dict[str, int]] = {}  # per device, what llama.cpp allocated at load
        self._path = path = Path(spec.model_path)
        check_gguf_file(path)
        check_kv_type(spec, path)
        # never more threads than the cores this process may run on, whatever the spec says
        self.n_threads = min(spec.n_threads or physical_cores(), usable_cores())
        self._load_model(spec, path)
        try:
            self._read_model()
            cp = self._context_params(spec)
            self._make_context(spec, cp)
            self._read_tokens(spec, cp)
            self._load_projector(spec)
            self._make_prefill(spec, cp)
            self._watch_devices(spec)
            self._info = self._build_info()
            if spec.embedding and self._pooling is None:
                self._embed_ctx()
        except BaseException:
            self.close()
            raise

    def _load_model(self, spec: LoadSpec, path: Path) -> None:
        """The weights, with their layers offloaded, placed on the spec's devices and the first layers' experts in
        RAM as the plan says (llama.cpp's model parameters)."""
        import llama_cpp

        forget_recent()
        mp = llama_cpp.llama_model_default_params()
        mp.n_gpu_layers = spec.n_gpu_layers
        mp.load_mtp = spec.draft is not None and spec.draft.kind == "mtp"  # the MTP block (llamacpp.mtp drafts)
        from backends.llamacpp.tensor_overrides import experts_on_cpu, place_on_devices

        # kept alive: llama.cpp reads the device list and the split during the load
        self._placement = (place_on_devices(mp, list(spec.devices), list(spec.tensor_split))
                           if spec.devices and spec.n_gpu_layers != 0 else [])
        # a mixture of experts: the first layers' experts in RAM (the array is read at load; kept with the model)
        self._overrides = experts_on_cpu(mp, spec.n_cpu_moe) if spec.n_gpu_layers != 0 else None
        capture.lines = []
        mp.load_mode = (llama_cpp.LLAMA_LOAD_MODE_MMAP if spec.use_mmap
                        else llama_cpp.LLAMA_LOAD_MODE_NONE)
        if amx_build():  # its AMX kernels would kill the process at the first matrix product
            mp.use_extra_bufts = False
        self._model = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
        if not self._model:
            self._model = None
            raise load_error("Failed to load model", path, spec)

    def _read_model(self) -> None:
        """The vocabulary, the sampling buffers sized to it, the metadata, the architecture and its pooling."""
        import llama_cpp

        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self._n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        # the samplers' candidates (llama_token_data; one thread samples) and every token id, made once
        self._candidates = np.zeros(self._n_vocab, dtype=np.dtype(llama_cpp.llama_token_data))
        self._all_ids = np.arange(self._n_vocab, dtype=np.intc)
        self._row_type = ctypes.c_float * self._n_vocab
        self._md = metadata_of(self._model)
        self._arch = self._md.get("general.architecture", "unknown")
        self._pooling = pooling_of(self._md, self._arch)  # an embedding / rerank model: pools, never generates

    def _context_params(self, spec: LoadSpec) -> Any:
        """llama.cpp's context parameters for this load: sizes, threads, the KV type, flash attention, the window."""
        import llama_cpp

        cp = llama_cpp.llama_context_default_params()
        # a KV stream per sequence id (llama.cpp's kv_unified off, llama-server's layout) for plain attention and
        # several slots: a step attends to each sequence's own cells, not to the pool up to its highest cell in use
        # (8 streams decode ~10% faster; benchmarks/README.md, issue 47). Memory that needs partial copies between
        # sequences (checkpoints of hybrid, recurrent and sliding-window models) and pooling contexts keep the
        # unified pool: llama.cpp copies only whole streams
        self._streams = (not spec.kv_unified and spec.slots > 1 and self._pooling is None
                         and not llama_cpp.llama_model_is_recurrent(self._model)
                         and not llama_cpp.llama_model_is_hybrid(self._model)
                         and int(llama_cpp.llama_model_n_swa(self._model)) == 0)
        # sequence ids: one per slot by stream (a stream of n_ctx cells each: the pool is n_ctx × slots either way),
        # twice the slots in a unified pool (idle conversations keep their prefix)
        slots = max(1, spec.slots)
        self._n_seq_ids = max(slots, min(256, spec.tuning.n_seq_ids or (slots if self._streams else 2 * slots)))
        # at least one token per sequence id in a batch, and so in the context (a causal model's batch is cut to
        # the context): llama.cpp reserves its graphs for one output per sequence and aborts the process with
        # GGML_ASSERT(n_outputs_max <= cparams.n_outputs_max) below that (a request's num_ctx 1 did). A
        # sequence still holds only spec.n_ctx tokens (self._n_ctx)
        cp.n_ctx = spec.n_ctx * self._n_seq_ids if self._streams else max(spec.n_ctx * slots, self._n_seq_ids)
        cp.n_batch = cp.n_ubatch = max(spec.n_batch, self._n_seq_ids)
        cp.n_seq_max = self._n_seq_ids
        if self._pooling is not None:
            self._pool_setup(cp)
        cp.kv_unified = not self._streams
        cp.n_threads = self.n_threads
        cp.n_threads_batch = min(spec.n_threads_batch or self.n_threads, usable_cores())
        cp.type_k = cp.type_v = KV_GGML_TYPE[spec.kv_cache_type]
        cp.flash_attn_type = {None: llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO,
                              True: llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                              False: llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED}[spec.flash_attn]
        cp.embeddings = self._pooling is not None
        cp.no_perf = True
        # sliding-window layers keep their window (+ a batch) per sequence id, as llama-server does; reuse
        # stays right through checkpoints. swa_full: every layer as long as the context (exact reuse anywhere)
        self._swa_full = spec.swa_full
        cp.swa_full = self._swa_full
        # drafts on recurrent memory: llama.cpp keeps the last states of each sequence (n_rs_seq, where the
        # architecture supports it), so a cut inside the last decode (rejected draft tokens) is right
        recurrent = bool(llama_cpp.llama_model_is_recurrent(self._model) or llama_cpp.llama_model_is_hybrid(
            self._model))
        if recurrent and spec.draft is not None:
            cp.n_rs_seq = max(1, spec.draft.num_draft)  # a step rolls back at most its drafts (llama.cpp: n_max)
        return cp

    def _make_context(self, spec: LoadSpec, cp: Any) -> None:
        """The context with the LoRA adapters on it, its memory and batch, and the sizes it ended up with."""
        import llama_cpp

        self._ctx = llama_cpp.llama_init_from_model(self._model, cp)
        if not self._ctx:
            self._ctx = None
            raise load_error("Failed to create llama_context", self._path, spec)
        self._loras = self._load_loras(spec.lora)
        self._apply_loras(self._ctx)
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self._n_rs_seq = int(llama_cpp.llama_n_rs_seq(self._ctx))  # 0: unsupported by the architecture, or off
        self._batch = llama_cpp.llama_batch_init(int(cp.n_batch), 0, 1)
        self._n_batch = int(llama_cpp.llama_n_batch(self._ctx))
        self._pool = int(llama_cpp.llama_n_ctx(self._ctx))
        self._n_ctx = min(spec.n_ctx, int(llama_cpp.llama_n_ctx_seq(self._ctx)))
        if self._pooling is not None:  # the context is the pooling one (made with this model's own pooling)
            self._n_ctx = min(self._n_ctx, int(llama_cpp.llama_model_n_ctx_train(self._model)) or self._n_ctx)
            self._embed = (self._ctx, self._batch, self._n_batch, cp.n_seq_max)

    def _make_prefill(self, spec: LoadSpec, cp: Any) -> None:
        """The flash-attention context for long prompt chunks (:mod:`backends.llamacpp._prefill`), where the spec
        asks for it and the load decodes with flash attention off over a KV stream per slot, with no projector (media
        positions) and no MTP draft (which reads the hidden states of every token the main context evaluates)."""
        if not (spec.prefill_flash_attn and spec.flash_attn is False and self._streams and self._proj is None
                and not (spec.draft is not None and spec.draft.kind == "mtp")):
            return
        pf = FlashPrefill(self._model, self._ctx, n_ctx=int(self._pool // self._n_seq_ids), n_batch=self._n_batch,
                          n_stream=self._n_seq_ids, n_threads=int(cp.n_threads),
                          n_threads_batch=int(cp.n_threads_batch), type_k=int(cp.type_k), type_v=int(cp.type_v),
                          row_view=self._row_view)
        try:
            self._apply_loras(pf.context)
            pf.check(self._bos if self._bos >= 0 else 0)
        except BaseException as e:
            pf.close()
            if not isinstance(e, (BackendError, ValueError)):
                raise
            log.warning("long prompts evaluated without flash attention: %s", e)
            return
        self._prefill = pf

    def _read_tokens(self, spec: LoadSpec, cp: Any) -> None:
        """What the model's memory is, its chat template, BOS/EOS, the caches of token facts, flash attention as it
        ended up, and the width of an input embedding."""
        import llama_cpp

        self._n_swa = int(llama_cpp.llama_model_n_swa(self._model))
        self._pure_recurrent = bool(llama_cpp.llama_model_is_recurrent(self._model))
        self._recurrent = self._pure_recurrent or bool(llama_cpp.llama_model_is_hybrid(self._model))
        self._template = spec.chat_template or self._md.get("tokenizer.chat_template")
        eos, bos = llama_cpp.llama_vocab_eos(self._vocab), llama_cpp.llama_vocab_bos(self._vocab)
        self._bos = int(bos)
        self._bos_text = self._token_text(bos) if bos >= 0 else ""
        self._eos_text = self._token_text(eos) if eos >= 0 else ""
        self._add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))
        self._piece_cache: dict[int, bytes] = {}
        self._eog_cache: dict[int, bool] = {}
        self._preserved: set[int] | None = None  # PRESERVED_MARKERS' token ids (on first use)
        self._formatters: dict[bool, Any] = {}
        self.flash_attn = flash_attn_enabled(self._ctx, cp, spec.kv_cache_type)
        # the width of an input embedding (an image's rows): n_embd, or more where the projector also feeds the
        # first layers (Qwen3-VL's deepstack: n_embd x (1 + deepstack layers)), as mtmd-helper reads it
        self._n_embd = int(llama_cpp.llama_model_n_embd_inp(self._model))

    def _load_projector(self, spec: LoadSpec) -> None:
        """The vision / audio encoder when the spec names an ``mmproj``."""
        if not spec.mmproj:
            return
        import llama_cpp

        from backends.llamacpp._vision import LoadedProjector

        forget_recent()
        self._proj = LoadedProjector(spec.mmproj, self._model, self._n_embd, n_threads=self.n_threads,
                                     use_gpu=spec.n_gpu_layers != 0 and bool(llama_cpp.llama_supports_gpu_offload()),
                                     log_callback=log_callback(), native_reason=native_reason,
                                     # M-RoPE images are evaluated whole: one fits in a step beside every slot
                                     max_image_tokens=max(8, self._n_batch - max(1, spec.slots)))

    def _watch_devices(self, spec: LoadSpec) -> None:
        """What llama.cpp allocated on each device (from its load log), and the watch on the RPC workers the load
        uses: a worker dying mid-step must not take the process with it (:func:`backends.llamacpp.devices.watch`)."""
        from backends.llamacpp import devices as ggml_devices

        self._alloc = allocations(getattr(capture, "lines", None) or [], ggml_devices.added_workers())
        capture.lines = None
        remote = ggml_devices.endpoints_of(list(spec.devices)) if spec.n_gpu_layers else []
        if remote:
            ggml_devices.watch(self, remote, self._worker_died)

    def _load_loras(self, loras: list[LoraAdapter]) -> list[tuple[Any, float]]:
        """LoRA adapters (``spec.lora``: adapter GGUFs and their scales) loaded on the model's weights; llama.cpp
        frees them with the model."""
        import llama_cpp

        out: list[tuple[Any, float]] = []
        for lora in loras:
            adapter = llama_cpp.llama_adapter_lora_init(self._model, str(lora.path).encode())
            if not adapter:
                name = Path(lora.path).name
                raise load_error(f"llama.cpp could not load the LoRA adapter {name} on this model", self._path,
                                 self.spec)
            out.append((adapter, float(lora.scale)))
        return out

    def _apply_loras(self, ctx: Any) -> None:
        """Put the loaded LoRA adapters, with their scales, on context ``ctx`` (the generation or embedding one)."""
        if not self._loras:
            return
        import llama_cpp

        n = len(self._loras)
        adapters = (llama_cpp.llama_adapter_lora_p_ctypes * n)(*[a for a, _ in self._loras])
        scales = (ctypes.c_float * n)(*[s for _, s in self._loras])
        if llama_cpp.llama_set_adapters_lora(ctx, adapters, n, scales) != 0:
            raise load_error("llama.cpp could not apply the LoRA adapters to the context", self._path, self.spec)

    def _build_info(self) -> ModelInfo:
        import llama_cpp

        md, arch = self._md, self._arch

        def num(key: str, default: int = 0) -> int:
            try:
                return int(float(md.get(f"{arch}.{key}", default)))
            except ValueError:
                return default

        n_layers = num("block_count")
        n_embd, n_head = num("embedding_length"), num("attention.head_count")
        n_head_kv = num("attention.head_count_kv", n_head)
        hd = n_embd // n_head if n_embd and n_head else 0
        hk, hv = num("attention.key_length", hd), num("attention.value_length", hd)
        kv_bytes = int(self._pool * n_layers * n_head_kv * (hk + hv) * KV_BYTES_PER_ELEM[self.spec.kv_cache_type])
        allocated = sum(v.get("kv", 0) for v in self._alloc.values())
        if allocated:  # what llama.cpp allocated: windowed layers at window size, recurrent states per sequence
            kv_bytes = allocated
        weights = int(llama_cpp.llama_model_size(self._model))
        gpu = bool(llama_cpp.llama_supports_gpu_offload())
        req = self.spec.n_gpu_layers
        offloaded = 0 if not gpu else (n_layers + 1 if req < 0 else min(req, n_layers + 1))
        frac = offloaded / (n_layers + 1) if n_layers else 0.0
        desc = ctypes.create_string_buffer(256)
        llama_cpp.llama_model_desc(self._model, desc, 256)
        proj_bytes = Path(self._proj.path).stat().st_size if self._proj is not None else 0
        return ModelInfo(
            architecture=arch,
            n_ctx=self._n_ctx,
            n_ctx_train=int(llama_cpp.llama_model_n_ctx_train(self._model)),
            n_layers=n_layers,
            n_vocab=self._n_vocab,
            chat_template=self._template,
            n_gpu_layers=offloaded,
            size_bytes=weights + kv_bytes + proj_bytes,
            vram_bytes=(sum(sum(v.values()) for d, v in self._alloc.items() if d != "CPU") if self._alloc
                        else int(weights * frac + (kv_bytes if offloaded else 0))),
            kv_cache_type=self.spec.kv_cache_type,
            draft=None,
            slots=max(1, self.spec.slots),
            kv_cells=self._pool,
            recurrent=self._recurrent,
            vision=self._proj is not None and self._proj.vision,
            audio=self._proj is not None and self._proj.audio,
            pooling=self._pooling,
            n_embd_out=int(llama_cpp.llama_model_n_cls_out(self._model)) if self._pooling == "rank"
            else int(llama_cpp.llama_model_n_embd_out(self._model)),
            kv_bytes=kv_bytes,
            weights_bytes=weights,
            projector=self._proj.path if self._proj is not None else None,
            projector_bytes=proj_bytes,
            n_params=int(llama_cpp.llama_model_n_params(self._model)),
            description=desc.value.decode("utf-8", errors="replace"),
            flash_attn=self.flash_attn,
            n_threads=self.n_threads,
            n_seq_ids=self._n_seq_ids,
            kv_streams=self._streams,
            sliding_window=self._n_swa,
            swa_full=self._swa_full,
            allocations=self._alloc,
        )

    # ------------------------------------------------------------------ what it is

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    @property
    def n_seq_ids(self) -> int:
        return self._n_seq_ids

    @property
    def n_batch(self) -> int:
        return self._n_batch

    @property
    def can_batch(self) -> bool:
        return True

    @property
    def fills_cpu(self) -> bool:
        return self.spec.n_gpu_layers == 0 and self.n_threads >= usable_cores()

    @property
    def shared_pool(self) -> bool:
        # a hybrid's attention cells are one unified pool too; streams: a step attends to its own sequences' cells
        return not self._streams and not self._pure_recurrent and self._pooling is None

    @property
    def model_handle(self) -> Any:
        """The ``llama_model *`` (for :mod:`backends.llamacpp.mtp`, which runs the model's MTP block beside this
        context)."""
        return self._model

    @property
    def context_handle(self) -> Any:
        """The ``llama_context *`` that evaluates this source's sequences."""
        return self._ctx

    @property
    def mtp_layers(self) -> int:
        """Multi-token-prediction layers loaded with the weights (0 unless the load asked for them)."""
        import llama_cpp

        return int(llama_cpp.llama_model_n_layer_nextn(self._model))

    def can_rewind(self) -> bool:
        """Plain and windowed caches drop a tail; recurrent memory only the tokens of its last decode, and only
        with llama.cpp's rollback states (``n_rs_seq``): what rejected drafts need, nothing more."""
        return not self._recurrent or self._n_rs_seq > 0

    @property
    def capabilities(self) -> Capabilities:
        """Media with a projector; checkpoints where the memory cannot drop its tail (recurrent, a window);
        sequence states and pooled outputs but on an embedding / rerank model (which keeps no states)."""
        return Capabilities(media=self if self._proj is not None else None,
                            checkpoints=self if self._recurrent or self._windowed else None,
                            states=self if self._pooling is None else None, pooling=self)

    @property
    def _windowed(self) -> bool:
        """Sliding-window layers whose cache holds less than a sequence's context (``swa_full`` off)."""
        return 0 < self._n_swa < self._n_ctx and not self._swa_full

    # ------------------------------------------------------------------ evaluation

    # ------------------------------------------------------------------ images
    def evaluate(self, feeds: Sequence[Feed]) -> list[list[int]]:
        self._saved_rows = []
        kinds = [bool(f.tokens) and is_image_token(f.tokens[0]) for f in feeds]
        if not any(kinds):
            return self._evaluate_tokens(feeds)
        for f, img in zip(feeds, kinds, strict=True):
            if any(is_image_token(t) != img for t in f.tokens):
                raise BackendError("A feed mixes image positions and text tokens; the loop must cut it.")
        img_feeds = [f for f, k in zip(feeds, kinds, strict=True) if k]
        txt_feeds = [f for f, k in zip(feeds, kinds, strict=True) if not k]
        img_rows = self._evaluate_images(img_feeds)  # first: the token decode's logits must be the last ones
        try:
            txt_rows = self._evaluate_tokens(txt_feeds)
        except BaseException:
            for f in img_feeds:  # memory unchanged, as the contract says: drop what the image decode wrote
                self.seq_rm(f.seq, f.pos, f.pos + len(f.tokens))
            raise
        it_img, it_txt = iter(img_rows), iter(txt_rows)
        return [next(it_img) if k else next(it_txt) for k in kinds]

    def _evaluate_tokens(self, feeds: Sequence[Feed]) -> list[list[int]]:
        """The feeds in the main context, but for prompt chunks the prefill context takes (after the main decode:
        a full pool raises before either ran); their logits rows are saved (negative row numbers)."""
        pf = self._prefill
        if pf is None:
            return self._decode(feeds)
        there = [pf.takes(f.seq, len(f.tokens), f.pos) for f in feeds]
        for f, t in zip(feeds, there, strict=True):
            if not t:  # a short chunk or a token after long chunks: the main context continues
                self._flush_prefill(f.seq)
        if not any(there):
            return self._decode(feeds)
        main = [f for f, t in zip(feeds, there, strict=True) if not t]
        main_rows = iter(self._decode(main))
        rows: list[list[int]] = []
        try:
            for f, t in zip(feeds, there, strict=True):
                if not t:
                    rows.append(next(main_rows))
                    continue
                if pf.seq is not None and (pf.seq != f.seq or pf.n != f.pos):
                    self._flush_prefill()  # another sequence is there
                out = pf.evaluate(f.seq, f.tokens, f.pos, f.outputs)
                rows.append([-(len(self._saved_rows) + i + 1) for i in range(len(out))])
                self._saved_rows.extend(out)
                if f.outputs:  # the prompt ends: the next step decodes in the main context
                    self._flush_prefill(f.seq)
        except BaseException:
            import llama_cpp

            for f in main:  # memory unchanged, as the contract says
                llama_cpp.llama_memory_seq_rm(self._mem, f.seq, f.pos, f.pos + len(f.tokens))
            raise
        return rows

    def _flush_prefill(self, seq: int | None = None, *, drop: bool = False) -> None:
        """Before the main context's memory of ``seq`` (None: whichever) is used: the cells the prefill context
        holds of it move in (``drop``: they are forgotten, the sequence is being replaced or cleared). A move that
        fails loses the sequence's prefix, which the pool believes is there: the model is unloaded (fatal)."""
        pf = self._prefill
        if pf is None or pf.seq is None or (seq is not None and pf.seq != seq):
            return
        if drop:
            pf.clear()
            return
        try:
            pf.flush()
        except BackendError as e:
            if self.on_fatal is not None:
                self.on_fatal(e)
            raise

    def prefill_counters(self) -> tuple[int, int]:
        pf = self._prefill
        return (pf.tokens, pf.moved_ns) if pf is not None else (0, 0)

    def _decode(self, feeds: Sequence[Feed]) -> list[list[int]]:
        import llama_cpp

        b = self._batch
        n = 0
        rows: list[list[int]] = [[] for _ in feeds]
        # streams: in the order of their sequence ids (llama.cpp gathers a batch's tokens by stream otherwise: a
        # step of 8 sequences out of order took ~25% longer)
        order = sorted(range(len(feeds)), key=lambda i: feeds[i].seq) if self._streams else range(len(feeds))
        for fi in order:
            f = feeds[fi]
            k = len(f.tokens)
            if n + k > self._n_batch:
                raise BackendError(f"A step of {n + k} tokens exceeds the batch size {self._n_batch}.")
            first_out = k - f.outputs
            mine = []
            for j, t in enumerate(f.tokens):
                i = n + j
                b.token[i] = t
                b.pos[i] = f.pos + j
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = f.seq
                out = j >= first_out
                b.logits[i] = out
                if out:
                    mine.append(i)
            n += k
            rows[fi] = mine
        b.n_tokens = n
        if n == 0:
            return rows
        rc = llama_cpp.llama_decode(self._ctx, b)
        if rc == 1:
            raise PoolFullError("No room in the KV cache for this step.")
        if rc != 0:
            raise BackendError(f"llama.cpp failed to evaluate the batch (llama_decode returned {rc}).")
        return rows

    def logits(self, row: int) -> Any:
        import llama_cpp

        if row < 0:
            return self._saved_rows[-row - 1].copy()
        ptr = llama_cpp.llama_get_logits_ith(self._ctx, row)
        if not ptr:
            raise BackendError(f"No logits for batch row {row}.")
        return self._row_view(ptr).copy()

    def _row_view(self, ptr: Any) -> Any:
        """The context's logits row at ``ptr`` as a float32 array, without a copy (valid until the next
        evaluation)."""
        return np.frombuffer(memoryview(self._row_type.from_address(ctypes.addressof(ptr.contents))), dtype=np.single)

    def sampler(self, sampling: Sampling, fmt: str | dict[str, Any] | ToolCallFormat | None) -> ChainSampler:
        check_logit_bias(sampling.logit_bias, self._n_vocab)
        if isinstance(fmt, ToolCallFormat) and not self.spec.tuning.tool_grammar:
            fmt = None
        return make_sampler(self, self._vocab, self._n_vocab, self._n_ctx, sampling, fmt, self.spec.tuning.grammar)

    # ------------------------------------------------------------------ KV cells

    def seq_rm(self, seq: int, p0: int = 0, p1: int = -1) -> bool:
        import llama_cpp

        self._flush_prefill(seq, drop=p0 <= 0 and p1 < 0)
        return bool(llama_cpp.llama_memory_seq_rm(self._mem, seq, p0, p1))

    def seq_cp(self, src: int, dst: int, n: int) -> bool:
        import llama_cpp

        self._flush_prefill(src)
        self._flush_prefill(dst, drop=True)
        llama_cpp.llama_memory_seq_rm(self._mem, dst, -1, -1)
        if self._recurrent:
            return False
        if self._streams:
            # another stream: llama.cpp copies only whole streams, and only at the next decode (a state read before
            # it would see the old cells), so the cells go through host memory; then the tail past n is dropped
            if n <= 0 or not self.copy_state(src, dst):
                llama_cpp.llama_memory_seq_rm(self._mem, dst, -1, -1)
                return n <= 0
            llama_cpp.llama_memory_seq_rm(self._mem, dst, n, -1)
            return True
        llama_cpp.llama_memory_seq_cp(self._mem, src, dst, 0, n)
        return True

    # ------------------------------------------------------------------ pooled outputs (embeddings, rerank)
    def embed(self, texts: list[str]) -> list[list[float]]:
        """L2-normalised embeddings, one per text (texts longer than the context are cut), in batches."""
        from backends.core import pooling
        return pooling.embed(lambda fn: fn(self), texts).vectors

    # ------------------------------------------------------------------ close

    def _worker_died(self, sentence: str) -> None:
        """An RPC worker this model uses stopped answering (called on ggml's thread, before it would abort)."""
        self._dead = sentence
        if self.on_fatal is not None:
            self.on_fatal(BackendError(sentence + "."))

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        from backends.llamacpp import devices as ggml_devices
        ggml_devices.unwatch(self)
        if getattr(self, "_dead", None):
            return  # freeing would talk to the dead worker: the memory is left to the process
        import llama_cpp

        if self._proj is not None:  # mtmd before its model and context
            self._proj.close()
            self._proj = None
        if self._ebatch is not None:
            llama_cpp.llama_batch_free(self._ebatch)
            self._ebatch = None
        if self._embed is not None:
            ctx, b, _, _ = self._embed
            self._embed = None
            if ctx is not self._ctx:  # a chat model's second context (an embedding model's is its only one)
                llama_cpp.llama_batch_free(b)
                llama_cpp.llama_free(ctx)
        if self._prefill is not None:
            self._prefill.close()
            self._prefill = None
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if self._model is not None:
            llama_cpp.llama_model_free(self._model)
            self._model = None
