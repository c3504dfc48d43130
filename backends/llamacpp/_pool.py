"""The llama.cpp source's pooled outputs (the :class:`~backends.contract.source.Pooling` capability): embeddings and
rerank scores, several inputs in one ``llama_decode``, in the model's own context (an embedding model) or a
second one on the same weights with mean pooling (a chat model)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.contract.errors import BackendError, ModelLoadError, UnsupportedError

if TYPE_CHECKING:
    from backends.contract.specs import LoadSpec

POOL_INPUTS = 64  # most inputs one pooling evaluation takes (sequence ids of the pooling context)


def pool_tokens(tokens: int, seqs: int) -> int:
    """The batch (= micro-batch = context) of a pooling context that should hold ``tokens`` over ``seqs`` sequence
    ids: ``tokens`` rounded up to a multiple of ``seqs``.

    llama.cpp (``llama_context::graph_reserve``) reserves its worst-case graph for a micro-batch rounded up to a
    multiple of the sequences while the outputs stay ``n_ubatch``; mean pooling then multiplies the outputs
    (``n_ubatch`` rows) by a ``[rounded, n_seqs]`` matrix and ``GGML_ASSERT(ggml_can_mul_mat(a, b))`` aborts the
    process while the context is made (measured on 0.3.36: a 300-token context over 64 sequences aborts, 256, 320,
    384, 448, 512 and 768 do not; any multiple of 64 works). The few extra tokens cost no KV: llama.cpp pads a
    context to 256 cells anyway. What an input may hold stays the model's context
    (:func:`backends.core.pooling._limit`).

    >>> pool_tokens(300, 64), pool_tokens(256, 64), pool_tokens(1023, 64), pool_tokens(5, 64), pool_tokens(300, 1)
    (320, 256, 1024, 64, 300)
    """
    seqs = max(1, seqs)
    return -(-max(1, tokens) // seqs) * seqs


class LlamaPooling:
    """llama.cpp's implementation of :class:`~backends.contract.source.Pooling`, mixed into
    :class:`~backends.llamacpp.source.LlamaCppSource` (its model, vocabulary and contexts)."""

    if TYPE_CHECKING:
        spec: LoadSpec
        n_threads: int
        _model: Any
        _vocab: Any
        _md: dict[str, str]
        _n_ctx: int
        _n_seq_ids: int
        _pooling: str | None
        _embed: tuple[Any, Any, int, int] | None

        def _tokenize(self, text: str, add_bos: bool, special: bool) -> list[int]: ...

        def _apply_loras(self, ctx: Any) -> None: ...


    def _pool_setup(self, cp: Any) -> None:
        """Context parameters of an embedding / rerank model: its own pooling, one evaluation takes a whole
        context of tokens (non-causal attention needs every token of a batch in one micro-batch), as many
        inputs as llama.cpp allows sequences, and no generation KV beyond one batch's inputs."""
        import llama_cpp

        n_ctx = min(self.spec.n_ctx, int(llama_cpp.llama_model_n_ctx_train(self._model)) or self.spec.n_ctx)
        cp.n_seq_max = self._n_seq_ids = max(1, min(POOL_INPUTS, int(llama_cpp.llama_max_parallel_sequences())))
        cp.n_ctx = cp.n_batch = cp.n_ubatch = pool_tokens(max(self.spec.n_batch, n_ctx), self._n_seq_ids)
        cp.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_UNSPECIFIED  # the GGUF's

    def _embed_ctx(self) -> tuple[Any, Any, int, int]:
        """The context that pools: an embedding model's own, or for a chat model a second context on the same
        weights with mean pooling (made on first use)."""
        if self._embed is None:
            import llama_cpp

            seqs = max(1, min(POOL_INPUTS, int(llama_cpp.llama_max_parallel_sequences())))
            n = pool_tokens(min(self._n_ctx, 2048), seqs)
            p = llama_cpp.llama_context_default_params()
            p.n_ctx = p.n_batch = p.n_ubatch = n
            p.n_seq_max = seqs
            p.kv_unified = True
            p.n_threads = p.n_threads_batch = self.n_threads
            p.embeddings = True
            p.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_MEAN
            ctx = llama_cpp.llama_init_from_model(self._model, p)
            if not ctx:
                raise ModelLoadError("llama.cpp could not create an embedding context for this model.")
            self._apply_loras(ctx)
            self._embed = (ctx, llama_cpp.llama_batch_init(n, 0, 1), n, seqs)
        return self._embed

    def embed_tokens(self, text: str) -> list[int]:
        # what llama-server evaluates for an embedding input: special tokens added ([CLS] ... [SEP], BOS ...) and
        # special-token text parsed (tokenize_input_subprompt(..., add_special=true, parse_special=true))
        return self._tokenize(text, True, True)

    def tail_tokens(self, *, rerank: bool = False) -> int:
        import llama_cpp

        v = self._vocab
        if rerank:
            template = self._md.get("tokenizer.chat_template.rerank")
            if template and "{document}" in template:
                return len(self._tokenize(template.split("{document}", 1)[1], False, True))
            return int(bool(llama_cpp.llama_vocab_get_add_eos(v)))
        return int(bool(llama_cpp.llama_vocab_get_add_sep(v) or llama_cpp.llama_vocab_get_add_eos(v)))

    def rerank_tokens(self, query: str, document: str) -> list[int]:
        """llama-server's ``format_prompt_rerank``: the GGUF's rerank template (``tokenizer.chat_template.rerank``,
        Qwen3-Reranker's) with ``{query}`` and ``{document}`` filled in, else BOS query [EOS] [SEP] document [EOS]
        as the vocabulary adds them."""
        return self.rerank_tokenizer(query)(document)

    def rerank_tokenizer(self, query: str) -> Callable[[str], list[int]]:
        """:meth:`rerank_tokens` of ``query`` with any document, the query tokenized once: without a template its
        tokens are a part of their own (BOS query [EOS] [SEP]); a template's text is tokenized whole for each
        document (as llama-server does: a BPE merge may cross from the query's text into the template's), and only
        the query's own check is skipped."""
        import llama_cpp

        if self._pooling != "rank":
            raise UnsupportedError("This model has no rank head, so it cannot rerank.")
        template = self._md.get("tokenizer.chat_template.rerank")
        if template:
            head = template.replace("{query}", query)
            return lambda document: self._tokenize(head.replace("{document}", document), False, True)
        v = self._vocab
        eos = int(llama_cpp.llama_vocab_eos(v))
        if eos < 0:
            eos = int(llama_cpp.llama_vocab_sep(v))
        add_eos = bool(llama_cpp.llama_vocab_get_add_eos(v))
        first: list[int] = [int(llama_cpp.llama_vocab_bos(v))] if llama_cpp.llama_vocab_get_add_bos(v) else []
        first += self._tokenize(query, False, False)
        if add_eos:
            first.append(eos)
        if llama_cpp.llama_vocab_get_add_sep(v):
            first.append(int(llama_cpp.llama_vocab_sep(v)))
        end = [eos] if add_eos else []
        return lambda document: first + self._tokenize(document, False, False) + end

    def pool_limits(self) -> tuple[int, int]:
        _, _, tokens, seqs = self._embed_ctx()
        return tokens, seqs

    def pool(self, inputs: Sequence[Sequence[int]]) -> list[Any]:
        """One ``llama_decode`` of all ``inputs`` (sequence ids 0..k-1 of the pooling context), their pooled outputs
        read with ``llama_get_embeddings_seq``; the context's memory (a causal model's cells) is cleared after."""
        import llama_cpp

        ctx, b, tokens, seqs = self._embed_ctx()
        total = sum(len(x) for x in inputs)
        if total > tokens or len(inputs) > seqs or any(not x for x in inputs):
            raise BackendError(f"A pooling batch of {len(inputs)} inputs and {total} tokens does not fit "
                               f"({seqs} inputs, {tokens} tokens).")
        i = 0
        for s, toks in enumerate(inputs):
            for j, t in enumerate(toks):
                b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0], b.logits[i] = t, j, 1, s, True
                i += 1
        b.n_tokens = total
        mem = llama_cpp.llama_get_memory(ctx)
        try:
            rc = llama_cpp.llama_decode(ctx, b)
            if rc != 0:
                raise BackendError(f"llama.cpp failed to evaluate the inputs (llama_decode returned {rc}).")
            width = (int(llama_cpp.llama_model_n_cls_out(self._model)) if self._pooling == "rank"
                     else int(llama_cpp.llama_model_n_embd_out(self._model)))
            out = []
            for s in range(len(inputs)):
                ptr = llama_cpp.llama_get_embeddings_seq(ctx, s)
                if not ptr:
                    raise BackendError("llama.cpp gave no pooled output for an input.")
                out.append(np.array(np.ctypeslib.as_array(ptr, shape=(width,)), dtype=np.float32))
            return out
        finally:
            if mem:
                llama_cpp.llama_memory_clear(mem, True)
