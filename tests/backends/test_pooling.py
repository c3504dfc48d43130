"""Embedding and rerank models through the llama.cpp token source and the decode loop
(:mod:`backends.core.pooling`): the made BERT embedder and reranker (:mod:`tests.support_embed`), and the default
chat model's mean-pooled embeddings evaluated between the steps of a chat stream."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from backends.contract.errors import ContextOverflowError, UnsupportedError
from backends.contract.specs import GenerateRequest, LoadSpec, Sampling
from backends.core import pooling
from backends.core.loop import LoadedModel
from backends.llamacpp._pool import POOL_INPUTS  # noqa: E402
from backends.llamacpp.source import LlamaCppSource  # noqa: E402
from tests.backends.conftest import collect

TEXTS = ["the cat sat on the mat", "hello world", "a dog", "the capital of france is paris",
         "reading books in the morning with coffee and bread"]
LONG = " ".join(["cat", "dog", "bird"] * 240)  # 720 words: over the made models' 512-token context


@pytest.fixture(scope="module")
def embedder(bert_embedder):
    m = LoadedModel(LlamaCppSource, LoadSpec(str(bert_embedder), n_ctx=4096, slots=2), name="embedder")
    yield m
    m.close()


@pytest.fixture(scope="module")
def reranker(bert_reranker):
    m = LoadedModel(LlamaCppSource, LoadSpec(str(bert_reranker), n_ctx=512), name="reranker")
    yield m
    m.close()


def test_an_encoder_loads_as_an_embedding_model_that_cannot_generate(embedder):
    info = embedder.info
    assert info.pooling == "mean" and info.embedding_only and info.n_embd_out == 64
    assert info.n_ctx == 512  # capped to what the model was trained for (position embeddings)
    assert embedder.call(lambda s: s.capabilities.states) is None  # no prompt cache, no parking: nothing is kept
    with pytest.raises(UnsupportedError, match="embedding model: it cannot generate text"):
        collect(embedder.generate(GenerateRequest(prompt="the cat", sampling=Sampling(max_tokens=2))))
    with pytest.raises(UnsupportedError, match="no rank head"):
        embedder.rerank("cat", ["the cat"])


def test_inputs_are_evaluated_together_and_equal_each_alone(embedder):
    together = embedder.embed_many(TEXTS)
    assert together.batches == 1 and len(together.vectors) == len(TEXTS)
    tokens = embedder.call(lambda s: [s.embed_tokens(t) for t in TEXTS])
    assert together.tokens == sum(map(len, tokens)) and all(t[0] == 2 and t[-1] == 3 for t in tokens)  # [CLS] [SEP]
    for text, vec in zip(TEXTS, together.vectors, strict=True):
        alone = embedder.embed_many([text]).vectors[0]
        assert np.allclose(vec, alone, atol=1e-6)
        assert abs(np.linalg.norm(vec) - 1.0) < 1e-6
    assert not np.allclose(together.vectors[0], together.vectors[1], atol=1e-3)
    # no state between requests: the same batch again, after others, gives the same numbers
    again = embedder.embed_many(TEXTS)
    assert np.allclose(again.vectors, together.vectors, atol=1e-6)


def test_more_inputs_than_one_evaluation_takes_go_in_batches(embedder):
    texts = [TEXTS[i % len(TEXTS)] for i in range(POOL_INPUTS + 6)]
    got = embedder.embed_many(texts)
    assert got.batches == 2
    assert np.allclose(got.vectors[POOL_INPUTS + 1], embedder.embed_many([texts[POOL_INPUTS + 1]]).vectors[0],
                       atol=1e-6)


def test_an_input_over_the_context_is_cut_keeping_its_sep_or_refused(embedder):
    got = embedder.embed_many(["hello world", LONG])
    assert got.truncated == [1] and got.tokens == len(embedder.call(lambda s: s.embed_tokens("hello world"))) + 512
    with pytest.raises(ContextOverflowError, match=r"Input 1 has \d+ tokens but the model's context holds 512"):
        embedder.embed_many(["hello world", LONG], truncate=False)


def test_a_reranker_scores_pairs_as_llama_server_builds_them(reranker):
    assert reranker.info.pooling == "rank" and reranker.info.n_embd_out == 1
    q, d = "capital of france", "paris is the capital"
    toks = reranker.call(lambda s: s.rerank_tokens(q, d))
    qt, dt = reranker.call(lambda s: (s.tokenize(q), s.tokenize(d)))
    assert toks == [2, *qt, 3, *dt]  # [CLS] query [SEP] document (the vocabulary adds no EOS)
    docs = ["paris is the capital of france", "bananas are yellow", "the cat sat on the mat"]
    got = reranker.rerank(q, docs)
    assert len(set(got.scores)) == 3 and got.batches == 1
    for doc, score in zip(docs, got.scores, strict=True):
        assert reranker.rerank(q, [doc]).scores[0] == pytest.approx(score, abs=1e-5)
    with pytest.raises(UnsupportedError, match="is a reranker"):
        reranker.embed_many(["cat"])
    cut = reranker.rerank(q, [LONG, "dog"])
    assert cut.truncated == [0]
    with pytest.raises(ContextOverflowError, match="Document 0 has"):
        reranker.rerank(q, [LONG], truncate=False)


def test_a_chat_model_embeds_between_the_steps_of_a_chat_stream(default_model_path):
    """The default model's mean-pooled embeddings (a second context) run as jobs of its decode loop: a chat
    stream in flight goes on, gives the text it gives alone, and the embeddings equal those made alone."""
    spec = LoadSpec(str(default_model_path), n_ctx=1024, slots=2, embedding=True)
    with LoadedModel(LlamaCppSource, spec, name="chat+embed") as m:
        req = GenerateRequest(prompt="Once upon a time", sampling=Sampling(temperature=0, max_tokens=40))
        alone_text, _, _ = collect(m.generate(req))
        alone_vecs = m.embed_many(TEXTS).vectors
        box: dict[str, object] = {}

        def chat() -> None:
            box["text"] = collect(m.generate(GenerateRequest(prompt="Once upon a time",
                                                             sampling=Sampling(temperature=0, max_tokens=40))))[0]

        t = threading.Thread(target=chat)
        t.start()
        during = [m.embed_many(TEXTS).vectors for _ in range(3)]
        t.join()
        assert box["text"] == alone_text
        for vecs in during:
            assert np.allclose(vecs, alone_vecs, atol=1e-4)
        assert m.metrics().requests == 2  # the embeddings are not requests of the loop: no slot, no sequence


def test_a_chat_that_comes_during_a_long_embedding_is_not_held_up_by_its_batches(default_model_path):
    """A chat arriving while the model embeds many inputs waits for at most the batch under way, and then streams
    with short pauses: a batch is sized by time when it runs on the loop (about ``BATCH_SECONDS`` beside a chat,
    ``IDLE_BATCH_SECONDS`` alone, at the speed the batches before it went). Red before: batches of 64 inputs,
    sized when queued, held the chat for seconds (3.2 s here, 2.8 s mid-stream in benchmarks/hostile_load.py).
    The bound is the product's own time budget (the batches are timed on this machine), with room for a loaded
    machine's misjudged batch."""
    rng = random.Random(7)
    words = "cat dog bird tree house river stone cloud light music paper window".split()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(6, 12))) for _ in range(100)]
    spec = LoadSpec(str(default_model_path), n_ctx=1024, slots=2, embedding=True)
    req = GenerateRequest(prompt="Once upon a time", sampling=Sampling(temperature=0, max_tokens=24))

    def chat() -> tuple[float, list[float]]:
        start = time.perf_counter()
        stamps = [time.perf_counter() for e in m.generate(req) if type(e).__name__ == "TextChunk"]
        return start, stamps

    with LoadedModel(LlamaCppSource, spec, name="chat+embed") as m:
        m.embed_many(texts[:4])  # the pooling context made
        start, stamps = chat()
        ttft_alone = stamps[0] - start
        box: dict[str, float] = {}

        def embed() -> None:
            m.embed_many(texts)
            box["end"] = time.perf_counter()

        t = threading.Thread(target=embed)
        t.start()
        time.sleep(0.3)  # the embedding's first batches under way: the chat comes now
        start, stamps = chat()
        t.join()
    waits = [stamps[0] - start - ttft_alone] + [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    assert max(waits) < 3 * pooling.IDLE_BATCH_SECONDS, [round(w, 3) for w in waits]
    assert box["end"] > stamps[-1], "the embedding ended before the chat: nothing was measured beside it"
    assert max(waits[1:]) < 3 * pooling.BATCH_SECONDS + 2 * ttft_alone, [round(w, 3) for w in waits]


def test_a_rerank_template_in_the_gguf_shapes_the_pair_and_a_cut_keeps_its_end(bert_reranker_templated):
    """Qwen3-Reranker's GGUF carries its prompt as ``tokenizer.chat_template.rerank``: the pair is that template
    filled in (special tokens parsed), and a long document is cut before the template's tail, not the tail."""
    from tests.support_embed import RERANK_TEMPLATE

    with LoadedModel(LlamaCppSource, LoadSpec(str(bert_reranker_templated), n_ctx=512)) as m:
        q, d = "capital of france", "paris is the capital"
        filled = RERANK_TEMPLATE.replace("{query}", q).replace("{document}", d)
        toks = m.call(lambda s: s.rerank_tokens(q, d))
        assert toks == m.tokenize(filled, special=True) and toks.count(3) == 3  # three [SEP]s parsed
        tail = m.call(lambda s: s.tail_tokens(rerank=True))
        assert tail == len(m.tokenize(" [SEP] answer yes or no [SEP]", special=True))
        cut = m.call(lambda s: s.rerank_tokens(q, LONG))
        got = m.rerank(q, [LONG, d])
        assert got.truncated == [0] and got.tokens == 512 + len(toks)
        by_hand = m.call(lambda s: s.pool([cut[:512 - tail] + cut[-tail:]]))[0][0]
        assert by_hand == pytest.approx(got.scores[0], abs=1e-5)


@pytest.fixture(scope="module")
def decoder_embedder(default_model_path, test_cache):
    """The default model with ``llama.pooling_type = 3`` (last token): a decoder embedding model, as Qwen3-Embedding's
    GGUF is (a causal model with a KV cache, pooled by its last token's hidden state). Cached in the test cache."""
    from gguf import GGUFValueType

    from tests.backends.gguf_rewrite import with_metadata
    from tests.support import file_key

    dst = test_cache / "derived" / f"smollm2-last-pooling-{file_key(default_model_path)}.gguf"
    if not dst.is_file():
        with_metadata(default_model_path, dst, {"llama.pooling_type": (3, GGUFValueType.UINT32)})
    return dst


def test_a_decoder_with_a_pooling_head_is_an_embedding_model_on_llama_cpp_only(decoder_embedder):
    from backends.mlx.convert import inspect_gguf
    from localllm.ggufinfo import capabilities_of, read_gguf

    assert capabilities_of(read_gguf(decoder_embedder).as_dict()) == ["embedding"]
    with pytest.raises(UnsupportedError, match="embedding or reranking model .*mlx-lm has no pooling"):
        inspect_gguf(decoder_embedder)  # the planner keeps it on llama.cpp, and probe says why
    with LoadedModel(LlamaCppSource, LoadSpec(str(decoder_embedder), n_ctx=1024, slots=2)) as m:
        assert m.info.pooling == "last" and m.info.n_embd_out == 576
        with pytest.raises(UnsupportedError, match="embedding model"):
            collect(m.generate(GenerateRequest(prompt="Hello", sampling=Sampling(max_tokens=2))))
        together = m.embed_many(TEXTS)
        assert together.batches == 1
        for text, vec in zip(TEXTS, together.vectors, strict=True):  # the causal KV is cleared between batches
            assert np.allclose(vec, m.embed_many([text]).vectors[0], atol=1e-4)
        assert np.allclose(m.embed_many(TEXTS).vectors, together.vectors, atol=1e-4)
