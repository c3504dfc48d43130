"""GGUF models through llama-cpp-python (CPU, CUDA, Metal: whatever the installed build supports).

We drive the token loop ourselves on the ``Llama`` context (decode a batch, sample a row) instead of
``create_completion``, so that we own: the KV prefix reuse (consecutive requests evaluate only new
tokens), sampling and seeds, stop strings, cancellation per token, grammars, context overflow and
speculative decoding (draft model or prompt lookup, verified in one target batch, adaptive).

>>> from backends.base import LoadSpec, GenerateRequest, Sampling
>>> with LlamaCppBackend(LoadSpec("/tmp/models/smollm2.gguf", n_ctx=2048)) as b:     # doctest: +SKIP
...     req = GenerateRequest(messages=[{"role": "user", "content": "Hi"}], sampling=Sampling(seed=1, max_tokens=8))
...     print("".join(e.text for e in b.generate(req) if hasattr(e, "text")))

Traps of llama-cpp-python 0.3.36 handled here (see shared/reference/backends.md): unknown ``Llama``
kwargs are silently ignored (we pass only known ones), ``seed=0`` means "random" in the constructor
(we build our own sampler with the exact seed), a quantized V cache needs flash attention, a draft
model forces ``logits_all`` and an ``n_ctx × n_vocab`` buffer (we verify drafts on our own loop
instead), and a ``Llama`` is not thread-safe (one generation at a time per instance, under a lock).

Determinism: a request repeated with the same seed gives the same text, because the logits of the last
prompt token are kept and reused instead of re-evaluating that token alone (kernels are not
batch-invariant: one row evaluated alone differs in the last bits from the same row in a batch). For the
same reason speculative decoding at temperature 0 reproduces plain decoding exactly only on targets whose
kernels are batch-invariant: F32 on CPU (tested); F16 and quantized targets agree closely but can flip a
near-tie (measured: F16 + n-gram diverged after 662 characters, Q4_1 + n-gram identical for 201).

Backend-specific knobs in ``LoadSpec.extra``: ``chat_template`` (override the GGUF's), ``n_threads_batch``,
``use_mmap`` (default True), ``draft_p_min`` (a draft model stops proposing below this probability; 0).
"""

from __future__ import annotations

import ctypes
import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from backends._speculative import (
    ModelDraft,
    NgramDraft,
    SpecController,
    VocabInfo,
    common_prefix,
    decode,
    rewind,
    vocab_mismatch,
)
from backends._stops import StopMatcher, Utf8Stream, could_be_tool_call, parse_tool_calls
from backends.base import (
    KV_CACHE_TYPES,
    Backend,
    Done,
    Event,
    GenerateRequest,
    LoadSpec,
    ModelInfo,
    ModelLoadError,
    Sampling,
    Stats,
    TextChunk,
    ToolCalls,
    UnsupportedError,
    answer_reserve,
    check_fits,
    fit_messages,
)

log = logging.getLogger("backends.llamacpp")
native_log = logging.getLogger("backends.llamacpp.native")  # llama.cpp's own messages
native_log.addHandler(logging.NullHandler())  # quiet unless the application configures logging

# ggml type ids (llama_cpp.GGML_TYPE_*), block sizes and bytes per element of the KV cache types we offer
KV_GGML_TYPE = {"f16": 1, "q8_0": 8, "q4_0": 2}
KV_BLOCK = {"f16": 1, "q8_0": 32, "q4_0": 32}
KV_BYTES_PER_ELEM = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}

_FALLBACK_TEMPLATE = (  # ChatML, for GGUFs without a chat template (base models: chat is of little use)
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# ------------------------------------------------------------------------------------ native logging

# ggml_log_level: NONE=0, DEBUG=1, INFO=2, WARN=3, ERROR=4, CONT=5 (llama-cpp-python's _logger.py has the old order)
_GGML_LEVELS = {0: logging.CRITICAL, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_log_state: dict[str, Any] = {"cb": None, "level": logging.DEBUG, "buf": "", "verbose": False}
_recent_native: deque[str] = deque(maxlen=40)  # recent WARN/ERROR lines, to explain load failures


def _on_native_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    try:
        if level != 5:  # 5 = GGML_LOG_LEVEL_CONT: continues the previous message
            _log_state["level"] = _GGML_LEVELS.get(level, logging.DEBUG)
        lvl = _log_state["level"]
        _log_state["buf"] += text.decode("utf-8", errors="replace")
        if not _log_state["buf"].endswith("\n"):
            return
        msg, _log_state["buf"] = _log_state["buf"].rstrip(), ""
        if lvl >= logging.WARNING:
            _recent_native.append(msg)
        if native_log.isEnabledFor(lvl):
            native_log.log(lvl, "%s", msg)
    except Exception:  # never let an exception cross into C
        pass


def install_log_router(verbose: bool = False) -> None:
    """Route llama.cpp/ggml logging to the ``backends.llamacpp.native`` logger (quiet by default).

    ``verbose`` adds a stderr handler at DEBUG level (``LOCALLLM_DEBUG``). The ctypes callback is kept
    alive in module state: llama.cpp holds a raw pointer to it.
    """
    import llama_cpp

    if _log_state["cb"] is None:
        _log_state["cb"] = llama_cpp.llama_log_callback(_on_native_log)
        llama_cpp.llama_log_set(_log_state["cb"], ctypes.c_void_p(0))
    if verbose and not _log_state["verbose"]:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("llama.cpp: %(message)s"))
        native_log.addHandler(handler)
        native_log.setLevel(logging.DEBUG)
        _log_state["verbose"] = True


def _native_reason(*needles: str) -> str | None:
    """The most recent llama.cpp warning/error line containing one of ``needles`` (or the last one)."""
    for line in reversed(_recent_native):
        if not needles or any(n in line for n in needles):
            return line.split(": ", 1)[-1].strip().rstrip(".")
    return None


# ---------------------------------------------------------------------------------------- helpers


def physical_cores() -> int:
    """Physical CPU cores available to this process (threads for llama.cpp)."""
    n = None
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
    except Exception:
        pass
    logical = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(n or logical, logical))


def kv_type_problem(kv_type: str, head_dim_k: int, head_dim_v: int) -> str | None:
    """Why ``kv_type`` cannot be used for a model with these head sizes (one sentence), else None.

    >>> kv_type_problem("q8_0", 64, 64) is None
    True
    >>> kv_type_problem("q4_0", 128, 128) is None
    True
    >>> kv_type_problem("q8_0", 72, 72)
    'KV cache type q8_0 needs a head size that is a multiple of 32 (with flash attention), but this model has 72.'
    >>> kv_type_problem("q5_k", 64, 64)
    "KV cache type 'q5_k' is not supported; choose one of f16, q8_0, q4_0."
    """
    if kv_type not in KV_GGML_TYPE:
        return f"KV cache type {kv_type!r} is not supported; choose one of {', '.join(KV_CACHE_TYPES)}."
    block = KV_BLOCK[kv_type]
    for dim in (head_dim_k, head_dim_v):
        if dim and dim % block:
            return (f"KV cache type {kv_type} needs a head size that is a multiple of {block} "
                    f"(with flash attention), but this model has {dim}.")
    return None


def _head_dims_from_file(path: Path) -> tuple[int, int]:
    """(head_dim_k, head_dim_v) from the GGUF header via ggml's ``gguf`` reader; (0, 0) if unknown."""
    try:
        from gguf import GGUFReader

        fields = GGUFReader(str(path), "r").fields

        def val(key: str) -> Any:
            f = fields.get(key)
            return f.contents() if f is not None else None

        arch = val("general.architecture")
        n_embd, n_head = val(f"{arch}.embedding_length"), val(f"{arch}.attention.head_count")
        if isinstance(n_head, list):
            n_head = max(n_head)
        default = n_embd // n_head if n_embd and n_head else 0
        hk = int(val(f"{arch}.attention.key_length") or default)
        return hk, int(val(f"{arch}.attention.value_length") or default)
    except Exception:
        return 0, 0


def _check_gguf_file(path: Path) -> None:
    if not path.is_file():
        raise ModelLoadError(f"Model file not found: {path}.")
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise ModelLoadError(f"Cannot read model file {path}: {e.strerror}.") from None
    if len(head) < 8 or head[:4] != b"GGUF":
        raise ModelLoadError(f"{path.name} is not a GGUF model file (bad header); re-download it.")


def _seed32(seed: int | None) -> int:
    """A concrete 32-bit sampler seed. llama.cpp treats 0xFFFFFFFF as "random", so it is remapped; ``seed=0``
    stays 0 (llama-cpp-python's constructor would turn it into "random")."""
    if seed is None:
        return random.getrandbits(31)
    s = int(seed) & 0xFFFFFFFF
    return 0xFFFFFFFE if s == 0xFFFFFFFF else s


def _message_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") == "text":
                parts.append(str(p.get("text", "")))
            elif isinstance(p, str):
                parts.append(p)
            else:
                raise UnsupportedError("This model takes text only; image and audio parts are not supported.")
        return "".join(parts)
    return str(content)


class _Cancelled(Exception):
    pass


# ---------------------------------------------------------------------------------------- backend


class LlamaCppBackend(Backend):
    """One GGUF model loaded with llama-cpp-python. One sequence at a time (``max_parallel = 1``)."""

    name = "llamacpp"
    max_parallel = 1

    @classmethod
    def available(cls) -> tuple[bool, str]:
        try:
            import llama_cpp  # noqa: F401
        except Exception as e:  # ImportError, or a broken shared library (OSError)
            return False, f"llama-cpp-python is not importable ({e}); install it with: pip install llama-cpp-python"
        return True, ""

    # ------------------------------------------------------------------ load

    def __init__(self, spec: LoadSpec):
        super().__init__(spec)
        ok, why = self.available()
        if not ok:
            raise ModelLoadError(why)
        import llama_cpp

        install_log_router(spec.verbose)
        path = Path(spec.model_path)
        _check_gguf_file(path)
        kv = spec.kv_cache_type
        quantized_kv = kv != "f16"
        if kv not in KV_GGML_TYPE:
            raise UnsupportedError(kv_type_problem(kv, 0, 0) or f"KV cache type {kv!r} is not supported.")
        flash = bool(spec.flash_attn) or quantized_kv  # a quantized V cache needs flash attention
        if quantized_kv:
            problem = kv_type_problem(kv, *_head_dims_from_file(path))
            if problem:
                raise UnsupportedError(f"{path.name}: {problem} Use --kv-cache f16.")
        self.n_threads = spec.n_threads or physical_cores()
        self._lock = threading.Lock()
        self._closed = False
        self._embed_ctx: Any = None
        self._embed_lock = threading.Lock()
        self._draft: Any = None
        self._controller: SpecController | None = None
        self._formatters: dict[bool, Any] = {}
        self._last_prompt: list[int] | None = None  # the last prefilled prompt and its last row of logits
        self._last_logits: np.ndarray | None = None
        _recent_native.clear()
        kwargs = dict(
            n_ctx=spec.n_ctx,
            n_batch=spec.n_batch,
            n_ubatch=spec.n_batch,
            n_gpu_layers=spec.n_gpu_layers,
            n_threads=self.n_threads,
            n_threads_batch=int(spec.extra.get("n_threads_batch") or self.n_threads),
            type_k=KV_GGML_TYPE[kv],
            type_v=KV_GGML_TYPE[kv],
            flash_attn=flash,
            use_mmap=bool(spec.extra.get("use_mmap", True)),
            logits_all=False,
            embedding=False,
            verbose=spec.verbose,
        )
        try:
            self._llm = llama_cpp.Llama(str(path), **kwargs)
        except ValueError as e:
            raise self._load_error(path, str(e), kv, flash) from None
        except (OSError, RuntimeError) as e:
            raise ModelLoadError(f"Could not load {path.name}: {e}.") from None
        self.flash_attn = flash
        llm = self._llm
        md = llm.metadata
        self._md = md
        self._model = llm._model
        self._vocab = llm._model.vocab
        self._n_vocab = llm.n_vocab()
        self._n_ctx = llm.n_ctx()
        arch = md.get("general.architecture", "unknown")
        self._arch = arch
        self._recurrent = bool(llama_cpp.llama_model_is_recurrent(llm.model)) or bool(
            llama_cpp.llama_model_is_hybrid(llm.model))
        self._template = spec.extra.get("chat_template") or md.get("tokenizer.chat_template")
        eos, bos = self._model.token_eos(), self._model.token_bos()
        self._bos_text = self._model.token_get_text(bos) if bos >= 0 else ""
        self._eos_text = self._model.token_get_text(eos) if eos >= 0 else ""
        self._add_bos = self._model.add_bos_token()
        self._piece_cache: dict[int, bytes] = {}
        self._eog_cache: dict[int, bool] = {}
        self._info = self._build_info(path)
        try:
            if spec.draft is not None:
                self._setup_draft(spec)
            if spec.embedding:
                self._ensure_embed_ctx()
        except BaseException:
            self.close()
            raise

    def _load_error(self, path: Path, msg: str, kv: str, flash: bool) -> Exception:
        if "Failed to create llama_context" in msg:
            reason = _native_reason("cache", "flash", "memory", "alloc", "n_ctx", "head")
            if kv != "f16" and reason and ("cache" in reason or "flash" in reason or "head" in reason):
                return UnsupportedError(f"{path.name} cannot use a {kv} KV cache: llama.cpp says \"{reason}\"; "
                                        "use --kv-cache f16.")
            if reason and ("memory" in reason or "alloc" in reason):
                return ModelLoadError(f"Not enough memory for a {self.spec.n_ctx}-token context with {path.name} "
                                      f"(llama.cpp: {reason}); lower num_ctx or the GPU layers.")
            return ModelLoadError(f"llama.cpp could not create a context for {path.name}"
                                  f"{f' ({reason})' if reason else ''}; lower num_ctx or try --kv-cache f16.")
        if "Failed to load model" in msg:
            reason = _native_reason("error loading model", "invalid", "unknown", "not within") or _native_reason()
            reason = reason.replace("error loading model: ", "").split(",")[0] if reason else None
            return ModelLoadError(f"{path.name} could not be loaded: it is corrupt, truncated or of an unsupported "
                                  f"architecture{f' (llama.cpp: {reason})' if reason else ''}.")
        return ModelLoadError(f"Could not load {path.name}: {msg}.")

    def _build_info(self, path: Path) -> ModelInfo:
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
        kv_bytes = int(self._n_ctx * n_layers * n_head_kv * (hk + hv) * KV_BYTES_PER_ELEM[self.spec.kv_cache_type])
        weights = int(self._model.size())
        gpu = bool(llama_cpp.llama_supports_gpu_offload())
        req = self.spec.n_gpu_layers
        offloaded = 0 if not gpu else (n_layers + 1 if req < 0 else min(req, n_layers + 1))
        frac = offloaded / (n_layers + 1) if n_layers else 0.0
        return ModelInfo(
            architecture=arch,
            n_ctx=self._n_ctx,
            n_ctx_train=self._model.n_ctx_train(),
            n_layers=n_layers,
            n_vocab=self._n_vocab,
            chat_template=self._template,
            n_gpu_layers=offloaded,
            size_bytes=weights + kv_bytes,
            vram_bytes=int(weights * frac + (kv_bytes if offloaded else 0)),
            kv_cache_type=self.spec.kv_cache_type,
            draft=None,
            extra={
                "path": str(path),
                "n_params": int(self._model.n_params()),
                "weights_bytes": weights,
                "kv_bytes": kv_bytes,
                "flash_attn": self.flash_attn,
                "n_threads": self.n_threads,
                "gpu_offload_supported": gpu,
                "description": self._model.desc(),
                "recurrent": self._recurrent,
                "chat_template_fallback": self._template is None,
            },
        )

    # ------------------------------------------------------------------ draft

    def _setup_draft(self, spec: LoadSpec) -> None:
        import llama_cpp

        d = spec.draft
        assert d is not None
        if self._recurrent:
            raise UnsupportedError(
                f"Speculative decoding is not available for {self._arch} models: a recurrent/hybrid model "
                "cannot roll back rejected draft tokens; use --draft none.")
        if d.kind == "ngram":
            self._draft = NgramDraft(num_pred_tokens=max(1, d.num_draft))
            self._info.draft = "ngram"
        elif d.kind == "model":
            if not d.path:
                raise UnsupportedError("A draft model needs a path to its file.")
            dpath = Path(d.path)
            _check_gguf_file(dpath)
            try:
                draft_llm = llama_cpp.Llama(
                    str(dpath), n_ctx=self._n_ctx, n_batch=self.spec.n_batch, n_ubatch=self.spec.n_batch,
                    n_gpu_layers=d.n_gpu_layers, n_threads=self.n_threads, n_threads_batch=self.n_threads,
                    logits_all=False, verbose=spec.verbose)
            except ValueError as e:
                raise ModelLoadError(f"Draft model {dpath.name} could not be loaded ({e}).") from None
            problem = vocab_mismatch(VocabInfo.of(self._llm), VocabInfo.of(draft_llm))
            if problem is None and (llama_cpp.llama_model_is_recurrent(draft_llm.model)
                                    or llama_cpp.llama_model_is_hybrid(draft_llm.model)):
                problem = f"The draft model {dpath.name} is recurrent/hybrid and cannot roll back rejected tokens."
            if problem:
                draft_llm.close()
                raise UnsupportedError(problem)
            self._draft = ModelDraft(draft_llm, num_pred_tokens=max(1, d.num_draft),
                                     p_min=float(spec.extra.get("draft_p_min", 0.0)))
            self._info.draft = str(dpath)
            self._info.size_bytes += int(draft_llm._model.size())
        else:
            raise UnsupportedError(f"Unknown draft kind {d.kind!r}; use a model or ngram.")
        self._controller = SpecController(max(1, d.num_draft))

    # ------------------------------------------------------------------ properties

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def controller(self) -> SpecController | None:
        """The speculative-decoding controller (None without a draft)."""
        return self._controller

    # ------------------------------------------------------------------ tokens

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        return self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)

    def detokenize(self, tokens: list[int]) -> str:
        """Text of ``tokens``; special tokens are written out (``<|im_start|>``), so prompts read back whole."""
        import llama_cpp

        arr = (llama_cpp.llama_token * len(tokens))(*tokens)
        size = max(64, 8 * len(tokens))
        for _ in range(2):  # llama_detokenize returns -needed when the buffer is too small
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_detokenize(self._vocab, arr, len(tokens), buf, size, False, True)
            if n >= 0:
                return buf.raw[:n].decode("utf-8", errors="replace")
            size = -n
        return ""

    def _piece(self, tok: int) -> bytes:
        """The bytes of one token (cached). llama-cpp-python's own helper pads them to 32 bytes with NULs."""
        p = self._piece_cache.get(tok)
        if p is None:
            import llama_cpp

            size = 32
            while True:
                buf = ctypes.create_string_buffer(size)
                n = llama_cpp.llama_token_to_piece(self._vocab, tok, buf, size, 0, False)
                if n >= 0:
                    p = buf.raw[:n]
                    break
                size = -n
            self._piece_cache[tok] = p
        return p

    # ------------------------------------------------------------------ prompts

    def _formatter(self, add_generation_prompt: bool) -> Any:
        f = self._formatters.get(add_generation_prompt)
        if f is None:
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            f = Jinja2ChatFormatter(template=self._template or _FALLBACK_TEMPLATE, eos_token=self._eos_text,
                                    bos_token=self._bos_text, add_generation_prompt=add_generation_prompt)
            self._formatters[add_generation_prompt] = f
        return f

    def supports_tools(self) -> bool:
        return bool(self._template) and "tools" in self._template

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True) -> str:
        """The prompt text the model's chat template makes of ``messages``."""
        msgs = []
        for m in messages:
            m2 = dict(m)
            m2["content"] = _message_text(m.get("content"))
            if m2.get("images"):
                raise UnsupportedError("This model takes text only; images are not supported.")
            msgs.append(m2)
        try:
            return self._formatter(add_generation_prompt)(messages=msgs, tools=tools).prompt
        except UnsupportedError:
            raise
        except Exception as e:  # jinja errors, raise_exception() from the template
            raise UnsupportedError(f"The chat template of this model rejected the messages: {e}.") from None

    def _tokens_for_text(self, text: str) -> list[int]:
        add_bos = self._add_bos and not (self._bos_text and text.startswith(self._bos_text))
        return self._llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)

    def _answer_reserve(self, s: Sampling) -> int:
        return answer_reserve(s.max_tokens, self._n_ctx)

    def prompt_tokens(self, request: GenerateRequest) -> tuple[list[int], int]:
        """(prompt tokens, messages dropped to fit the context), by :func:`backends.base.fit_messages`'s
        policy. Raises :class:`ContextOverflowError`."""
        dropped = 0
        if request.prompt is not None:
            toks = self._tokens_for_text(request.prompt)
            check_fits(len(toks), self._n_ctx)
        else:
            if request.tools and not self.supports_tools():
                raise UnsupportedError(f"The chat template of {Path(self.spec.model_path).name} does not "
                                       "support tools.")
            tools = request.tools or None
            toks, dropped = fit_messages(
                list(request.messages or []),
                lambda msgs: self._tokens_for_text(self.render_chat(msgs, tools, request.add_generation_prompt)),
                self._n_ctx, self._answer_reserve(request.sampling))
        if not toks:
            toks = [self._model.token_bos() if self._model.token_bos() >= 0 else self._model.token_eos()]
        return toks, dropped

    # ------------------------------------------------------------------ sampling

    def _grammar_sampler(self, fmt: str | dict[str, Any] | None) -> Any:
        """A llama.cpp grammar sampler for ``format`` (None when unconstrained)."""
        if fmt is None or fmt == "" or fmt == "text":
            return None
        import json

        import llama_cpp
        from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

        if fmt == "json":
            gbnf = JSON_GBNF
        elif isinstance(fmt, dict):
            try:
                gbnf = json_schema_to_gbnf(json.dumps(fmt))
            except Exception as e:
                raise UnsupportedError(f"This JSON schema cannot be turned into a grammar ({e}).") from None
            # the converter lets raw control characters into strings, which is not JSON: forbid them
            gbnf = gbnf.replace('char ::= [^"\\\\]', 'char ::= [^"\\\\\\x7F\\x00-\\x1F]')
        else:
            raise UnsupportedError(f"Unknown format {fmt!r}; use \"json\" or a JSON schema.")
        _recent_native.clear()
        smpl = llama_cpp.llama_sampler_init_grammar(self._vocab, gbnf.encode(), b"root")
        if not smpl:
            why = _native_reason()
            raise UnsupportedError(f"llama.cpp rejected the grammar for this format{f' ({why})' if why else ''}.")
        return smpl

    def _make_sampler(self, s: Sampling, fmt: str | dict[str, Any] | None) -> Any:
        import llama_cpp
        from llama_cpp import _internals as internals

        grammar = self._grammar_sampler(fmt)  # first: it may raise
        smp = internals.LlamaSampler()
        if s.repeat_penalty not in (0, 1.0) or s.presence_penalty or s.frequency_penalty:
            last_n = self._n_ctx if s.repeat_last_n == -1 else max(0, s.repeat_last_n)
            smp.add_penalties(self._n_vocab, last_n, s.repeat_penalty or 1.0, s.frequency_penalty,
                              s.presence_penalty)
        if grammar is not None:
            llama_cpp.llama_sampler_chain_add(smp.sampler, grammar)  # the chain owns it now
        if s.temperature is None or s.temperature <= 0:
            smp.add_greedy()
        else:
            if s.top_k and s.top_k > 0:
                smp.add_top_k(int(s.top_k))
            if s.top_p is not None and 0 < s.top_p < 1:
                smp.add_top_p(float(s.top_p), 1)
            if s.min_p and s.min_p > 0:
                smp.add_min_p(float(s.min_p), 1)
            smp.add_temp(float(s.temperature))
            smp.add_dist(_seed32(s.seed))
        return smp

    # ------------------------------------------------------------------ generation

    def generate(self, request: GenerateRequest, cancel: threading.Event | None = None) -> Iterator[Event]:
        """Stream the answer to ``request``; see :class:`backends.base.Backend`."""
        if self._closed:
            raise ModelLoadError("This model has been unloaded.")
        with self._lock:
            yield from self._generate(request, cancel)

    def _prefill(self, toks: list[int], cancel: threading.Event | None) -> tuple[int, bool]:
        """Make the KV cache hold ``toks`` with logits for the last one ready to sample.

        Returns (prompt tokens reused from the cache, whether the first token must be sampled from the
        saved logits of the previous identical prompt). Re-evaluating the last prompt token alone would give
        logits that differ in the last bits from the batched ones (CPU/GPU kernels are not batch-invariant),
        so a repeated request with the same seed would not reproduce its text; the saved row avoids that.
        """
        llm = self._llm
        keep = common_prefix(llm.input_ids[: llm.n_tokens], np.asarray(toks, dtype=np.intc))
        if (keep >= len(toks) and self._last_logits is not None and self._last_prompt is not None
                and len(self._last_prompt) == len(toks) and self._last_prompt == toks and rewind(llm, len(toks))):
            return len(toks), True
        if keep >= len(toks):
            keep = len(toks) - 1  # the last prompt token is evaluated again for its logits
        if not rewind(llm, keep):
            llm.reset()  # recurrent/hybrid memory: no partial removal
            keep = 0
        self._last_prompt = self._last_logits = None
        rest = toks[keep:]
        step = llm.n_batch
        for i in range(0, len(rest), step):
            if cancel is not None and cancel.is_set():
                raise _Cancelled
            decode(llm, rest[i : i + step], logits_all=False)
        import llama_cpp

        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        self._last_logits = np.array(np.ctypeslib.as_array(ptr, shape=(self._n_vocab,)), dtype=np.single)
        self._last_prompt = list(toks)
        return keep, False

    def _sample_saved(self, sampler: Any) -> int:
        """Sample from the saved logits of the last prompt token (see :meth:`_prefill`)."""
        import llama_cpp
        from llama_cpp import _internals as internals

        cur = internals.LlamaTokenDataArray(n_vocab=self._n_vocab)
        cur.copy_logits(self._last_logits)
        llama_cpp.llama_sampler_apply(sampler.sampler, ctypes.byref(cur.candidates))
        tok = int(cur.candidates_data.id[cur.candidates.selected])
        llama_cpp.llama_sampler_accept(sampler.sampler, tok)
        return tok

    def _generate(self, request: GenerateRequest, cancel: threading.Event | None) -> Iterator[Event]:
        s = request.sampling
        llm = self._llm
        stats = Stats(n_ctx=self._n_ctx)
        toks, stats.dropped_messages = self.prompt_tokens(request)
        sampler = self._make_sampler(s, request.format)
        stats.prompt_eval_count = len(toks)
        stops = StopMatcher(s.stop)
        utf8 = Utf8Stream()
        tool_mode = bool(request.tools)
        tool_buf = ""  # text held while it may be a tool call
        is_eog = self._is_eog
        draft = self._draft
        ctl = self._controller
        max_new = self._n_ctx - len(toks)
        if s.max_tokens is not None and s.max_tokens > 0:
            max_new = min(max_new, s.max_tokens)
        finish: str | None = None
        hit_stop = False
        n_gen = 0
        t0 = time.perf_counter_ns()
        try:
            from_saved = False
            try:
                stats.prompt_cached_tokens, from_saved = self._prefill(toks, cancel)
            except _Cancelled:
                finish = "cancelled"
            stats.prompt_eval_duration = time.perf_counter_ns() - t0
            last: int | None = None  # sampled, emitted, not yet in the KV cache
            while finish is None:
                if cancel is not None and cancel.is_set():
                    finish = "cancelled"
                    break
                t_step = time.perf_counter_ns()
                drafts: list[int] = []
                if last is None:
                    out = [self._sample_saved(sampler) if from_saved else sampler.sample(llm._ctx, -1)]
                else:
                    room = min(max_new - n_gen - 1, self._n_ctx - llm.n_tokens - 2)
                    k = min(ctl.n_draft(), room) if (draft is not None and ctl is not None) else 0
                    if k > 0:
                        seq = np.append(llm.input_ids[: llm.n_tokens], np.intc(last))
                        drafts = [int(t) for t in draft(seq, n=k, max_catchup=ctl.max_catchup())[:k]]
                    if llm.n_tokens + 1 + len(drafts) > self._n_ctx:
                        finish = "length"
                        break
                    base = llm.n_tokens
                    decode(llm, [last, *drafts], logits_all=bool(drafts))
                    if not drafts:
                        out = [sampler.sample(llm._ctx, -1)]
                    else:
                        out = []
                        for j in range(len(drafts) + 1):
                            tok = sampler.sample(llm._ctx, j)
                            out.append(tok)
                            if j == len(drafts) or tok != drafts[j] or is_eog(tok):
                                break
                        accepted = len(out) - 1
                        stats.draft_proposed += len(drafts)
                        stats.draft_accepted += accepted
                        rewind(llm, base + 1 + accepted)  # drop the rejected drafts from the KV cache
                decoded = last is not None  # the first token comes from the prompt's logits: no decode step
                last = out[-1]
                step_ns = time.perf_counter_ns() - t_step
                stats.eval_duration += step_ns
                if ctl is not None and decoded:
                    catchup = getattr(draft, "catchup_ns", 0) if k > 0 else 0  # paid from the budget
                    ctl.record(proposed=len(drafts), accepted=len(out) - 1 if drafts else 0, emitted=len(out),
                               ns=step_ns, overhead_ns=catchup)
                for tok in out:
                    if is_eog(tok):
                        finish = "stop"
                        break
                    n_gen += 1
                    text = utf8.push(self._piece(tok))
                    if text:
                        emit, hit_stop = stops.push(text)
                        if tool_mode and (tool_buf or emit) and could_be_tool_call(tool_buf + emit):
                            tool_buf, emit = tool_buf + emit, ""
                        elif tool_buf:
                            emit, tool_buf = tool_buf + emit, ""
                        if emit:
                            yield TextChunk(emit)
                        if hit_stop:
                            finish = "stop"
                            break
                    if n_gen >= max_new:
                        finish = "length"
                        break
            if not hit_stop:  # flush what was held back: an incomplete character, a stop-string prefix
                emit, hit_stop = stops.push(utf8.flush())
                if not hit_stop:
                    emit += stops.flush()
                if tool_buf or (tool_mode and emit and could_be_tool_call(emit)):
                    tool_buf, emit = tool_buf + emit, ""
                if emit:
                    yield TextChunk(emit)
            if tool_buf:
                calls = parse_tool_calls(tool_buf) if finish != "cancelled" else None
                if calls is not None:
                    yield ToolCalls(calls)
                else:
                    yield TextChunk(tool_buf)
            stats.eval_count = n_gen
            stats.context_used = llm.n_tokens
            stats.total_duration = time.perf_counter_ns() - t0
            yield Done(stats=stats, finish_reason=finish or "stop")  # type: ignore[arg-type]
        finally:
            sampler.close()

    def _is_eog(self, tok: int) -> bool:
        """End-of-generation token (EOS, EOT, <|im_end|>...), as llama.cpp's vocab says; memoised."""
        v = self._eog_cache.get(tok)
        if v is None:
            import llama_cpp

            v = self._eog_cache[tok] = bool(llama_cpp.llama_vocab_is_eog(self._vocab, tok))
        return v

    # ------------------------------------------------------------------ embeddings

    def _ensure_embed_ctx(self) -> Any:
        """A second context on the same weights, with mean pooling, for embeddings (made on first use)."""
        if self._embed_ctx is None:
            import llama_cpp
            from llama_cpp import _internals as internals

            n = min(self._n_ctx, 2048)
            p = llama_cpp.llama_context_default_params()
            p.n_ctx = n
            p.n_batch = n
            p.n_ubatch = n
            p.n_seq_max = 1
            p.n_threads = self.n_threads
            p.n_threads_batch = self.n_threads
            p.embeddings = True
            p.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_MEAN
            try:
                ctx = internals.LlamaContext(model=self._model, params=p, verbose=False)
            except ValueError:
                raise ModelLoadError("llama.cpp could not create an embedding context for this model.") from None
            batch = internals.LlamaBatch(n_tokens=n, embd=0, n_seq_max=1, verbose=False)
            self._embed_ctx = (ctx, batch, n)
        return self._embed_ctx

    def embed(self, texts: list[str]) -> list[list[float]]:
        """Mean-pooled, L2-normalised embeddings, one per text (texts longer than the context are cut)."""
        import llama_cpp

        with self._embed_lock:
            ctx, batch, n = self._ensure_embed_ctx()
            n_embd = llama_cpp.llama_model_n_embd(self._model.model)
            out: list[list[float]] = []
            for text in texts:
                toks = self._llm.tokenize(text.encode("utf-8"), add_bos=self._add_bos, special=False)[:n]
                if not toks:
                    toks = [max(self._model.token_bos(), 0)]
                ctx.kv_cache_clear()
                batch.set_batch(toks, n_past=0, logits_all=True)
                ctx.decode(batch)
                ptr = llama_cpp.llama_get_embeddings_seq(ctx.ctx, 0)
                if not ptr:
                    ptr = llama_cpp.llama_get_embeddings_ith(ctx.ctx, -1)
                v = np.array(np.ctypeslib.as_array(ptr, shape=(n_embd,)), dtype=np.float64)
                norm = float(np.linalg.norm(v))
                out.append((v / norm if norm > 0 else v).tolist())
            return out

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        if not self._lock.acquire(timeout=10):  # a generation still runs: freeing now would crash it
            log.warning("llama.cpp model %s is still generating; not freed", self.spec.model_path)
            return
        try:
            if self._embed_ctx is not None:
                ctx, batch, _ = self._embed_ctx
                batch.close()
                ctx.close()
                self._embed_ctx = None
            if isinstance(self._draft, ModelDraft):
                self._draft.close()
            self._draft = None
            llm = getattr(self, "_llm", None)
            if llm is not None:
                llm.close()
        finally:
            self._lock.release()
