"""MLX backend (mlx-lm): Apple Silicon's native runtime; also runs on Linux with ``mlx[cpu]`` (tests).

Loads an MLX model directory (``config.json``, ``model*.safetensors`` 4/8-bit, HF tokenizer), e.g. an
``mlx-community`` repo or one built offline from a GGUF by :mod:`backends.mlx_convert`::

    >>> from backends.base import GenerateRequest, LoadSpec, Sampling
    >>> with MLXBackend(LoadSpec(model_path="smollm2-mlx", n_ctx=2048)) as b:        # doctest: +SKIP
    ...     for ev in b.generate(GenerateRequest(messages=[{"role": "user", "content": "Hi"}],
    ...                                          sampling=Sampling(temperature=0, max_tokens=8))):
    ...         print(ev)

What mlx-lm leaves to us, done here: stop strings (held back until they cannot be a stop prefix, never
leaked), seeds (``mx.random.seed``), penalties over the whole context (mlx-lm only sees the tokens fed in
this call, which would change the output once a prefix is cached), a prompt cache kept across requests
(trimmed to the common prefix, only new tokens fed), KV quantization from the KV type (created quantized
from the first token), cancellation per token, structured output (``format="json"`` and a common subset
of JSON Schema: a logits processor over a byte-level automaton, :mod:`backends.mlx_json`), tool calls
through mlx-lm's tool parsers, embeddings (mean pooled), and speculative decoding (draft model or n-gram
lookup) with a cost-model controller that decodes plainly wherever drafting cannot pay
(:class:`_DraftController`).

Not supported, refused with :class:`UnsupportedError` rather than ignored: schema keywords outside that
subset (``$ref``, ``anyOf``, ``pattern``...: use llama.cpp), images, tools with a chat template that does
not take them, KV quantization with a rotating (sliding-window) cache or a head size not divisible by 32,
drafts with another vocabulary or an untrimmable cache. ``n_gpu_layers``/``n_threads`` do not apply: MLX
runs the whole model on its device.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from backends.base import (
    Backend,
    Done,
    Event,
    GenerateRequest,
    LoadSpec,
    ModelInfo,
    ModelLoadError,
    Stats,
    TextChunk,
    ToolCalls,
    UnsupportedError,
    answer_reserve,
    fit_messages,
)

KV_BITS = {"f16": None, "q8_0": 8, "q4_0": 4}


class _ThreadRelease:
    """Frees the MLX state of the thread that holds it, as that thread ends.

    MLX keeps per-thread state: streams (``mlx_lm``'s ``generation_stream`` is a thread-local stream) and
    the ``mx.compile`` cache, whose entries hold Python callables (mlx-lm compiles its activations and
    samplers). If a thread that ran a model simply ends, C++ destroys that cache in the thread's TLS
    destructors, after Python has let the thread go; the destructors take the GIL, and if the interpreter
    is finalizing by then, CPython ends the thread with ``pthread_exit`` inside a ``noexcept`` destructor:
    ``terminate called without an active exception``, exit 134. ``mx.clear_streams()`` empties both while
    the thread is still a Python thread. The thread can run no MLX work after it, so it is called from
    here: an instance lives in a ``threading.local`` and Python drops it (and runs ``__del__``, on that
    thread, with the GIL) when the thread's state is cleared, before ``Thread.join()`` returns.
    """

    def __del__(self) -> None:
        import mlx.core as mx

        clear = getattr(mx, "clear_streams", None)  # mlx >= 0.32
        if clear is not None:
            try:
                clear()
            except Exception:  # noqa: BLE001 - the thread is ending; nothing to report to
                pass


_thread_state = threading.local()


def _hold_thread() -> None:
    """Mark the current thread as one that runs MLX work, so its MLX state is freed when it ends. The main
    thread is left alone: its state lives until the process exits, which MLX handles itself."""
    if threading.current_thread() is threading.main_thread():
        return
    if getattr(_thread_state, "release", None) is None:
        _thread_state.release = _ThreadRelease()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _DraftController:
    """Decides per round how many tokens to draft (0 = plain decoding), from a cost model.

    ``c`` is the cost of one draft step and ``v[k]`` the cost of verifying ``k`` drafts (one target
    pass over ``k + 1`` tokens), both in units of one plain target step, measured at load. With a
    per-token acceptance ``a`` (running average), a round of ``k`` drafts yields on average
    ``(1 - a**(k+1)) / (1 - a)`` tokens for ``k*c + v[k]`` steps of cost. The controller drafts the
    ``k`` with the best expected speed-up and decodes plainly when none beats 1. If even perfect
    acceptance could not gain 5% (e.g. mlx's CPU backend, where a pass over 5 tokens costs 5 steps)
    drafting is off for good. While plain, it re-probes with one small round every ``probe_every``
    tokens (the interval doubles after each probe that does not pay), so a better acceptance is noticed.

    >>> c = _DraftController(4, draft_cost=0.1, verify_cost={k: 1 + 0.05 * k for k in range(5)})
    >>> c.next_k() > 0, c.disabled
    (True, '')
    >>> for _ in range(20): c.record(c.next_k() or 4, 0)
    >>> c.next_k()                                   # nothing accepted: back off to plain decoding
    0
    >>> _DraftController(4, draft_cost=1.0, verify_cost={k: 1.0 + k for k in range(5)}).disabled != ''
    True
    """

    def __init__(
        self,
        k_max: int,
        draft_cost: float,
        verify_cost: dict[int, float],
        *,
        force: bool = False,
        probe_every: int = 64,
    ):
        self.k_max = max(1, k_max)
        self.c = draft_cost
        self.v = verify_cost
        self.force = force
        self.accept = 0.7  # optimistic start, corrected after the first rounds
        self.probe_every = probe_every
        self._since_probe = 0
        best = max(self._speedup(k, 1.0) for k in range(1, self.k_max + 1))
        self.disabled = (
            ""
            if force or best >= 1.05
            else f"drafting cannot pay on this device (best case {best:.2f}x: a {self.k_max}-token round costs "
            f"{self.k_max * self.c + self.v[self.k_max]:.1f} plain steps)"
        )
        self.probing = False

    def _speedup(self, k: int, a: float) -> float:
        tokens = k + 1 if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)
        return tokens / (k * self.c + self.v[k])

    def best_k(self) -> tuple[int, float]:
        return max(((k, self._speedup(k, self.accept)) for k in range(1, self.k_max + 1)), key=lambda x: x[1])

    def next_k(self) -> int:
        self.probing = False
        if self.force:
            return self.k_max
        if self.disabled:
            return 0
        k, gain = self.best_k()
        if gain > 1.0:
            return k
        if self._since_probe >= self.probe_every:
            self._since_probe = 0
            self.probe_every = min(self.probe_every * 2, 4096)
            self.probing = True
            return 1
        return 0

    def plain_run(self) -> int:
        """How many tokens to decode plainly before the next probe."""
        return max(1, self.probe_every - self._since_probe)

    def record(self, k: int, accepted: int, tokens: int = 1) -> None:
        if k > 0:  # per-token acceptance, weighted by the tokens proposed
            rate = accepted / k
            w = min(0.5, 0.1 * k)
            self.accept = (1 - w) * self.accept + w * rate
        else:
            self._since_probe += tokens


class MLXBackend(Backend):
    """One MLX model (plus an optional draft). Generations are serialised by a lock; safe to call
    from any thread (mlx-lm 0.32 uses thread-local streams)."""

    name = "mlx"
    max_parallel = 1

    def __init__(self, spec: LoadSpec):
        super().__init__(spec)
        ok, why = self.available()
        if not ok:
            raise ModelLoadError(why)
        import mlx.core as mx
        import mlx_lm
        from mlx_lm.models.cache import make_prompt_cache

        _hold_thread()
        self._mx = mx
        self._lock = threading.Lock()
        self._closed = False
        path = Path(spec.model_path)
        self._model, self._tok, self._config = self._load_dir(path, "model")
        self._n_ctx_train = int(self._config.get("max_position_embeddings") or 0) or 4096
        self._n_ctx = spec.n_ctx if spec.n_ctx and spec.n_ctx > 0 else self._n_ctx_train
        self._eos = set(self._tok.eos_token_ids)

        # KV cache type → quantized cache from the first token
        kv_type = spec.kv_cache_type or "f16"
        if kv_type not in KV_BITS:
            raise UnsupportedError(f"KV cache type {kv_type!r} is not supported on MLX (choose f16, q8_0 or q4_0).")
        self._kv_bits = KV_BITS[kv_type]
        self._kv_group = 64
        probe_cache = make_prompt_cache(self._model)
        kinds = {type(c).__name__ for c in probe_cache}
        if self._kv_bits is not None:
            if kinds - {"KVCache"}:
                raise UnsupportedError(
                    f"KV cache quantization ({kv_type}) needs a plain KV cache, and this model uses "
                    f"{', '.join(sorted(kinds))} (sliding-window caches cannot be quantized in mlx-lm)."
                )
            head_dim = self._head_dim()
            group = next((g for g in (64, 32) if head_dim % g == 0), None)
            if group is None:
                raise UnsupportedError(
                    f"KV cache quantization ({kv_type}) needs a head size divisible by 32, "
                    f"and this model's is {head_dim}."
                )
            self._kv_group = group

        # speculative decoding
        self._draft_model = None
        self._draft_kind: str | None = None
        self._controller: _DraftController | None = None
        self._num_draft = 0
        self._json_vocab: Any = None
        if spec.draft is not None:
            from mlx_lm.models.cache import can_trim_prompt_cache

            if not can_trim_prompt_cache(probe_cache) or kinds - {"KVCache"}:
                raise UnsupportedError(
                    "Speculative decoding needs a trimmable KV cache, and this model uses "
                    f"{', '.join(sorted(kinds))}; load it without a draft."
                )
            if spec.draft.kind == "model":
                if not spec.draft.path:
                    raise UnsupportedError("A draft model needs a path to an MLX model directory.")
                self._draft_model, dtok, _ = self._load_dir(Path(spec.draft.path), "draft model")
                self._check_pair(dtok)
                dkinds = {type(c).__name__ for c in make_prompt_cache(self._draft_model)}
                if dkinds - {"KVCache"}:
                    raise UnsupportedError(
                        f"The draft model uses {', '.join(sorted(dkinds))}, which cannot be rolled back; "
                        "pick another draft."
                    )
                self._draft_kind = str(spec.draft.path)
            elif spec.draft.kind == "ngram":
                self._draft_kind = "ngram"
            else:
                raise UnsupportedError(f"Unknown draft kind {spec.draft.kind!r} (model or ngram).")
            self._num_draft = max(1, spec.draft.num_draft)

        self._cache: list[Any] = []
        self._dcache: list[Any] = []
        self._cached: list[int] = []  # tokens whose K/V are in self._cache
        self._dstart = 0  # the draft cache holds self._cached[self._dstart : self._dstart + offset]
        if self._draft_kind is not None:
            self._controller = self._calibrate(bool(spec.extra.get("draft_always", False)))
        self._reset_cache()
        from mlx.utils import tree_flatten

        self._weights_bytes = sum(v.nbytes for _, v in tree_flatten(self._model.parameters()))
        if self._draft_model is not None:
            self._weights_bytes += sum(v.nbytes for _, v in tree_flatten(self._draft_model.parameters()))
        self._mlx_lm = mlx_lm

    # ----------------------------------------------------------------------------- loading helpers

    @classmethod
    def available(cls) -> tuple[bool, str]:
        try:
            import mlx.core  # noqa: F401
            import mlx_lm  # noqa: F401
        except ImportError as e:
            return False, (
                f"MLX is not installed ({e.name}): pip install 'localllm[mlx]' on Apple Silicon, "
                "'localllm[mlx-cpu]' on Linux."
            )
        except OSError as e:  # bare mlx wheel without a backend (libmlx.so missing)
            return False, f"MLX is installed without a backend ({e}); pip install 'mlx[cpu]' on Linux."
        return True, ""

    def _load_dir(self, path: Path, what: str) -> tuple[Any, Any, dict[str, Any]]:
        import mlx_lm

        if path.suffix.lower() == ".gguf" or path.is_file():
            raise ModelLoadError(
                f"The MLX backend needs an MLX model directory, not the file {path.name}; "
                "convert it first (localllm convert MODEL) or use the llama.cpp backend."
            )
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is not an MLX model directory (config.json is missing) for the {what}.")
        try:
            model, tok, config = mlx_lm.load(str(path), return_config=True)
        except (FileNotFoundError, ValueError, KeyError, RuntimeError, OSError) as e:
            raise ModelLoadError(f"MLX could not load the {what} at {path}: {e}") from e
        return model, tok, config

    def _head_dim(self) -> int:
        c = self._config
        return int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])

    def _check_pair(self, dtok: Any) -> None:
        tv, dv = self._tok.get_vocab(), dtok.get_vocab()
        if tv != dv:
            raise UnsupportedError(
                f"The draft model's vocabulary ({len(dv)} tokens) differs from the model's ({len(tv)}); "
                "a draft must share the tokenizer."
            )

    def _new_cache(self, model: Any) -> list[Any]:
        from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

        if self._kv_bits is None:
            return make_prompt_cache(model)
        return [QuantizedKVCache(group_size=self._kv_group, bits=self._kv_bits) for _ in model.layers]

    def _reset_cache(self) -> None:
        self._cache = self._new_cache(self._model)
        self._reset_draft_cache()
        self._cached = []

    def _reset_draft_cache(self, start: int = 0) -> None:
        self._dcache = self._new_cache(self._draft_model) if self._draft_model is not None else []
        self._dstart = start

    def _cut_draft(self, n: int) -> None:
        """Make the draft cache end at or before position ``n`` of the target's sequence."""
        from mlx_lm.models.cache import trim_prompt_cache

        if not self._dcache:
            return
        end = self._dstart + self._dcache[0].offset
        if end <= n:
            return
        if n > self._dstart:
            trim_prompt_cache(self._dcache, end - n)
        else:
            self._reset_draft_cache()

    def _calibrate(self, force: bool) -> _DraftController:
        """Time one plain step, verify passes and a draft step on a scratch cache (a few forward passes)."""
        mx = self._mx
        k_max = self._num_draft

        def timed(model: Any, n: int) -> float:
            best = float("inf")
            for _ in range(2):
                cache = self._new_cache(model)
                model(mx.zeros((1, 8), dtype=mx.uint32), cache=cache)
                mx.eval([c.state for c in cache])
                t = time.perf_counter()
                out = model(mx.ones((1, n), dtype=mx.uint32), cache=cache)
                mx.eval(out.argmax(axis=-1))
                best = min(best, time.perf_counter() - t)
            return best

        step = timed(self._model, 1)
        full = timed(self._model, k_max + 1) / step
        verify = {k: 1.0 + (full - 1.0) * k / k_max for k in range(k_max + 1)}
        draft_cost = timed(self._draft_model, 1) / step if self._draft_model is not None else 0.02
        return _DraftController(k_max, draft_cost, verify, force=force)

    # ---------------------------------------------------------------------------------- contract

    @property
    def info(self) -> ModelInfo:
        c = self._config
        kv_bytes = 0
        if self._cache:
            kv_bytes = sum(getattr(x, "nbytes", 0) for x in self._cache if getattr(x, "keys", None) is not None)
        return ModelInfo(
            architecture=str(c.get("model_type", "unknown")),
            n_ctx=self._n_ctx,
            n_ctx_train=self._n_ctx_train,
            n_layers=len(self._model.layers),
            n_vocab=int(c.get("vocab_size") or len(self._tok.get_vocab())),
            chat_template=getattr(self._tok, "chat_template", None),
            n_gpu_layers=len(self._model.layers) if self._on_gpu() else 0,
            size_bytes=self._weights_bytes + kv_bytes,
            vram_bytes=(self._weights_bytes + kv_bytes) if self._on_gpu() else 0,
            kv_cache_type=self.spec.kv_cache_type or "f16",
            draft=self._draft_kind,
            extra={
                "device": str(self._mx.default_device()),
                "quantization": c.get("quantization"),
                "draft_status": (self._controller.disabled or "adaptive") if self._controller else None,
            },
        )

    def _on_gpu(self) -> bool:
        return self._mx.default_device() == self._mx.gpu

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        if special:
            return list(self._tok.encode(text, add_special_tokens=False))
        # plain text: special-token strings in it are text, not control tokens
        return list(self._tok._tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def detokenize(self, tokens: list[int]) -> str:
        return self._tok.decode(list(tokens))

    def embed(self, texts: list[str]) -> list[list[float]]:
        """Mean-pooled final hidden states, L2-normalised (no KV cache touched)."""
        mx = self._mx
        if not hasattr(self._model, "model"):
            arch = self.info.architecture
            raise UnsupportedError(f"Embeddings are not available for the {arch} architecture on MLX.")
        out: list[list[float]] = []
        _hold_thread()
        with self._lock:
            for text in texts:
                ids = self._tok.encode(text) or [next(iter(self._eos))]
                h = self._model.model(mx.array(ids[: self._n_ctx])[None])
                v = h[0].astype(mx.float32).mean(axis=0)
                v = v / mx.maximum(mx.linalg.norm(v), 1e-12)
                out.append(v.tolist())
        return out

    def close(self) -> None:
        if self._closed:
            return
        with self._lock:
            self._closed = True
            self._cache, self._dcache, self._cached = [], [], []
            self._model = None
            self._draft_model = None
            try:
                import gc

                gc.collect()
                self._mx.clear_cache()
            except Exception:  # noqa: BLE001 - freeing is best effort
                pass

    # ---------------------------------------------------------------------------------- prompting

    def _render(self, request: GenerateRequest) -> tuple[list[int], int]:
        """(prompt token ids, messages dropped to fit). Same policy as the llama.cpp backend: while the
        prompt leaves less than the answer's room, the oldest turns go first (never a system message
        nor the last user message; a reply right after a dropped turn goes with it)."""
        if request.prompt is not None:
            ids = list(self._tok.encode(request.prompt))
            return ids, 0
        msgs = [self._plain_message(m) for m in (request.messages or [])]
        if request.tools and not self._supports_tools():
            raise UnsupportedError(f"The chat template of {Path(self.spec.model_path).name} does not support tools.")
        return fit_messages(msgs, lambda m: self._apply_template(m, request), self._n_ctx, self._reserve(request))

    def _supports_tools(self) -> bool:
        template = getattr(self._tok, "chat_template", None) or ""
        return "tools" in template

    def _reserve(self, request: GenerateRequest) -> int:
        return answer_reserve(request.sampling.max_tokens, self._n_ctx)

    @staticmethod
    def _plain_message(m: dict[str, Any]) -> dict[str, Any]:
        if m.get("images"):
            raise UnsupportedError("This MLX backend does not take images.")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: text only
            if any(isinstance(p, dict) and p.get("type") not in (None, "text") for p in content):
                raise UnsupportedError("This MLX backend does not take images or audio.")
            m = {**m, "content": "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)}
        return m

    def _apply_template(self, messages: list[dict[str, Any]], request: GenerateRequest) -> list[int]:
        if not self._tok.has_chat_template:
            text = "\n\n".join(str(m.get("content") or "") for m in messages)
            return list(self._tok.encode(text))
        kwargs: dict[str, Any] = {"add_generation_prompt": request.add_generation_prompt}
        if request.tools:
            kwargs["tools"] = request.tools
        return list(self._tok.apply_chat_template(messages, **kwargs))

    def _sampler(self, request: GenerateRequest) -> tuple[Callable[[Any], Any], list[Callable[..., Any]]]:
        from mlx_lm.sample_utils import make_logits_processors, make_sampler

        s = request.sampling
        temp = max(0.0, float(s.temperature))
        top_p = s.top_p if 0 < s.top_p < 1 else 0.0
        sampler = make_sampler(temp=temp, top_p=top_p, min_p=max(0.0, s.min_p), top_k=max(0, s.top_k or 0))
        n = self._n_ctx if s.repeat_last_n == -1 else max(0, s.repeat_last_n)
        if n == 0:  # Ollama's repeat_last_n 0: penalties off
            return sampler, []
        procs = make_logits_processors(
            repetition_penalty=s.repeat_penalty if s.repeat_penalty and s.repeat_penalty != 1.0 else None,
            repetition_context_size=n,
            presence_penalty=s.presence_penalty or None,
            presence_context_size=n,
            frequency_penalty=s.frequency_penalty or None,
            frequency_context_size=n,
        )
        return sampler, procs

    # --------------------------------------------------------------------------------- generation

    def generate(self, request: GenerateRequest, cancel: threading.Event | None = None) -> Iterator[Event]:
        fmt = request.format
        if isinstance(fmt, dict):
            from backends.mlx_json import SchemaError, compile_schema

            try:
                compile_schema(fmt)
            except SchemaError as e:
                raise UnsupportedError(f"This JSON schema cannot be followed on MLX: {e}.") from e
        elif fmt not in (None, "", "text", "json"):
            raise UnsupportedError(f"Unknown format {fmt!r}: use json or a JSON schema.")
        if fmt == "json" or isinstance(fmt, dict):
            self._json_vocabulary()  # raises UnsupportedError for a vocabulary it cannot handle
        if self._closed:
            raise ModelLoadError("This model has been unloaded.")
        return self._generate(request, cancel or threading.Event())

    def _json_vocabulary(self) -> Any:
        if self._json_vocab is None:
            from backends.mlx_json import JSONConstraint

            try:
                self._json_vocab = JSONConstraint.vocabulary(self._tok)
            except ValueError as e:
                raise UnsupportedError(f"JSON mode on MLX needs a byte-level BPE vocabulary ({e}).") from e
        return self._json_vocab

    def _json_processor(self, fed: int, fmt: str | dict[str, Any]) -> Callable[[Any, Any], Any]:
        """A logits processor keeping the output one JSON object (following ``fmt`` when it is a
        schema). mlx-lm passes it every token fed in this call (``fed`` prompt tokens, then the
        generated ones); it advances on the new ones."""
        from backends.mlx_json import JSONConstraint, compile_schema

        n_logits = max(int(self._config.get("vocab_size") or 0), len(self._json_vocabulary()[0]))
        start = compile_schema(fmt) if isinstance(fmt, dict) else None
        constraint = JSONConstraint(self._json_vocabulary(), self._eos, n_logits, start)
        seen = [0]

        def proc(tokens: Any, logits: Any) -> Any:
            new = tokens[fed + seen[0] :].tolist() if tokens.size > fed + seen[0] else []
            for t in new:
                constraint.advance(int(t))
            seen[0] += len(new)
            return constraint.apply(logits)

        return proc

    def _generate(self, request: GenerateRequest, cancel: threading.Event) -> Iterator[Event]:
        _hold_thread()
        mx = self._mx
        t0 = time.perf_counter_ns()
        with self._lock:
            if self._closed:
                yield Done(Stats(), "error", "This model has been unloaded.")
                return
            prompt, dropped = self._render(request)
            if not prompt:
                prompt = [self._tok.bos_token_id if self._tok.bos_token_id is not None else next(iter(self._eos))]
            s = request.sampling
            sampler, procs = self._sampler(request)
            mx.random.seed(s.seed if s.seed is not None else int.from_bytes(os.urandom(4), "little"))
            budget = self._n_ctx - len(prompt)
            max_new = min(s.max_tokens, budget) if s.max_tokens and s.max_tokens > 0 else budget
            stats = Stats(prompt_eval_count=len(prompt), dropped_messages=dropped, n_ctx=self._n_ctx)
            if cancel.is_set():  # cancelled while queued: do not start the prompt
                stats.total_duration = time.perf_counter_ns() - t0
                stats.context_used = len(self._cached)
                yield Done(stats, "cancelled")
                return

            reused = self._prepare_cache(prompt)
            stats.prompt_cached_tokens = reused
            json_mode: Any = request.format if request.format == "json" or isinstance(request.format, dict) else None
            generated: list[int] = []
            clean = False
            finish = "length"
            stop_hit = False
            stops = [x for x in (s.stop or []) if x]
            detok = self._tok.detokenizer
            pending, pending_tokens = "", 0
            t_first = None
            tool_mode = bool(request.tools) and self._tok.has_tool_calling
            text_all: list[str] = []
            try:
                tokens = self._token_stream(prompt, reused, max_new, sampler, procs, stats, json_mode)
                try:
                    for tok in tokens:
                        if t_first is None:
                            t_first = time.perf_counter_ns()
                            stats.prompt_eval_duration = t_first - t0
                        generated.append(tok)
                        if tok in self._eos:
                            finish = "stop"
                            break
                        stats.eval_count += 1
                        detok.add_token(tok)
                        pending += detok.last_segment
                        pending_tokens += 1
                        emit, hit = self._split_stop(pending, stops)
                        if emit:
                            text_all.append(emit)
                            if not tool_mode:
                                yield TextChunk(emit, pending_tokens)
                            pending_tokens = 0
                        pending = pending[len(emit) :]
                        if hit:
                            stop_hit = True
                            finish = "stop"
                            break
                        if cancel.is_set():
                            finish = "cancelled"
                            break
                        if len(generated) >= max_new:
                            break
                    else:
                        finish = "length" if len(generated) >= max_new else "stop"
                finally:
                    tokens.close()
                if finish != "cancelled" and not stop_hit:
                    detok.finalize()
                    pending += detok.last_segment
                if finish != "cancelled" and not stop_hit and pending:
                    emit, hit = self._split_stop(pending, stops, final=True)
                    if emit:
                        text_all.append(emit)
                        if not tool_mode:
                            yield TextChunk(emit, pending_tokens)
                    if hit:
                        finish = "stop"
                if tool_mode:
                    calls, text = self._parse_tools("".join(text_all), request.tools or [])
                    if text:
                        yield TextChunk(text, stats.eval_count)
                    if calls:
                        yield ToolCalls(calls)
                clean = True
            finally:
                self._settle_cache(prompt, generated, clean)
            t_end = time.perf_counter_ns()
            if t_first is None:
                stats.prompt_eval_duration = t_end - t0
                t_first = t_end
            stats.eval_duration = t_end - t_first
            stats.total_duration = t_end - t0
            stats.context_used = len(self._cached)
            yield Done(stats, finish)  # type: ignore[arg-type]

    @staticmethod
    def _split_stop(text: str, stops: list[str], final: bool = False) -> tuple[str, bool]:
        """(text safe to emit now, a stop string was hit). Holds back a tail that may start a stop.

        >>> MLXBackend._split_stop("Hello wor", ["world"])
        ('Hello ', False)
        >>> MLXBackend._split_stop("Hello world!", ["world"])
        ('Hello ', True)
        >>> MLXBackend._split_stop("Hello wor", ["world"], final=True)
        ('Hello wor', False)
        """
        if not stops:
            return text, False
        first = min(((i, s) for s in stops if (i := text.find(s)) >= 0), default=None)
        if first is not None:
            return text[: first[0]], True
        if final:
            return text, False
        hold = 0
        for s in stops:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return text[: len(text) - hold], False

    def _parse_tools(self, text: str, tools: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
        start, end = self._tok.tool_call_start, self._tok.tool_call_end
        calls: list[dict[str, Any]] = []
        rest = text
        while start and start in rest:
            before, _, after = rest.partition(start)
            body, _, rest = after.partition(end) if end else (after, "", "")
            try:
                parsed = self._tok.tool_parser(body, tools)
            except (ValueError, json.JSONDecodeError, KeyError, TypeError):
                return [], text
            for p in parsed if isinstance(parsed, list) else [parsed]:
                args = p.get("arguments", {})
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except json.JSONDecodeError:
                        args = {"_raw": args}
                calls.append({"name": p.get("name"), "arguments": args})
            rest = before + rest
        return calls, rest.strip() if calls else text

    # ------------------------------------------------------------------------------------- caches

    def _prepare_cache(self, prompt: list[int]) -> int:
        """Trim the kept cache to the common prefix with ``prompt`` (keeping ≥ 1 token to feed)."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        keep = min(_common_prefix(self._cached, prompt), len(prompt) - 1)
        if keep <= 0:
            self._reset_cache()
            return 0
        excess = len(self._cached) - keep
        if excess > 0:
            if not can_trim_prompt_cache(self._cache):
                self._reset_cache()
                return 0
            trim_prompt_cache(self._cache, excess)
            self._cut_draft(keep)
            self._cached = self._cached[:keep]
        return keep

    def _settle_cache(self, prompt: list[int], generated: list[int], clean: bool) -> None:
        """Record which tokens the cache holds after a generation (trim what cannot be vouched for)."""
        from mlx_lm.models.cache import trim_prompt_cache

        if not clean and not generated:
            self._reset_cache()
            return
        seq = prompt + generated
        # plain decoding has fed every yielded token; speculative rounds may not have fed the last one
        sure = len(seq) - (1 if self._draft_kind is not None else 0)
        n = min(sure, self._cache[0].offset)
        if self._cache[0].offset > n:
            trim_prompt_cache(self._cache, self._cache[0].offset - n)
        self._cut_draft(n)  # the draft may lag behind (plain rounds) but never runs ahead
        self._cached = seq[:n]

    # ------------------------------------------------------------------------------ token streams

    def _history_procs(self, procs: list[Callable[..., Any]], cached: list[int]) -> list[Callable[..., Any]]:
        """mlx-lm hands processors only the tokens fed in this call; prepend the cached prefix so
        penalties see the same context whether or not the prefix was cached."""
        if not procs or not cached:
            return procs
        mx = self._mx
        pre = mx.array(cached[-self._n_ctx :], dtype=mx.uint32)

        def wrap(p: Callable[..., Any]) -> Callable[..., Any]:
            return lambda toks, logits: p(mx.concatenate([pre, toks.astype(mx.uint32)]), logits)

        return [wrap(p) for p in procs]

    def _token_stream(
        self,
        prompt: list[int],
        reused: int,
        max_new: int,
        sampler: Callable[[Any], Any],
        procs: list[Callable[..., Any]],
        stats: Stats,
        json_mode: Any = None,
    ) -> Iterator[int]:
        if json_mode:  # drafts would need the constraint to roll back with them: decode plainly
            constraint = self._json_processor(len(prompt) - reused, json_mode)
            procs = [*self._history_procs(procs, prompt[:reused]), constraint]
            return self._plain_stream(prompt, reused, max_new, sampler, procs, wrapped=True)
        if self._draft_kind is None or (self._controller is not None and self._controller.disabled):
            return self._plain_stream(prompt, reused, max_new, sampler, procs)
        return self._spec_stream(prompt, reused, max_new, sampler, procs, stats)

    def _plain_stream(
        self, prompt: list[int], reused: int, max_new: int, sampler: Any, procs: Any, wrapped: bool = False
    ) -> Iterator[int]:
        from mlx_lm.generate import generate_step, generation_stream, wired_limit

        mx = self._mx
        wired = wired_limit(self._model, [generation_stream])  # Metal: keep the weights wired while decoding
        wired.__enter__()
        gen = generate_step(
            mx.array(prompt[reused:], dtype=mx.uint32),
            self._model,
            max_tokens=max_new,
            sampler=sampler,
            logits_processors=procs if wrapped else self._history_procs(procs, prompt[:reused]),
            prompt_cache=self._cache,
            prefill_step_size=max(self.spec.n_batch, 256),
        )
        try:
            for tok, _ in gen:
                yield int(tok)
        finally:
            gen.close()
            wired.__exit__(None, None, None)

    def _spec_stream(
        self, prompt: list[int], reused: int, max_new: int, sampler: Any, procs: Any, stats: Stats
    ) -> Iterator[int]:
        """Speculative decoding: draft (model or n-gram), verify ``[y, d1..dk]`` in one target pass,
        keep drafts while they equal the target's own samples (exact at temperature 0), roll back the
        rest. Invariant: the target cache holds ``hist[:-1]``; ``hist[-1]`` is the next input."""
        from mlx_lm.generate import generate_step, generation_stream, wired_limit
        from mlx_lm.models.cache import trim_prompt_cache

        mx = self._mx
        model, draft = self._model, self._draft_model
        ctl = self._controller
        assert ctl is not None
        step = max(self.spec.n_batch, 256)
        hist = list(prompt)

        def prefill(m: Any, cache: list[Any], toks: list[int]) -> None:
            for i in range(0, len(toks), step):
                m(mx.array(toks[i : i + step], dtype=mx.uint32)[None], cache=cache)
                mx.eval([c.state for c in cache])

        def sample_rows(logits: Any, base: list[int], fed: list[int]) -> list[Any]:
            """Sample each row; row i sees history base + fed[1:i+1] for the penalties."""
            if not procs:
                lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                return [sampler(lp)]
            out = []
            ctx = mx.array(base, dtype=mx.uint32)
            for i in range(logits.shape[0]):
                if i:
                    ctx = mx.concatenate([ctx, mx.array(fed[i : i + 1], dtype=mx.uint32)])
                row = logits[i : i + 1]
                for p in procs:
                    row = p(ctx, row)
                out.append(sampler(row - mx.logsumexp(row, axis=-1, keepdims=True)))
            return out

        def ngram_propose(k: int) -> list[int]:
            for n in (3, 2, 1):
                if len(hist) <= n:
                    continue
                tail = hist[-n:]
                for i in range(len(hist) - n - 1, -1, -1):
                    if hist[i : i + n] == tail:
                        return hist[i + n : i + n + k]
            return []

        with wired_limit(model, [generation_stream]), mx.stream(generation_stream):
            prefill(model, self._cache, hist[reused:-1])
            ntoks = 0
            while ntoks < max_new:
                k = max(0, min(ctl.next_k(), max_new - ntoks - 1, self._n_ctx - len(hist) - 1))
                if k == 0 and not ctl.force:
                    # a plain run until the next probe, on mlx-lm's pipelined loop (as fast as no draft)
                    run = min(ctl.plain_run(), max_new - ntoks)
                    gen = generate_step(
                        mx.array(hist[-1:], dtype=mx.uint32),
                        model,
                        max_tokens=run,
                        sampler=sampler,
                        logits_processors=self._history_procs(procs, hist[:-1]),
                        prompt_cache=self._cache,
                    )
                    got = 0
                    try:
                        for tok, _ in gen:
                            hist.append(int(tok))
                            ntoks += 1
                            got += 1
                            yield hist[-1]
                            if ntoks >= max_new or hist[-1] in self._eos:
                                return
                    finally:
                        gen.close()
                        ctl.record(0, 0, got)
                    trim_prompt_cache(self._cache, 1)  # it fed its last token too: keep hist[-1] as the next input
                    continue
                drafts: list[int] = []
                if k > 0 and draft is not None:
                    target_end = len(hist) - 1
                    self._cut_draft(target_end)
                    end = self._dstart + self._dcache[0].offset
                    window = 32 if ctl.probing else self._n_ctx
                    if target_end - end > window:  # a long lag: draft from a recent window only
                        self._reset_draft_cache(target_end - window)
                        end = self._dstart
                    prefill(draft, self._dcache, hist[end:target_end])
                    y = mx.array(hist[-1:], dtype=mx.uint32)
                    base = list(hist[-self._n_ctx :])
                    dys = []
                    for _ in range(k):
                        logits = draft(y[None], cache=self._dcache)[0, -1:, :]
                        y = sample_rows(logits, base, [])[0].reshape(1).astype(mx.uint32)
                        mx.async_eval(y)
                        dys.append(y)
                        if procs:
                            base.append(int(y.item()))
                    drafts = [int(t) for t in mx.concatenate(dys).tolist()]
                elif k > 0:
                    drafts = ngram_propose(k)
                fed = hist[-1:] + drafts
                logits = model(mx.array(fed, dtype=mx.uint32)[None], cache=self._cache)[0]
                rows = sample_rows(logits, hist[-self._n_ctx :], fed)
                sampled = mx.concatenate([r.reshape(-1) for r in rows]).tolist()
                n = 0
                while n < len(drafts) and sampled[n] == drafts[n]:
                    n += 1
                new = drafts[:n] + [int(sampled[n])]
                if len(drafts) - n > 0:
                    trim_prompt_cache(self._cache, len(drafts) - n)
                stats.draft_proposed += len(drafts)
                stats.draft_accepted += n
                ctl.record(len(drafts), n, len(new))
                for t in new:
                    hist.append(t)
                    ntoks += 1
                    yield t
                    if ntoks >= max_new or t in self._eos:
                        return
