"""MLX (mlx-lm) as a token source: Apple Silicon's native runtime; also runs on Linux with ``mlx[cpu]``.

Loads an MLX model directory (``config.json``, ``model*.safetensors`` 4/8-bit, HF tokenizer), e.g. an
``mlx-community`` repo or one built offline from a GGUF by :mod:`backends.mlx.convert`. Each sequence
id has its own mlx-lm prompt cache (a list of per-layer caches) while it prefills; the sequences that
decode one token in a step are moved into rows of mlx-lm's ``BatchKVCache`` (left padded) and run as one
forward pass (:meth:`MLXSource.evaluate`), and leave it for anything else (a prompt, drafts, a trim, a
copy, a save). With a quantized KV cache (mlx-lm has no batched one) the sequences take turns. A
shared prefix is copied by slicing the cache arrays; for the prompt cache on disk a sequence's caches are
saved as raw arrays cut to its length (:mod:`backends.mlx._state`) and checked against the model's
shape before they are loaded.

Sampling is ours, per request (:mod:`backends.mlx._sampling`): a private random key per request (``seed``
reproduces the text whatever else runs), temperature / top-k / top-p / min-p through mlx-lm's functions,
penalties over the tokens this request generated (as llama.cpp's chain), and ``format`` (``json`` and a
common subset of JSON Schema) through a byte-level automaton (:mod:`backends.mlx._json`). Schema keywords
outside that subset (``$ref``, ``anyOf``, ``pattern``...) are refused by name rather than ignored.

Not supported, refused with :class:`UnsupportedError`: images, KV quantization with a rotating
(sliding-window) cache or a head size not divisible by 32. ``n_gpu_layers``/``n_threads`` do not apply:
MLX runs the whole model on its device.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

from backends.contract.errors import ModelLoadError, UnsupportedError
from backends.contract.source import FALLBACK_CHAT_TEMPLATE, Feed, ModelInfo, TokenSource
from backends.contract.specs import LoadSpec, Sampling, ToolCallFormat
from backends.mlx._sampling import MLXSampler
from backends.mlx._state import kv_cache

KV_BITS = {"f16": None, "q8_0": 8, "q4_0": 4}


@contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic collector off while a block makes many objects that all live on (tokenizer.json parsed by
    mlx-lm and again by transformers, JSON mode's byte trie): with it on, every generation-2 pass rescans the
    whole heap, ~0.3 s a pass in a server or test process of 10^6 objects, several passes a load."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


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


class MLXSource(TokenSource):
    """One MLX model; ``spec.slots`` slots, each with its own prompt cache."""

    name = "mlx"

    @classmethod
    def on_thread(cls) -> None:
        if cls.available()[0]:
            _hold_thread()  # this thread's MLX state is freed as it ends, before it is joined

    def __init__(self, spec: LoadSpec):
        super().__init__(spec)
        ok, why = self.available()
        if not ok:
            raise ModelLoadError(why)
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        _hold_thread()  # the decode loop's thread: its MLX state goes with it, before it is joined
        self._mx = mx
        self._closed = False
        path = Path(spec.model_path)
        self._model, self._tok, self._config = self._load_dir(path)
        self._n_ctx_train = int(self._config.get("max_position_embeddings") or 0) or 4096
        self._n_ctx = spec.n_ctx if spec.n_ctx and spec.n_ctx > 0 else self._n_ctx_train
        self._eos = set(self._tok.eos_token_ids)
        self._slots = max(1, spec.slots)
        self._n_seq_ids = max(self._slots, spec.tuning.n_seq_ids or 2 * self._slots)
        self._template_override: str | None = spec.chat_template  # a Modelfile's TEMPLATE
        if spec.lora:
            raise ModelLoadError("LoRA adapters run on the llama.cpp backend only; use --backend llamacpp.")
        kv_type = spec.kv_cache_type or "f16"
        if kv_type not in KV_BITS:
            raise UnsupportedError(f"KV cache type {kv_type!r} is not supported on MLX (choose f16, q8_0 or q4_0).")
        self._kv_bits = KV_BITS[kv_type]
        self._kv_group = 64
        kinds = {type(c).__name__ for c in make_prompt_cache(self._model)}
        self._cache_kinds = kinds
        if self._kv_bits is not None:
            if kinds - {"KVCache"}:
                raise UnsupportedError(
                    f"KV cache quantization ({kv_type}) needs a plain KV cache, and this model uses "
                    f"{', '.join(sorted(kinds))} (sliding-window caches cannot be quantized in mlx-lm).")
            head_dim = self._head_dim()
            group = next((g for g in (64, 32) if head_dim % g == 0), None)
            if group is None:
                raise UnsupportedError(f"KV cache quantization ({kv_type}) needs a head size divisible by 32, "
                                       f"and this model's is {head_dim}.")
            self._kv_group = group
        self._caches: dict[int, list[Any]] = {}
        self._kv_bytes = 0  # of all caches, counted on the loop's thread after it changes them (see ``info``)
        self._kv_counted = 0.0  # when (monotonic)
        # sequences decoding together: one mlx-lm BatchKVCache per layer, a row per sequence (plain caches only)
        self._batch_ok = self._kv_bits is None and kinds == {"KVCache"} and spec.tuning.batch
        self._bcache: list[Any] | None = None
        self._bseqs: list[int] = []  # row order
        self._blens: dict[int, int] = {}  # tokens each row holds
        self.batched_steps = 0  # evaluations that ran several sequences in one pass
        self._rows: list[Any] = []
        self._pieces: dict[int, bytes] = {}
        # the bytes of every token (None: not byte-level BPE), built on the first token streamed; the byte trie
        # that JSON mode walks, built on the first JSON request (ten times the cost: never for plain text)
        self._vocab_bytes: list[bytes | None] | None | bool = None
        self._json_trie: dict[int, Any] | None = None
        self._bos_prepend = self._adds_bos()
        self._special_ids = set(getattr(self._tok._tokenizer, "all_special_ids", []) or [])
        from mlx.utils import tree_flatten

        weights = cast(list[tuple[str, Any]], tree_flatten(self._model.parameters()))
        self._weights_bytes = sum(v.nbytes for _, v in weights)
        self._info = ModelInfo(
            architecture=str(self._config.get("model_type", "unknown")),
            n_ctx=self._n_ctx,
            n_ctx_train=self._n_ctx_train,
            n_layers=len(self._model.layers),
            n_vocab=int(self._config.get("vocab_size") or len(self._tok.get_vocab())),
            chat_template=self._template_override or getattr(self._tok, "chat_template", None),
            n_gpu_layers=len(self._model.layers) if self._on_gpu() else 0,
            size_bytes=self._weights_bytes,
            vram_bytes=self._weights_bytes if self._on_gpu() else 0,
            kv_cache_type=kv_type,
            slots=self._slots,
            kv_cells=self._n_ctx * self._slots,
            weights_bytes=self._weights_bytes,
            device=str(mx.default_device()),
            batched=self._batch_ok,
        )

    # ------------------------------------------------------------------ loading

    @staticmethod
    def _load_dir(path: Path) -> tuple[Any, Any, dict[str, Any]]:
        import mlx_lm

        if path.suffix.lower() == ".gguf" or path.is_file():
            raise ModelLoadError(
                f"The MLX backend needs an MLX model directory, not the file {path.name}; "
                "convert it first (localllm convert MODEL) or use the llama.cpp backend.")
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is not an MLX model directory (config.json is missing).")
        try:
            with _gc_paused():
                model, tok, config = cast(tuple[Any, Any, dict[str, Any]], mlx_lm.load(str(path), return_config=True))
        except (FileNotFoundError, ValueError, KeyError, RuntimeError, OSError) as e:
            raise ModelLoadError(f"MLX could not load the model at {path}: {e}") from e
        return model, tok, config

    def _head_dim(self) -> int:
        c = self._config
        return int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])

    def _on_gpu(self) -> bool:
        return bool(self._mx.default_device() == self._mx.gpu)

    def _adds_bos(self) -> bool:
        bos = self._tok.bos_token_id
        if bos is None:
            return False
        try:
            ids = list(self._tok.encode("a"))
        except Exception:  # noqa: BLE001
            return False
        return bool(ids) and ids[0] == bos

    # ------------------------------------------------------------------ what it is

    @property
    def can_batch(self) -> bool:
        return self._batch_ok

    @property
    def info(self) -> ModelInfo:
        """What the model is, its size with the KV caches now. Read from any thread (``ps``, ``/metrics``, every
        request) while the loop's thread changes the caches: it reads only the total that thread keeps (during
        decoding, at most 0.1 s old)."""
        self._info.size_bytes = self._weights_bytes + self._kv_bytes
        if self._on_gpu():
            self._info.vram_bytes = self._info.size_bytes
        return self._info

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    @property
    def n_seq_ids(self) -> int:
        return self._n_seq_ids

    # ------------------------------------------------------------------ text

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        if special:
            return list(self._tok.encode(text, add_special_tokens=False))
        # plain text: special-token strings in it are text, not control tokens
        return list(self._tok._tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def prompt_tokens(self, text: str) -> list[int]:
        ids = list(self._tok.encode(text, add_special_tokens=False))
        bos = self._tok.bos_token_id
        bos_text = self._tok.bos_token or ""
        if self._bos_prepend and not (bos_text and text.startswith(bos_text)):
            ids = [bos, *ids]
        if not ids:
            ids = [bos if bos is not None else next(iter(self._eos))]
        return ids

    def detokenize(self, tokens: list[int]) -> str:
        return str(self._tok.decode(list(tokens)))

    def piece(self, token: int) -> bytes:
        """The bytes one token adds: from the byte-level BPE table, else from a SentencePiece token's text
        (``▁`` is a space, ``<0xNN>`` a raw byte); control tokens add nothing."""
        p = self._pieces.get(token)
        if p is None:
            vocab = self._byte_vocab(required=False)
            b = vocab[token] if vocab is not None and token < len(vocab) else None
            if b is None:
                b = self._sentencepiece_piece(token)
            p = self._pieces[token] = b
        return p

    def _sentencepiece_piece(self, token: int) -> bytes:
        import re

        if token in self._special_ids:
            return b""
        text = self._tok._tokenizer.convert_ids_to_tokens(token)
        if not isinstance(text, str):
            return b""
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", text)
        if m:
            return bytes([int(m.group(1), 16)])
        return text.replace("\u2581", " ").encode("utf-8")

    def _byte_vocab(self, required: bool = True) -> list[bytes | None] | None:
        if self._vocab_bytes is None:
            from backends.mlx._json import JSONConstraint

            try:
                self._vocab_bytes = JSONConstraint.vocabulary_bytes(self._tok)
            except ValueError as e:
                self._vocab_bytes = False
                if required:
                    raise UnsupportedError(f"This MLX tokenizer has no byte-level vocabulary ({e}).") from e
                return None
        if self._vocab_bytes is False:
            if required:
                raise UnsupportedError("JSON mode on MLX needs a byte-level BPE vocabulary (this one is "
                                       "SentencePiece).")
            return None
        assert isinstance(self._vocab_bytes, list)
        return self._vocab_bytes

    def vision_problem(self) -> str:
        return ("This model is loaded on MLX, which has no vision (mlx-lm runs text only); load it with "
                "--backend llamacpp to send images.")

    def is_eog(self, token: int) -> bool:
        return token in self._eos

    def render(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> str:
        kwargs: dict[str, Any] = {"add_generation_prompt": add_generation_prompt, "tokenize": False,
                                  **(template_kwargs or {})}
        if tools:
            kwargs["tools"] = tools
        if self._template_override:
            kwargs["chat_template"] = self._template_override
        elif not self._tok.has_chat_template:
            kwargs["chat_template"] = FALLBACK_CHAT_TEMPLATE
        try:
            return str(self._tok.apply_chat_template(messages, **kwargs))
        except Exception as e:  # noqa: BLE001 - jinja errors, raise_exception() from the template
            raise UnsupportedError(f"The chat template of this model rejected the messages: {e}.") from None

    # ------------------------------------------------------------------ evaluation

    def _cache(self, seq: int) -> list[Any]:
        self._unbatch([seq])
        c = self._caches.get(seq)
        if c is None:
            c = self._caches[seq] = self._new_cache()
        return c

    def _new_cache(self) -> list[Any]:
        from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

        if self._kv_bits is None:
            return make_prompt_cache(self._model)
        return [QuantizedKVCache(group_size=self._kv_group, bits=self._kv_bits) for _ in self._model.layers]

    def evaluate(self, feeds: Sequence[Feed]) -> list[list[int]]:
        """Sequences that decode one token each run as one batched pass (rows of a ``BatchKVCache``, left
        padded); prompts, drafts and a lone sequence run one pass each on their own caches."""
        mx = self._mx
        self._rows = []
        out: list[list[int]] = [[] for _ in feeds]
        pending: list[Any] = []
        together = [i for i, f in enumerate(feeds) if self._batch_ok and len(f.tokens) == 1 and f.pos > 0
                    and f.outputs == 1]
        if len(together) < 2:
            together = []
        decoding = {feeds[i].seq for i in together}
        self._unbatch([q for q in self._bseqs if q not in decoding])
        self._unbatch([feeds[i].seq for i in together if self._blens.get(feeds[i].seq, feeds[i].pos) != feeds[i].pos])
        for i, f in enumerate(feeds):
            if i in together and f.seq in self._blens:
                continue
            cache = self._cache(f.seq)
            have = cache[0].offset if cache else 0
            if have != f.pos:
                if have > f.pos:
                    self.seq_rm(f.seq, f.pos)
                    cache = self._cache(f.seq)
                else:
                    raise UnsupportedError(f"Sequence {f.seq} holds {have} tokens, not {f.pos}.")
            if i in together:
                continue  # joins the batch below
            head = len(f.tokens) - f.outputs
            if f.outputs and head > 0:
                # the tokens before the outputs only fill the cache: their pass's logits are never evaluated, so
                # the vocabulary projection (a fifth of a small model's work per token) runs for the outputs only
                self._model(mx.array(f.tokens[:head], dtype=mx.uint32)[None], cache=cache)
                logits = self._model(mx.array(f.tokens[head:], dtype=mx.uint32)[None], cache=cache)
            else:
                logits = self._model(mx.array(f.tokens, dtype=mx.uint32)[None], cache=cache)
            if f.outputs:
                rows = logits[0, -f.outputs:, :]
                for j in range(f.outputs):
                    self._rows.append(rows[j])
                    out[i].append(len(self._rows) - 1)
                pending.append(rows)
            pending.extend(c.state for c in cache)
        if together:
            self._batch_in([feeds[i].seq for i in together if feeds[i].seq not in self._blens])
            assert self._bcache is not None
            token = {feeds[i].seq: feeds[i].tokens[0] for i in together}
            logits = self._model(mx.array([[token[q]] for q in self._bseqs], dtype=mx.uint32), cache=self._bcache)
            row_of = {q: r for r, q in enumerate(self._bseqs)}
            rows = logits[:, -1, :]
            for i in together:
                self._rows.append(rows[row_of[feeds[i].seq]])
                out[i].append(len(self._rows) - 1)
            for q in self._bseqs:
                self._blens[q] += 1
            pending.append(rows)
            pending.extend(x for c in self._bcache for x in (c.keys, c.values))
            self.batched_steps += 1
        mx.eval(pending)
        self._count_kv(every=0.1)
        return out

    def _batch_in(self, seqs: list[int]) -> None:
        """Move these sequences' own caches into the batch (new rows at the end)."""
        if not seqs:
            return
        from mlx_lm.models.cache import BatchKVCache

        caches = [self._caches.pop(q) for q in seqs]
        merged = [BatchKVCache.merge([c[layer] for c in caches]) for layer in range(len(caches[0]))]
        if self._bcache is None:
            self._bcache = merged
        else:
            for b, m in zip(self._bcache, merged, strict=True):
                b.extend(m)
        for q, c in zip(seqs, caches, strict=True):
            self._bseqs.append(q)
            self._blens[q] = c[0].offset

    def _unbatch(self, seqs: list[int], *, keep: bool = True) -> None:
        """Give these sequences their own caches again (taken out of the batch's rows); ``keep=False``: just
        drop their rows (a sequence being emptied)."""
        gone = [q for q in seqs if q in self._blens]
        if not gone or self._bcache is None:
            return
        mx = self._mx
        for q in gone:
            r = self._bseqs.index(q)
            if keep:
                self._caches[q] = [b.extract(r) for b in self._bcache]
        rows = [r for r, q in enumerate(self._bseqs) if q not in gone]
        self._bseqs = [self._bseqs[r] for r in rows]
        for q in gone:
            del self._blens[q]
        if rows:
            idx = mx.array(rows)
            for b in self._bcache:
                b.filter(idx)
        else:
            self._bcache = None
        if keep:
            mx.eval([x for q in gone for c in self._caches[q] for x in (c.keys, c.values)])

    def logits(self, row: int) -> Any:
        import numpy as np

        return np.array(self._rows[row].astype(self._mx.float32), dtype=np.float32)

    def sampler(self, sampling: Sampling, fmt: str | dict[str, Any] | ToolCallFormat | None) -> MLXSampler:
        if isinstance(fmt, ToolCallFormat):  # no lazy grammar on MLX: a call is whatever the model writes
            fmt = None
        if isinstance(fmt, dict):
            from backends.mlx._json import SchemaError, compile_schema

            try:
                compile_schema(fmt)
            except SchemaError as e:
                raise UnsupportedError(f"This JSON schema cannot be followed on MLX: {e}.") from e
        elif fmt not in (None, "", "text", "json"):
            raise UnsupportedError(f"Unknown format {fmt!r}: use json or a JSON schema.")
        json = self._json_constraint(fmt) if fmt not in (None, "", "text") else None
        return MLXSampler(sampling, row=lambda i: self._rows[i], n_ctx=self.n_ctx, n_vocab=self._info.n_vocab,
                          json=json)

    def _json_constraint(self, fmt: str | dict[str, Any] | None) -> Any:
        from backends.mlx._json import JSONConstraint, compile_schema

        vocab = self._byte_vocab()  # raises UnsupportedError for a vocabulary the automaton cannot handle
        assert vocab is not None
        if self._json_trie is None:
            with _gc_paused():  # ~250k small containers that all live on
                self._json_trie = JSONConstraint.byte_trie(vocab)
        n_logits = max(int(self._config.get("vocab_size") or 0), len(vocab))
        start = compile_schema(fmt) if isinstance(fmt, dict) else None
        return JSONConstraint((vocab, self._json_trie), self._eos, n_logits, start)

    # ------------------------------------------------------------------ KV per sequence

    def can_rewind(self) -> bool:
        from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

        return bool(can_trim_prompt_cache(make_prompt_cache(self._model))) and not (self._cache_kinds - {"KVCache"})

    def seq_rm(self, seq: int, p0: int = 0, p1: int = -1) -> bool:
        """Drop positions ``[p0, p1)``: all of them, or a tail; False (nothing changed) for a range that
        ends before the tokens do (only tails can be removed) or a cache that cannot be trimmed."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        p0 = max(0, p0)
        cache = self._caches.get(seq)
        have = self._blens[seq] if seq in self._blens else (cache[0].offset if cache else 0)
        end = have if p1 < 0 else min(p1, have)
        if p0 == 0 and end >= have:  # the whole sequence
            self._unbatch([seq], keep=False)
            self._caches.pop(seq, None)
            self._count_kv()
            return True
        if end <= p0:
            return True  # nothing in the range
        if end < have:
            return False  # only tails can be removed
        cache = self._cache(seq)
        if not can_trim_prompt_cache(cache):
            return False
        trim_prompt_cache(cache, have - p0)
        self._count_kv(every=0.1)
        return True

    def seq_cp(self, src: int, dst: int, n: int) -> bool:
        """Copy the first ``n`` positions of ``src`` into ``dst`` (plain and quantized caches)."""
        from mlx_lm.models.cache import KVCache, QuantizedKVCache

        self._unbatch([dst], keep=False)
        self._unbatch([src])
        self._caches.pop(dst, None)
        cache = self._caches.get(src)
        if not cache or n <= 0 or any(type(c) not in (KVCache, QuantizedKVCache) for c in cache):
            return False  # nothing to copy, or a sliding-window cache

        def cut(x: Any) -> Any:
            if isinstance(x, tuple | list):
                return type(x)(cut(y) for y in x)
            return x[..., :n, :]

        new = [kv_cache(cut(c.keys), cut(c.values), n,
                         (c.group_size, c.bits) if isinstance(c, QuantizedKVCache) else None) for c in cache]
        self._mx.eval([x.state for x in new])
        self._caches[dst] = new
        self._count_kv()
        return True

    def _count_kv(self, every: float = 0.0) -> None:
        """Count the bytes of all KV caches, on the loop's thread after it changed them (``info`` reads it);
        ``every``: not again within that many seconds (a count costs ~0.1 ms with 3 sequences: not per step)."""
        now = time.monotonic()
        if every and now - self._kv_counted < every:
            return
        self._kv_counted = now
        kv = 0
        for cache in [*self._caches.values(), self._bcache or []]:
            for c in cache:
                kv += int(getattr(c, "nbytes", 0) or 0)
        self._kv_bytes = kv

    # ------------------------------------------------------------------ sequence states (prompt cache)

    def state_key(self) -> str | None:
        """MLX and mlx-lm versions, KV type and device; None for sliding-window and other caches that do
        not hold a whole prefix."""
        from importlib.metadata import version

        if self._cache_kinds - {"KVCache"}:
            return None
        return (f"mlx-{version('mlx')} mlx_lm-{version('mlx-lm')} kv={self._info.kv_cache_type} "
                f"group={self._kv_group} device={self._mx.default_device()}")

    def state_save(self, seq: int) -> bytes:
        """One sequence's caches as bytes (:func:`backends.mlx._state.caches_to_bytes`)."""
        from backends.mlx._state import caches_to_bytes

        self._unbatch([seq])
        cache = self._caches.get(seq)
        if not cache:
            raise UnsupportedError(f"Sequence {seq} holds nothing to save.")
        return caches_to_bytes(cache)

    def state_load(self, seq: int, data: bytes) -> bool:
        """Restore :meth:`state_save`'s bytes into ``seq``; False (``seq`` untouched) for bytes that do not
        fit this model: another layer count, head count, KV type or dtype."""
        from backends.mlx._state import caches_from_bytes

        quant = (self._kv_group, self._kv_bits) if self._kv_bits is not None else None
        heads = int(self._config.get("num_key_value_heads") or self._config["num_attention_heads"])
        new = caches_from_bytes(data, n_layers=len(self._model.layers), heads=heads, quant=quant)
        if new is None:
            return False
        self._unbatch([seq], keep=False)
        self._caches[seq] = new
        self._count_kv()
        return True

    # ------------------------------------------------------------------ the rest

    def embed(self, texts: list[str]) -> list[list[float]]:
        """Mean-pooled final hidden states, L2-normalised (no KV cache touched)."""
        mx = self._mx
        if not hasattr(self._model, "model"):
            raise UnsupportedError(f"Embeddings are not available for the {self._info.architecture} architecture "
                                   "on MLX.")
        out: list[list[float]] = []
        for text in texts:
            ids = list(self._tok.encode(text)) or [next(iter(self._eos))]
            h = self._model.model(mx.array(ids[: self._n_ctx])[None])
            v = h[0].astype(mx.float32).mean(axis=0)
            v = v / mx.maximum(mx.linalg.norm(v), 1e-12)
            out.append(v.tolist())
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._caches.clear()
        self._bcache, self._bseqs, self._blens = None, [], {}
        self._kv_bytes = 0
        self._rows = []
        held = weakref.ref(self._model) if self._model is not None else None
        self._model = None
        try:
            if held is not None and held() is not None:
                gc.collect()  # only a reference cycle still holds the weights: a full pass frees them
            self._mx.synchronize()
            self._mx.clear_cache()
        except Exception:  # noqa: BLE001 - freeing is best effort
            pass
