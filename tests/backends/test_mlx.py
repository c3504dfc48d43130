"""MLX-only behaviour on the real default model (converted offline from its GGUF), with mlx[cpu].

The shared behaviour (answers, seeds, stops, prefix reuse, cancellation, stats...) is in
``test_behaviour.py``, parametrized over both backends. Here: the converter's exactness, KV
quantization, speculative decoding (model and n-gram drafts, the cost-model back-off), refusals,
penalties that do not depend on the cache, and thread safety. MLX decodes ~7 tok/s on CPU: keep it short.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from backends.contract.errors import ModelLoadError, UnsupportedError
from backends.contract.source import Feed
from backends.contract.specs import DraftSpec, GenerateRequest, LoadSpec, Sampling, Tuning
from backends.core.prompt_cache import PromptCacheSpec
from backends.mlx.source import MLXSource
from backends.registry import load
from tests.backends.conftest import collect


@pytest.fixture(autouse=True, scope="module")
def _needs_mlx():
    """mlx[cpu] comes with the test extras: without it every test here skips (a failure under strict mode)."""
    pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'localllm[mlx-cpu]')")
    pytest.importorskip("mlx_lm")

pytestmark = pytest.mark.mlx

CAPITAL = [{"role": "user", "content": "What is the capital of France? Answer in one short sentence."}]
BIKE = [{"role": "user", "content": "Explain in a few sentences how a bicycle works."}]
# the speculative-decoding tests continue a raw prompt (no chat template: 7 tokens instead of 43): on MLX's CPU
# backend a prompt token costs as much as a generated one, and what they compare is drafted text with greedy text
BIKE_TEXT = "Here is how a bicycle works:"


def greedy(n: int, **kw) -> Sampling:
    return Sampling(temperature=0.0, repeat_penalty=1.0, max_tokens=n, **kw)


@pytest.fixture(scope="module")
def mlx_dir(default_mlx_dir: Path) -> Path:
    return default_mlx_dir


@pytest.fixture(scope="module")
def plain(mlx_dir: Path):
    b = load("mlx", LoadSpec(model_path=str(mlx_dir), n_ctx=1024))
    yield b
    b.close()


@pytest.fixture(scope="module")
def bike_greedy(plain) -> str:
    text, done, _ = collect(plain.generate(GenerateRequest(prompt=BIKE_TEXT, sampling=greedy(20))))
    assert done.finish_reason == "length"
    return text


# ------------------------------------------------------------------------------------ converter


def test_converted_dir_is_a_mixed_4_8_bit_mlx_model(mlx_dir: Path):
    cfg = json.loads((mlx_dir / "config.json").read_text())
    q = cfg["quantization"]
    assert (q["bits"], q["group_size"], q["mode"]) == (4, 32, "affine")
    assert q["model.embed_tokens"]["bits"] == 8  # the Q8_0 embedding of the "Q4_1" file
    assert cfg["eos_token_id"] == [2, 0]  # <|im_end|> and <|endoftext|>, like llama.cpp's EOG set
    assert cfg["tie_word_embeddings"] is True and cfg["head_dim"] == 64
    tcfg = json.loads((mlx_dir / "tokenizer_config.json").read_text())
    assert tcfg["tokenizer_class"] == "PreTrainedTokenizerFast" and "<|im_start|>" in tcfg["chat_template"]


def test_unpermute_inverts_llama_cpp_rope_permutation():
    import mlx.core as mx

    from backends.mlx.convert import _unpermute

    def permute(w, n):  # convert_hf_to_gguf.py's permute
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = mx.arange(3 * 8 * 5).reshape(3 * 8, 5)
    assert mx.array_equal(_unpermute(permute(w, 3), 3, 8), w).item()
    assert not mx.array_equal(permute(w, 3), w).item()


def test_tokenizer_matches_llama_cpp(plain, default_model_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(default_model_path), vocab_only=True, verbose=False)
    text = "Hello wörld! 12345 ²³ ⅕ café\r\n\tdef f(x): return x**2  # 😀 <|im_start|>user\nhi<|im_end|>"
    assert plain.tokenize(text, special=True) == llm.tokenize(text.encode(), add_bos=False, special=True)
    plain_text = "Hello, world! 2024 résumé"
    assert plain.tokenize(plain_text) == llm.tokenize(plain_text.encode(), add_bos=False, special=False)


def test_gguf_file_is_refused_with_a_hint(default_model_path):
    with pytest.raises(ModelLoadError, match="convert"):
        MLXSource(LoadSpec(model_path=str(default_model_path)))


def test_every_tokens_bytes_match_the_byte_level_decoder(plain):
    """The bytes a streamed token adds (decoded in C with str.translate) are, for all 49,152 tokens, what
    mlx-lm's byte decoder gives character by character; special tokens (``<|im_end|>``, ``<repo_name>``...) add
    nothing."""
    from mlx_lm.tokenizer_utils import _byte_decoder

    from backends.mlx._json import JSONConstraint

    hf = plain.source._tok._tokenizer
    dec = _byte_decoder()
    special = set(hf.all_special_ids) | {i for i, t in hf.added_tokens_decoder.items() if t.special}
    want = [None if i in special else bytes(dec[c] for c in p)
            for i, p in enumerate(hf.convert_ids_to_tokens(list(range(len(hf)))))]
    got = JSONConstraint.vocabulary_bytes(plain.source._tok)
    assert got == want and sum(b is None for b in got) == len(special)


def test_a_plain_answer_never_builds_json_modes_trie_and_close_frees_the_weights(mlx_dir: Path):
    """The byte trie JSON mode walks costs ~0.5 s (2 s in a busy process): a plain answer never pays it. Closing
    frees the model's MLX memory at once (by reference count: a full collection runs only if a cycle holds it)."""
    import mlx.core as mx

    before = mx.get_active_memory()
    m = load("mlx", LoadSpec(model_path=str(mlx_dir), n_ctx=256))
    try:
        text, _, _ = collect(m.generate(GenerateRequest(prompt="Paris is", sampling=greedy(2))))
        assert text and m.source._json_trie is None
        collect(m.generate(GenerateRequest(prompt="x", format="json", sampling=greedy(1))))
        assert m.source._json_trie is not None
        assert mx.get_active_memory() > before + 50 * 2**20  # the weights (~120 MB)
    finally:
        m.close()
    assert mx.get_active_memory() <= before


# ------------------------------------------------------------------------------------ requests


def test_json_mode_gives_one_object_even_when_sampling(plain):
    msgs = [{"role": "user", "content": "Describe Paris as JSON with keys city and population."}]
    for s in (greedy(80), Sampling(temperature=0.7, seed=3, max_tokens=80)):
        text, done, _ = collect(plain.generate(GenerateRequest(messages=msgs, format="json", sampling=s)))
        assert done.finish_reason == "stop", text  # the object closed, then only EOS was allowed
        assert isinstance(json.loads(text), dict)


def test_json_schema_with_enum_and_array_is_followed(plain):
    schema = {"type": "object", "properties": {
        "country": {"enum": ["France", "Italy", "Spain"]},
        "cities": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 2},
        "capital": {"type": "boolean"}}}
    msgs = [{"role": "user", "content": "Describe France as JSON: its country name, two cities, capital or not."}]
    text, done, _ = collect(plain.generate(GenerateRequest(messages=msgs, format=schema, sampling=greedy(60))))
    obj = json.loads(text)
    assert done.finish_reason == "stop" and list(obj) == ["country", "cities", "capital"]
    assert obj["country"] in ("France", "Italy", "Spain") and isinstance(obj["capital"], bool)
    assert 1 <= len(obj["cities"]) <= 2 and all(isinstance(c, str) and len(c) <= 12 for c in obj["cities"])


def test_schema_keywords_outside_the_subset_are_refused_not_ignored(plain):
    for schema, word in (({"type": "object", "properties": {"a": {"type": "string", "pattern": "^x"}}}, "pattern"),
                         ({"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}]}}}, "anyOf"),
                         ({"type": "array", "items": {}}, "top level")):
        with pytest.raises(UnsupportedError, match=word):
            collect(plain.generate(GenerateRequest(messages=CAPITAL, format=schema)))


def test_schema_automaton_accepts_valid_documents_and_refuses_the_rest():
    from backends.mlx._json import compile_schema

    s = compile_schema({"type": "object", "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 5}, "pop": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2}, "x": {"type": "number"},
        "k": {"enum": ["a", "b", 3]}, "any": {}, "o": {"type": "object"}, "n": {"type": "null"}}})
    good = [b'{"city":"Paris","pop":2100000,"tags":["a", "b"],"x":-1.5e3,"k":3,"any":[1,{"q":null}],"o":{},"n":null}',
            b'{"city": "Par\\u00e9", "pop": 0, "tags": [], "x": 0, "k": "a", "any": 12, "o": {"z": [true]}, "n": null}',
            '{"city":"Züri","pop":1,"tags":[],"x":1,"k":"b","any":"s","o":{},"n":null}'.encode()]
    for g in good:
        end = s.feed(g)
        assert end is not None and end.done, g
        json.loads(g)
    bad = [b'{"city":"Zurich"', b'{"city":"","pop":1', b'{"city":"P","pop":1.5', b'{"pop":1',
           b'{"city":"P","pop":1,"tags":["a","b","c"]', b'{"city":"P","pop":1,"tags":[],"x":1,"k":"c"',
           b'{"city":"P","pop":1,"tags":[],"x":1,"k":3,"any":1,"o":[]']
    for x in bad:
        assert s.feed(x) is None, x


def test_json_automaton_accepts_json_and_refuses_the_rest():
    from backends.mlx._json import JSONState

    good = [b'{}', b'{"a":1}', b'{"a": [1, 2.5, -0.1e-3, true, false, null, {"b": "\\u00e9\\""}]}', b'{ }']
    for g in good:
        s = JSONState.start().feed(g)
        assert s is not None and s.done, g
    bad = [b'[1]', b'{"a" 1}', b'{"a":01}', b'{"a":1,}', b'{"a":"x\ny"}', b'{"a":tru}', b'{}x', b'{' + b' ' * 20]
    for x in bad:
        s = JSONState.start().feed(x)
        assert s is None or not s.done, x


def test_penalties_do_not_depend_on_what_was_cached(mlx_dir: Path):
    """mlx-lm's processors only see the tokens fed in a call; ours see the whole context, so a cached
    prefix gives the same text as a cold one."""
    b = load("mlx", LoadSpec(model_path=str(mlx_dir), n_ctx=1024))
    try:
        s = Sampling(temperature=0.0, repeat_penalty=1.5, repeat_last_n=64, max_tokens=12)
        cold, _, _ = collect(b.generate(GenerateRequest(messages=BIKE, sampling=s)))
        warm, d, _ = collect(b.generate(GenerateRequest(messages=BIKE, sampling=s)))
        assert d.stats.prompt_cached_tokens >= d.stats.prompt_eval_count - 1
        assert warm == cold
    finally:
        b.close()


def test_two_threads_are_served_together(plain):
    out: list[str] = []

    def run() -> None:
        out.append(collect(plain.generate(GenerateRequest(messages=CAPITAL, sampling=greedy(8))))[0])

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(out) == 2 and out[0] == out[1] and "Paris" in out[0]


def test_info_can_be_read_from_other_threads_while_requests_run(mlx_dir: Path):
    """``ps``, ``/metrics`` and every request read a loaded model's info from other threads while the loop's
    thread moves caches in and out of the batch: a reader hammering it never fails and sees the KV grow."""
    with load("mlx", LoadSpec(model_path=str(mlx_dir), n_ctx=512, slots=3)) as m:
        base = m.info.size_bytes
        errors: list[BaseException] = []
        sizes: list[int] = []
        stop = threading.Event()

        def hammer() -> None:
            while not stop.is_set():
                try:
                    sizes.append(m.info.size_bytes)
                except Exception as e:  # noqa: BLE001 - what the test looks for
                    errors.append(e)
                time.sleep(0.0005)  # thousands of reads, but the GIL left to the loop's thread now and then

        def ask(q: str) -> None:
            collect(m.generate(GenerateRequest(prompt=q, sampling=greedy(4))))  # raw: a prompt token costs a step

        readers = [threading.Thread(target=hammer) for _ in range(2)]
        askers = [threading.Thread(target=ask, args=(q,)) for q in ("A tall tree:", "A small bird:", "A fish:")]
        for t in readers + askers:
            t.start()
        for t in askers:
            t.join(120)
        stop.set()
        for t in readers:
            t.join(10)
        assert not errors, errors[:3]
        assert len(sizes) > 1000  # it did hammer
        assert m.source.batched_steps > 0 and max(sizes) > base  # the caches moved, and the reader saw them


def test_seq_rm_keeps_a_sequence_when_the_range_ends_before_its_tokens(plain):
    """``seq_rm(seq, 0, p1)`` with ``p1`` inside the tokens is not a tail: refused, the cache untouched (it used
    to drop the whole sequence); a range past the end, or to the end, empties it."""
    def probe(src: MLXSource) -> list[object]:
        plain.pool.clear()
        ids = src.prompt_tokens("The quick brown fox jumps over the lazy dog.")
        src.evaluate([Feed(1, ids, 0, 1)])
        held = lambda: src._caches[1][0].offset if 1 in src._caches else 0  # noqa: E731
        out: list[object] = [len(ids), src.seq_rm(1, 0, 5), held(), src.seq_rm(1, 0, 0), held(),
                             src.seq_rm(1, 3, 5), held(), src.seq_rm(1, 6), held(), src.seq_rm(1, 0, 100), held()]
        src.seq_rm(1)
        return out

    n, *got = plain.call(probe)
    assert got == [False, n, True, n, False, n, True, 6, True, 0]


# ------------------------------------------------------------------------------ batched slots


def test_concurrent_streams_decode_in_one_pass_and_equal_their_solo_output(mlx_dir: Path):
    # raw prompts of three lengths (left padding in the batch; no chat template, whose 30 tokens MLX's CPU backend
    # would evaluate at a generated token's cost each)
    asks = ["Once upon a time, a cat", "The rain fell softly on the old", "Gravity is"]
    with load("mlx", LoadSpec(model_path=str(mlx_dir), n_ctx=1024, slots=3)) as m:
        assert m.source.can_batch and m.info.batched is True
        solo = [collect(m.generate(GenerateRequest(prompt=a, sampling=greedy(10))))[0] for a in asks]
        assert m.source.batched_steps == 0  # alone, each is its own pass
        out: list[str | None] = [None] * len(asks)

        def work(i: int) -> None:
            out[i] = collect(m.generate(GenerateRequest(prompt=asks[i], sampling=greedy(10))))[0]

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(asks))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert m.source.batched_steps > 0  # rows of one BatchKVCache, left padded
        assert out == solo
        again = collect(m.generate(GenerateRequest(prompt=asks[1], sampling=greedy(10))))
        assert again[0] == solo[1] and again[1].stats.prompt_cached_tokens > 0  # its cache left the batch intact


def test_quantized_kv_slots_take_turns(mlx_dir: Path):
    with load("mlx", LoadSpec(model_path=str(mlx_dir), n_ctx=512, slots=2, kv_cache_type="q8_0")) as m:
        assert not m.source.can_batch and m.info.batched is False  # no batched quantized cache in mlx-lm


# ------------------------------------------------------------------------------ KV quantization


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_quantized_kv_cache_answers_and_reuses_prefix(mlx_dir: Path, kv: str):
    from mlx_lm.models.cache import QuantizedKVCache

    b = load("mlx", LoadSpec(model_path=str(mlx_dir), n_ctx=1024, kv_cache_type=kv))
    try:
        assert b.info.kv_cache_type == kv
        text, d1, _ = collect(b.generate(GenerateRequest(messages=CAPITAL, sampling=greedy(12))))
        assert "Paris" in text
        caches = b.call(lambda s: [c for cache in s._caches.values() for c in cache])
        assert caches and all(isinstance(c, QuantizedKVCache) and c.bits == {"q8_0": 8, "q4_0": 4}[kv] for c in caches)
        turn2 = [*CAPITAL, {"role": "assistant", "content": text}, {"role": "user", "content": "And Italy?"}]
        _, d2, _ = collect(b.generate(GenerateRequest(messages=turn2, sampling=greedy(4))))
        assert d2.stats.prompt_cached_tokens >= d1.stats.prompt_eval_count
    finally:
        b.close()


def test_unknown_kv_type_is_refused(mlx_dir: Path):
    with pytest.raises(UnsupportedError, match="q5_1"):
        MLXSource(LoadSpec(model_path=str(mlx_dir), kv_cache_type="q5_1"))  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ speculative decoding


@pytest.fixture(scope="module")
def self_drafted(mlx_dir: Path):
    """The default model drafting for itself, always (one load for the tests that use it)."""
    spec = LoadSpec(model_path=str(mlx_dir), n_ctx=1024, tuning=Tuning(draft_always=True),
                    draft=DraftSpec(kind="model", path=str(mlx_dir), num_draft=3))
    with load("mlx", spec) as b:
        yield b


def test_model_draft_is_exact_and_reports_acceptance(mlx_dir: Path, bike_greedy: str, self_drafted):
    b = self_drafted
    assert b.info.draft == str(mlx_dir)
    text, done, _ = collect(b.generate(GenerateRequest(prompt=BIKE_TEXT, sampling=greedy(20))))
    assert text == bike_greedy
    s = done.stats
    assert s.draft_proposed > 0 and s.draft_accepted == s.draft_proposed  # a self-draft agrees at temp 0
    # second turn: the cache (target and draft) is reused and the output stays exact
    text2, d2, _ = collect(b.generate(GenerateRequest(prompt=BIKE_TEXT, sampling=greedy(20))))
    assert text2 == bike_greedy and d2.stats.prompt_cached_tokens > 0


def test_ngram_draft_is_exact(mlx_dir: Path, bike_greedy: str):
    spec = LoadSpec(model_path=str(mlx_dir), n_ctx=1024, tuning=Tuning(draft_always=True),
                    draft=DraftSpec(kind="ngram", num_draft=3))
    with load("mlx", spec) as b:
        text, done, _ = collect(b.generate(GenerateRequest(prompt=BIKE_TEXT, sampling=greedy(20))))
        assert text == bike_greedy
        assert done.stats.draft_proposed > 0 and b.info.draft == "ngram"


def test_a_self_draft_that_cannot_pay_stays_exact(mlx_dir: Path, bike_greedy: str):
    """On mlx's CPU backend a pass over k+1 tokens costs about k+1 steps, so a draft as big as the model
    cannot pay; whatever the controller decides, the text is the greedy text (the back-off itself is
    tested with synthetic timings in tests/backends/test_speculative.py)."""
    spec = LoadSpec(model_path=str(mlx_dir), n_ctx=1024, draft=DraftSpec(kind="model", path=str(mlx_dir)))
    with load("mlx", spec) as b:
        assert b.controller is not None
        text, done, _ = collect(b.generate(GenerateRequest(prompt=BIKE_TEXT, sampling=greedy(20))))
        assert text == bike_greedy


def test_draft_with_another_vocabulary_is_refused(mlx_dir: Path, tmp_path: Path):
    other = tmp_path / "other"
    other.mkdir()
    for f in mlx_dir.iterdir():
        if f.name != "tokenizer.json":
            (other / f.name).symlink_to(f)
    tok = json.loads((mlx_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]  # same tokens, other ids
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(UnsupportedError, match="tokenize"):
        load("mlx", LoadSpec(model_path=str(mlx_dir), draft=DraftSpec(kind="model", path=str(other))))


def test_controller_doctests():
    import doctest

    import backends.mlx._json
    import backends.mlx.source

    assert doctest.testmod(backends.mlx.source).failed == 0
    assert doctest.testmod(backends.mlx._json).failed == 0


def test_available_reports_importable():
    assert MLXSource.available() == (True, "")


def _rotating_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend the model uses sliding-window (rotating) caches: the default model cannot show that."""
    import mlx_lm.models.cache as cache_mod

    monkeypatch.setattr(cache_mod, "make_prompt_cache",
                        lambda model, max_kv_size=None: [cache_mod.RotatingKVCache(max_size=64) for _ in model.layers])


def test_kv_quantization_of_a_rotating_cache_is_refused(mlx_dir: Path, monkeypatch: pytest.MonkeyPatch):
    _rotating_caches(monkeypatch)
    with pytest.raises(UnsupportedError, match="sliding-window"):
        MLXSource(LoadSpec(model_path=str(mlx_dir), kv_cache_type="q8_0"))


def test_drafting_with_an_untrimmable_cache_is_refused(mlx_dir: Path, monkeypatch: pytest.MonkeyPatch):
    _rotating_caches(monkeypatch)
    with pytest.raises(UnsupportedError, match="trimmable"):
        load("mlx", LoadSpec(model_path=str(mlx_dir), draft=DraftSpec(kind="ngram")))


def test_kv_quantization_needs_a_head_size_divisible_by_32(mlx_dir: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(MLXSource, "_head_dim", lambda self: 48)
    with pytest.raises(UnsupportedError, match="head size divisible by 32.*48"):
        MLXSource(LoadSpec(model_path=str(mlx_dir), kv_cache_type="q4_0"))


def test_seeded_sampling_with_a_draft_is_reproducible(self_drafted):
    """Drafts at temperature > 0: sample-and-compare keeps the target's own samples, and one seed gives
    one text (the second run also reuses the target and draft caches)."""
    s = Sampling(temperature=0.8, top_k=0, top_p=1.0, seed=11, max_tokens=16)
    b = self_drafted
    a, da, _ = collect(b.generate(GenerateRequest(prompt=BIKE_TEXT, sampling=s)))
    c, dc, _ = collect(b.generate(GenerateRequest(prompt=BIKE_TEXT, sampling=s)))
    assert a == c and len(a) > 10
    assert da.stats.draft_proposed > 0 and dc.stats.prompt_cached_tokens > 0


def test_cancelled_before_start_evaluates_nothing(plain):
    cancel = threading.Event()
    cancel.set()
    text, done, _ = collect(plain.generate(GenerateRequest(messages=BIKE, sampling=greedy(8)), cancel))
    assert text == "" and done.finish_reason == "cancelled" and done.stats.eval_count == 0


def test_logit_bias_bans_a_token_and_refuses_one_outside_the_vocabulary(plain):
    """OpenAI's logit_bias on MLX: -100 keeps greedy's first pick out, a token id past the vocabulary is refused."""
    req = GenerateRequest(prompt="The capital of France is", sampling=greedy(1))
    first = plain.tokenize(collect(plain.generate(req))[0])
    assert first
    banned = GenerateRequest(prompt="The capital of France is", sampling=greedy(1, logit_bias={first[0]: -100.0}))
    other = collect(plain.generate(banned))[0]
    assert other and plain.tokenize(other)[:1] != first[:1]
    with pytest.raises(UnsupportedError, match="does not have"):
        collect(plain.generate(GenerateRequest(prompt="x", sampling=greedy(1, logit_bias={10**9: 1.0}))))


# ------------------------------------------------------------------------------ prompt cache on disk

# ~35 tokens with the template: above the cache's min_tokens (16), short for MLX's CPU prefill (~15 tokens/s)
# a raw prompt of ~20 tokens (above the cache's min_tokens 16): on mlx[cpu] a prompt token costs ~65 ms, and a chat
# template would add ~20 more (the prompt cache keys on tokens alone, however they were made)
ASK = " ".join(f"Rule {i}: cite rule {i}." for i in range(2)) + " Rule 1 says:"

CHILD = """
import json, sys
sys.path.insert(0, {root!r})
from backends.contract.specs import GenerateRequest, LoadSpec
from backends.core.prompt_cache import PromptCacheSpec
from backends.registry import load
from tests.backends.conftest import collect
from tests.backends.test_mlx import ASK, greedy
spec = PromptCacheSpec({cache!r}, "test-model mlx", min_tokens=16)
with load("mlx", LoadSpec(model_path={model!r}, n_ctx=1024, slots=1), prompt_cache=spec) as m:
    text, done, _ = collect(m.generate(GenerateRequest(prompt=ASK, sampling=greedy(8))))
stats = done.stats
print(json.dumps({{"text": text, "restored": stats.prompt_restored_tokens, "prompt": stats.prompt_eval_count}}))
"""


def _mlx_cached(mlx_dir: Path, cache: Path, kv: str = "f16"):
    spec = PromptCacheSpec(str(cache), "test-model mlx", min_tokens=16)
    return load("mlx", LoadSpec(model_path=str(mlx_dir), n_ctx=1024, slots=1, kv_cache_type=kv), prompt_cache=spec)


def test_a_second_process_restores_the_prompt_from_disk_and_answers_the_same(mlx_dir: Path, tmp_path: Path):
    import os
    import subprocess
    import sys

    code = CHILD.format(root=str(Path(__file__).resolve().parents[2]), cache=str(tmp_path), model=str(mlx_dir))

    def child() -> dict:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ))
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    first = child()
    assert first["restored"] == 0 and list(tmp_path.glob("*.kv")), "nothing was saved"
    again = child()
    assert again["restored"] == first["prompt"] - 1  # all but the last token, whose logits are not saved
    assert again["text"] == first["text"]


def test_quantized_kv_restores_its_own_entries_and_misses_the_others(mlx_dir: Path, tmp_path: Path):
    with _mlx_cached(mlx_dir, tmp_path) as m:  # an f16 entry
        collect(m.generate(GenerateRequest(prompt=ASK, sampling=greedy(4))))
    answers = []
    for _ in range(2):
        with _mlx_cached(mlx_dir, tmp_path, kv="q8_0") as m:
            text, done, _ = collect(m.generate(GenerateRequest(prompt=ASK, sampling=greedy(4))))
            answers.append((text, done.stats.prompt_restored_tokens))
    assert answers[0][1] == 0  # the f16 entry is another key: a miss, not a load
    assert answers[1][1] == done.stats.prompt_eval_count - 1 and answers[1][0] == answers[0][0]


def _reshaped(state: bytes, change) -> bytes:
    """``state`` (from ``state_save``) with its header changed by ``change(header)``."""
    size = int.from_bytes(state[:8], "little")
    head = json.loads(state[8:8 + size])
    change(head)
    raw = json.dumps(head).encode()
    return len(raw).to_bytes(8, "little") + raw + state[8 + size:]


def test_a_state_that_does_not_fit_the_model_is_refused_and_removed(mlx_dir: Path, tmp_path: Path, caplog):
    from backends.core.prompt_cache import PromptCache

    with _mlx_cached(mlx_dir, tmp_path) as m:
        ref, _, _ = collect(m.generate(GenerateRequest(prompt=ASK, sampling=greedy(4))))
        key = f"test-model mlx {m.source.state_key()}"
        m.call(lambda _src: None)  # the copy is taken after the answer: wait for it, then for the write
        assert m.prompt_cache is not None
        m.prompt_cache.flush()
        entry = max(tmp_path.glob("*.kv"))  # the whole prompt (names start with the token count)
        tokens = json.loads(entry.read_bytes().split(b"\n", 1)[0])["tokens"]
        good = m.call(lambda s: s.state_save(next(i for i, c in s._caches.items() if c)))
        bad = {"one layer fewer": _reshaped(good, lambda h: h["layers"].pop()),
               "other heads": _reshaped(good, lambda h: [a.__setitem__("shape", [1, 9, *a["shape"][2:]])
                                                         for layer in h["layers"] for a in layer["arrays"]]),
               "quantized": _reshaped(good, lambda h: [layer.__setitem__("quant", [64, 8]) for layer in h["layers"]]),
               "truncated": good[:-10], "not a state": b"nonsense"}
        for why, data in bad.items():
            assert m.call(lambda s, d=data: s.state_load(7, d)) is False, why
        assert m.call(lambda s: s.state_load(7, good)) is True
    pc = PromptCache(tmp_path, key=key, max_bytes=1 << 30, min_tokens=16)
    assert pc.save_now(tokens, bad["one layer fewer"])  # a well-formed entry the backend cannot use
    with _mlx_cached(mlx_dir, tmp_path) as m:
        text, done, _ = collect(m.generate(GenerateRequest(prompt=ASK, sampling=greedy(4))))
    assert done.stats.prompt_restored_tokens == 0 and text == ref
    assert "the backend refused it" in caplog.text
