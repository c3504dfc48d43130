"""GGUF → MLX conversion (``backends.mlx.convert``), checked against llama.cpp on real weights, with mlx[cpu].

* exactness: the default model's Q4_1/Q8_0 blocks are repacked bit for bit (equal to mlx's own GGUF
  reader); its F32 variant gives llama.cpp's F32 greedy tokens for 40 tokens; gemma3:270m (Q4_K_M,
  SentencePiece) dequantized gives llama.cpp's F32 tokens too;
* architectures: the default model rewritten as qwen2, qwen3, phi3 and Llama-3.1 (rope_freqs) GGUFs
  (``gguf_rewrite``): llama.cpp's logits for that architecture and the MLX conversion's agree;
* tokenizers: llama.cpp's tokenization is reproduced for each BPE pre-tokenizer and for SentencePiece
  with and without the space prefix;
* the requantized default path (gemma3:270m Q4_K_M → 4/8-bit MLX) runs through the MLX backend, and its
  greedy continuation is compared with llama.cpp's on the same GGUF (figures printed);
* refusals by name, nothing written; a SIGKILL mid-conversion leaves nothing registered; estimates.

MLX on CPU decodes at ~7 tok/s: generations stay short.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import pytest

from backends.contract.errors import ModelLoadError, UnsupportedError
from backends.contract.specs import GenerateRequest, LoadSpec, Sampling
from backends.llamacpp.checks import physical_cores
from backends.mlx import convert as mlx_convert
from backends.mlx._gguf import GGUFFile
from backends.mlx._tokenizer import write_tokenizer
from backends.mlx.convert import convert_gguf, inspect_gguf
from tests.backends import gguf_rewrite
from tests.backends.conftest import TEST_CACHE, _file_key, collect, derive_gguf

pytestmark = pytest.mark.mlx


@pytest.fixture(autouse=True, scope="module")
def _needs_mlx():
    """mlx[cpu] comes with the test extras: without it every test here skips (a failure under strict mode)."""
    pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'localllm[mlx-cpu]')")
    pytest.importorskip("mlx_lm")

CORPUS = [
    "Hello wörld! 12345 ²³ ⅕ café\r\n\tdef f(x): return x**2  # 😀",
    "The quick brown fox   jumps over\n\n\nthe lazy dog.  ",
    "日本語のテキスト and Ελληνικά, naïve — “quotes” I'm we'll THEY'RE",
    " leading space, trailing space ",
    "\u00a0nbsp\u200b zero width, tabs\t\tand 1,234,567.89 numbers 2024-12-01",
    "camelCaseWords HTTPServer snake_case_words x+=1; y<=2 && z!=3 /path/to/file.py",
]


def _converter_key() -> str:
    """The converter's code (and the GGUF reader it builds on): a change to either converts again."""
    return mlx_convert.code_digest()[:10]


def _rewritten(src: Path, name: str, make: Callable[[Path], Path]) -> Path:
    """``make(dst)``'s rewrite of ``src`` (:mod:`gguf_rewrite`), kept in the test cache like the derived GGUFs:
    keyed by ``src``, ``name`` and the rewriting code, so a warm run reads it instead of writing it again."""
    code = hashlib.sha256(Path(gguf_rewrite.__file__).read_bytes()).hexdigest()[:10]
    dst = TEST_CACHE / "derived" / f"{src.stem[:40]}-{_file_key(src)}-{name}-{code}.gguf"
    if not dst.is_file():
        dst.parent.mkdir(parents=True, exist_ok=True)
        make(dst)  # atomic: written beside dst, then renamed
    return dst


@pytest.fixture(scope="session")
def converted() -> Callable[..., Path]:
    """``converted(gguf, **kw)``: the MLX directory of ``gguf`` (cached across runs per file, options and
    converter version, like the derived GGUFs)."""

    def get(src: Path, **kw: Any) -> Path:
        opts = "-".join(f"{k}={v}" for k, v in sorted(kw.items()))
        out = TEST_CACHE / "mlx-convert" / f"{src.stem[:40]}-{_file_key(src)}-{_converter_key()}-{opts}"
        if mlx_convert.is_mlx_dir(out):
            return out
        return convert_gguf(src, out, **kw)

    return get


@pytest.fixture(scope="session")
def gemma_path(gemma_model) -> Path:
    return Path(gemma_model.path)


@functools.lru_cache(maxsize=1)  # one model at a time, loaded once for the prompts a test compares
def _llama(path: Path) -> Any:
    return llama_cpp.Llama(str(path), n_ctx=512, n_threads=physical_cores(), verbose=False)


@functools.lru_cache(maxsize=1)
def _mlx_model(mlx_dir: Path) -> Any:
    from mlx_lm.utils import load_model

    return load_model(mlx_dir)[0]  # the weights only: gemma's 262k-piece tokenizer takes 5-12 s to load


def llama_greedy(path: Path, ids: list[int], n: int) -> list[int]:
    """llama.cpp's greedy continuation of ``ids`` on ``path``. Kept in the test cache under the file, the prompt,
    ``n``, the llama.cpp version and the thread count: for those it is what llama.cpp computes again (the F32
    gemma file alone takes ~4 s to decode 32 tokens on 2 cores)."""
    key = hashlib.sha256(json.dumps([path.name, _file_key(path), ids, n, llama_cpp.__version__,
                                     physical_cores()]).encode()).hexdigest()[:32]
    ref = TEST_CACHE / "reference" / f"llama-greedy-{key}.json"
    if ref.is_file():
        return [int(t) for t in json.loads(ref.read_text())]
    out: list[int] = []
    for t in _llama(path).generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        out.append(int(t))
        if len(out) >= n:
            break
    ref.parent.mkdir(parents=True, exist_ok=True)
    tmp = ref.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(out))
    tmp.replace(ref)
    return out


def mlx_greedy(mlx_dir: Path, ids: list[int], n: int) -> list[int]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    model = _mlx_model(mlx_dir)  # generate_step makes a fresh prompt cache per call
    steps = generate_step(mx.array(ids), model, sampler=make_sampler(0.0), max_tokens=n)
    return [int(t) for (t, _), _ in zip(steps, range(n), strict=False)]


def mlx_agreement(mlx_dir: Path, ids: list[int], want: list[int]) -> int:
    """How many of ``want``'s tokens MLX's greedy continuation of ``ids`` repeats before its first other token,
    stepping MLX only up to that first difference (MLX's CPU backend decodes ~10 tokens/s)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    steps = generate_step(mx.array(ids), _mlx_model(mlx_dir), sampler=make_sampler(0.0), max_tokens=len(want))
    return next((i for i, ((t, _), w) in enumerate(zip(steps, want, strict=False)) if int(t) != w), len(want))


def hf_tokenizer(mlx_dir: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(mlx_dir / "tokenizer.json"))


def assert_tokenizes_like_llama_cpp(gguf: Path, mlx_dir: Path, corpus: list[str] = CORPUS) -> None:
    vocab = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False)
    tk = hf_tokenizer(mlx_dir)
    for text in corpus:
        want = vocab.tokenize(text.encode(), add_bos=False, special=True)
        assert tk.encode(text, add_special_tokens=False).ids == want, text
    # and the BOS policy: llama.cpp's add_bos matches the post-processor
    want = vocab.tokenize(corpus[0].encode(), add_bos=True, special=True)
    assert tk.encode(corpus[0]).ids == want


# ------------------------------------------------------------------------------------ exactness


def test_q4_1_and_q8_0_blocks_are_repacked_bit_for_bit(default_model_path: Path, converted):
    """The default model's Q4_1 projections and Q8_0 embedding equal what mlx's own GGUF reader makes of
    them (which matches gguf-py's dequantizer to float rounding): nothing is requantized."""
    import mlx.core as mx

    out = converted(default_model_path)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["converted_from"]["tensor_types"] == {"F32": "float", "Q4_1": "kept 4-bit", "Q8_0": "kept 8-bit"}
    assert (cfg["quantization"]["bits"], cfg["quantization"]["group_size"]) == (4, 32)
    ours = mx.load(str(out / "model.safetensors"))
    link = out.parent / f"{out.name}.src.gguf"
    link.unlink(missing_ok=True)
    link.symlink_to(default_model_path)
    try:
        theirs = mx.load(str(link))
    finally:
        link.unlink()
    q = ours["model.layers.3.mlp.down_proj.scales"]
    assert q.dtype == mx.float32
    for gguf_name, ours_name in (("blk.3.ffn_down", "model.layers.3.mlp.down_proj"),
                                 ("token_embd", "model.embed_tokens")):
        for suffix in ("weight", "scales", "biases"):
            a, b = ours[f"{ours_name}.{suffix}"], theirs[f"{gguf_name}.{suffix}"]
            assert mx.array_equal(a, b.astype(a.dtype)).item(), (gguf_name, suffix)


@pytest.mark.parametrize("ftype", ["q4_0", "q8_0", "f16"])
def test_other_kept_types_equal_mlx_s_own_gguf_reader(ftype: str, derived_model, converted):
    """Q4_0 and an all-Q8_0 file (llama.cpp's quantizer, from the default model) are repacked bit for bit;
    F16 weights stay float (cast to float32) with the same values."""
    import mlx.core as mx

    src = derived_model(ftype)  # llama.cpp's quantizer from the default model, cached in the test cache
    out = converted(src)
    ours, theirs = mx.load(str(out / "model.safetensors")), mx.load(str(src))
    for gguf_name, name in (("blk.5.attn_v", "model.layers.5.self_attn.v_proj"), ("token_embd", "model.embed_tokens"),
                            ("blk.5.ffn_gate", "model.layers.5.mlp.gate_proj")):
        if f"{gguf_name}.scales" in theirs:
            for suffix in ("weight", "scales", "biases"):
                a, b = ours[f"{name}.{suffix}"], theirs[f"{gguf_name}.{suffix}"]
                assert mx.array_equal(a, b.astype(a.dtype)).item(), (ftype, gguf_name, suffix)
        else:
            a, b = ours[f"{name}.weight"], theirs[f"{gguf_name}.weight"]
            assert a.dtype == mx.float32 and mx.array_equal(a, b.astype(mx.float32)).item(), (ftype, gguf_name)


def test_default_model_f32_conversion_gives_llama_cpp_greedy_tokens(derived_model, converted):
    """Issue 9's weak test made strong: 40 greedy tokens of a chat answer, token for token."""
    f32 = derived_model("f32")
    out = converted(f32)
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(out)  # the template only: mlx_greedy loads the weights once
    msgs = [{"role": "user", "content": "Write a long story about a dragon who learns to cook."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
    want = llama_greedy(f32, ids, 40)
    got = mlx_greedy(out, ids, 40)
    assert len(want) == 40 and got == want


def test_gemma_dequantized_gives_llama_cpp_f32_greedy_tokens(gemma_path: Path, converted):
    """gemma3 end to end: the Q4_K_M file dequantized (policy="float") equals llama.cpp on the F32 file
    llama.cpp's quantizer makes from the same GGUF, for 32 tokens — the gemma3 mapping (norm shift,
    sliding window, local RoPE base, attention scale) and the K-quant dequantization are exact."""
    f32 = TEST_CACHE / "derived" / f"gemma3-270m-{_file_key(gemma_path)}-f32.gguf"
    if not f32.is_file():
        derive_gguf(gemma_path, f32, "f32")
    out = converted(gemma_path, policy="float")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and "quantization" in cfg  # the Q8_0 embedding stays 8-bit
    vocab = llama_cpp.Llama(str(gemma_path), vocab_only=True, verbose=False)
    ids = vocab.tokenize(b"The capital of France is", add_bos=True)
    assert mlx_greedy(out, ids, 32) == llama_greedy(f32, ids, 32)


# ------------------------------------------------------------------------------------ architectures


@pytest.fixture(scope="module")
def arch_gguf(derived_model) -> Callable[[str], Path]:
    f32 = derived_model("f32")
    return lambda arch: _rewritten(f32, arch, lambda dst: gguf_rewrite.as_architecture(f32, dst, arch))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "phi3", "llama3"])
def test_architecture_logits_match_llama_cpp(arch: str, arch_gguf, converted):
    """The default model as a ``qwen2`` (biases, NEOX RoPE), ``qwen3`` (Q/K norms), ``phi3`` (fused QKV and
    gate/up) and Llama-3.1 (``rope_freqs`` → llama3 RoPE scaling) GGUF: llama.cpp runs each with its own code
    for that architecture; the MLX conversion gives the same logits at every prompt position."""
    import mlx.core as mx
    import mlx_lm

    src = arch_gguf(arch)
    out = converted(src)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == {"llama3": "llama"}.get(arch, arch)
    if arch == "llama3":
        assert cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["rope_scaling"]["factor"] == 8.0
    llm = llama_cpp.Llama(str(src), n_ctx=256, logits_all=True, n_threads=physical_cores(), verbose=False)
    ids = llm.tokenize(b"The capital of France is Paris, and the capital of Italy is", add_bos=False)
    llm.eval(ids)
    ref = np.array(llm.scores[: len(ids)])
    llm.close()
    model, tok = mlx_lm.load(str(out))
    assert tok.encode("The capital of France is Paris, and the capital of Italy is") == ids
    got = np.array(model(mx.array(ids)[None])[0].astype(mx.float32))
    assert (ref.argmax(-1) == got.argmax(-1)).all()
    assert np.abs(ref - got).max() < 5e-4 * (ref.max() - ref.min())  # F32 rounding: ≤ 0.05 % of the range


# ------------------------------------------------------------------------------------ tokenizers


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-4o", "tekken", "default", "gpt-2", "smollm"])
def test_bpe_pre_tokenizers_match_llama_cpp(pre: str, default_model_path: Path, tmp_path: Path):
    """The default model's BPE vocabulary under each pre-tokenizer llama.cpp knows by that name."""
    import gguf

    src = gguf_rewrite.with_metadata(default_model_path, tmp_path / f"{pre}.gguf",
                                     {"tokenizer.ggml.pre": (pre, gguf.GGUFValueType.STRING)})
    g = GGUFFile(src)
    write_tokenizer(g, tmp_path, mlx_convert._config(g))
    assert_tokenizes_like_llama_cpp(src, tmp_path)


def test_sentencepiece_tokenizer_matches_llama_cpp(gemma_path: Path, tmp_path: Path):
    """Gemma's SentencePiece vocabulary (262k pieces, byte fallback, whitespace and newline runs as
    user-defined tokens, no space prefix)."""
    g = GGUFFile(gemma_path)
    write_tokenizer(g, tmp_path, mlx_convert._config(g))
    assert_tokenizes_like_llama_cpp(gemma_path, tmp_path, CORPUS + ["<start_of_turn>user\nhi<end_of_turn>"])


def test_sentencepiece_with_space_prefix_matches_llama_cpp(gemma_path: Path, tmp_path: Path):
    """Llama 2 / Mistral / Phi-3 style: a space is prefixed to each text fragment."""
    import gguf

    src = _rewritten(gemma_path, "space-prefix", lambda dst: gguf_rewrite.with_metadata(
        gemma_path, dst, {"tokenizer.ggml.add_space_prefix": (True, gguf.GGUFValueType.BOOL)}))
    g = GGUFFile(src)
    write_tokenizer(g, tmp_path, mlx_convert._config(g))
    assert_tokenizes_like_llama_cpp(src, tmp_path)
    tcfg = json.loads((tmp_path / "tokenizer.json").read_text())
    assert tcfg["decoder"]["decoders"][-1]["type"] == "Strip"  # mlx-lm's SPM detokenizer trims that space


# ------------------------------------------------------------------------------------ the default path


def test_gemma_q4_k_m_converts_requantized_and_runs_on_the_mlx_backend(gemma_path: Path, converted):
    """gemma3:270m as the catalog ships it (Q4_K_M: Q4_K/Q5_0 → 4-bit, Q6_K → 8-bit, group 64; Q8_0 kept),
    through the MLX backend. Its greedy continuation is compared with llama.cpp's on the same GGUF: the
    requantization (and llama.cpp's Q8 activations) make them drift apart after the first tokens."""
    from backends.registry import load

    info = inspect_gguf(gemma_path)
    assert info.model_type == "gemma3_text" and info.tokenizer == "llama"
    assert info.policy == {"F32": "float", "Q4_K": "requantized 4-bit", "Q5_0": "requantized 4-bit",
                           "Q6_K": "requantized 8-bit", "Q8_0": "kept 8-bit"}
    out = converted(gemma_path)
    cfg = json.loads((out / "config.json").read_text())
    q = cfg["quantization"]
    assert (q["bits"], q["group_size"]) == (4, 64)
    assert q["model.embed_tokens"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    assert {v["bits"] for k, v in q.items() if isinstance(v, dict) and k.endswith("down_proj")} == {8}
    written = sum(p.stat().st_size for p in out.glob("model*.safetensors"))
    assert abs(written - info.estimated_bytes) < 0.001 * written  # the planner's MLX figure

    with load("mlx", LoadSpec(model_path=str(out), n_ctx=512)) as b:
        assert b.info.architecture == "gemma3_text"
        s = Sampling(temperature=0.0, repeat_penalty=1.0, max_tokens=12)
        text, done, _ = collect(b.generate(GenerateRequest(prompt="The capital of France is", sampling=s)))
        assert done.finish_reason == "length" and done.stats.eval_count == 12 and "capital" in text, text

    vocab = llama_cpp.Llama(str(gemma_path), vocab_only=True, verbose=False)
    figures = []
    for prompt in ("The capital of France is", "def fibonacci(n):", "Once upon a time"):
        ids = vocab.tokenize(prompt.encode(), add_bos=True)
        n = mlx_agreement(out, ids, llama_greedy(gemma_path, ids, 32))
        figures.append(n)
        print(f"gemma3:270m Q4_K_M greedy agreement, {prompt!r}: {n}/32")
    # measured on the 2-core build machine: 6, 4 and 1 of 32 (llama.cpp's own Q4_K_M vs its F32 run: 15, 32, 4;
    # the "faithful" policy: 5, 32, 5 — benchmarks/mlx_decode.py --agreement)
    assert figures[0] >= 4 and sum(figures) >= 8, figures


# ------------------------------------------------------------------------------------ refusals


def _tiny_gguf(path: Path, *, arch: str = "llama", tok_model: str = "gpt2", pre: str = "smollm",
               tensor_type: str = "F32") -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_head_count(2)
    w.add_feed_forward_length(128)
    w.add_tokenizer_model(tok_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(["a", "b", "ab"])
    w.add_token_scores([0.0, 0.0, -1.0])
    w.add_token_types([1, 1, 1])
    w.add_token_merges(["a b"])
    data = {"F32": np.zeros((4, 64), np.float32), "F64": np.zeros((4, 64), np.float64),
            "I32": np.zeros((4, 64), np.int32)}[tensor_type]
    w.add_tensor("token_embd.weight", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(("kw", "words"), [
    ({"arch": "mamba"}, "'mamba' architecture"),
    ({"arch": "gpt2"}, "'gpt2' architecture"),
    ({"tensor_type": "F64"}, "tensor type F64"),
    ({"tensor_type": "I32"}, "tensor type I32"),
    ({"tok_model": "bert"}, "tokenizer is 'bert'"),
    ({"pre": "deepseek-llm"}, "pre-tokenizer 'deepseek-llm'"),
])
def test_unsupported_gguf_is_refused_by_name_and_nothing_is_written(tmp_path: Path, kw: dict, words: str):
    src = _tiny_gguf(tmp_path / "x.gguf", **kw)
    with pytest.raises(UnsupportedError, match=words) as e:
        inspect_gguf(src)
    assert "\n" not in str(e.value)
    with pytest.raises(UnsupportedError, match=words):
        convert_gguf(src, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.gguf"]


def test_unknown_tensor_is_refused(tmp_path: Path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "llama")
    w.add_embedding_length(64)
    w.add_head_count(2)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(["a"])
    w.add_token_merges(["a a"])
    w.add_tensor("blk.0.ssm_conv1d.weight", np.zeros((4, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedError, match="does not know the llama GGUF tensor 'blk.0.ssm_conv1d.weight'"):
        inspect_gguf(tmp_path / "x.gguf")


# 1 MB: inside the token strings; 60 MB: the header whole, the tensor data cut
@pytest.mark.parametrize("keep", [1_000_000, 60_000_000])
def test_truncated_gguf_is_refused_and_nothing_is_written(default_model_path: Path, tmp_path: Path, keep: int):
    src = tmp_path / "cut.gguf"
    with open(default_model_path, "rb") as f:
        src.write_bytes(f.read(keep))
    with pytest.raises(ModelLoadError, match="Cannot read cut.gguf as GGUF: ") as e:
        inspect_gguf(src)
    assert "\n" not in str(e.value)
    with pytest.raises(ModelLoadError, match="Cannot read cut.gguf as GGUF: "):
        convert_gguf(src, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf"]


# ------------------------------------------------------------------------------------ atomicity, progress


def test_sigkill_mid_conversion_leaves_nothing_registered_and_the_next_run_converts(home: Path,
                                                                                     default_model_path: Path):
    """A conversion killed halfway (SIGKILL: no cleanup runs) leaves no MLX directory the store or the
    planner would see; the next conversion of the same model succeeds and sweeps the leftover."""
    from types import SimpleNamespace

    from localllm.mlxmodels import convert_installed, mlx_dir_for, mlx_root

    digest = "sha256:" + default_model_path.name.removeprefix("sha256-")
    model = SimpleNamespace(name="smollm2:135m", weights_digest=digest, path=default_model_path)
    child = textwrap.dedent(f"""
        import sys, time
        from types import SimpleNamespace
        from pathlib import Path
        import backends.mlx.convert as mc
        real = mc.convert_gguf
        def slow(src, out, **kw):
            def progress(done, total):
                if done > total // 2:
                    print("half", flush=True)
                    time.sleep(120)
            return real(src, out, progress=progress, **{{k: v for k, v in kw.items() if k != "progress"}})
        mc.convert_gguf = slow
        from localllm.mlxmodels import convert_installed
        convert_installed(SimpleNamespace(name="m", weights_digest={digest!r}, path=Path({str(default_model_path)!r})))
    """)
    p = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=Path(__file__).parents[2])
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.strip() == "half", p.stderr.read() if p.stderr else ""
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    assert mlx_dir_for(model) is None
    assert [x.name for x in mlx_root().iterdir() if not x.name.startswith(".")] == []
    leftovers = [x for x in mlx_root().iterdir() if x.name.startswith(".")]
    assert leftovers and any((x / "tokenizer.json").exists() for x in leftovers)  # it was killed mid-way

    done = convert_installed(model)
    assert mlx_dir_for(model) == done and mlx_convert.is_mlx_dir(done)
    assert [x.name for x in mlx_root().iterdir()] == [done.name]  # the stale temp dir is gone


def test_progress_reports_bytes_from_zero_to_total(default_model_path: Path, tmp_path: Path):
    seen: list[tuple[int, int]] = []
    convert_gguf(default_model_path, tmp_path / "out", progress=lambda d, t: seen.append((d, t)))
    total = inspect_gguf(default_model_path).source_bytes
    assert seen[0] == (0, total) and seen[-1] == (total, total)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and len(seen) > 100
    assert {t for _, t in seen} == {total}


def test_estimate_counts_the_converted_sizes(default_model_path: Path, converted):
    out = converted(default_model_path)
    written = sum(p.stat().st_size for p in out.glob("model*.safetensors"))
    for dtype, factor in (("float32", 1.0), ("float16", None)):
        est = inspect_gguf(default_model_path, dtype=dtype).estimated_bytes
        if factor:
            assert abs(est - written) < 0.001 * written
        else:
            assert est < written  # half-size scales and norms
    # the GGUF is smaller than the f32-scale MLX build: the planner must not take the file size
    assert written > default_model_path.stat().st_size


def test_big_tensors_are_sharded(default_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import mlx_lm

    monkeypatch.setattr(mlx_convert, "SHARD_BYTES", 40 << 20)
    out = convert_gguf(default_model_path, tmp_path / "out")
    shards = sorted(p.name for p in out.glob("model*.safetensors"))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    model, _ = mlx_lm.load(str(out))
    assert len(model.layers) == 30
