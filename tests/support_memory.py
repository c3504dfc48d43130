"""Made models for the memory tests: architectures no real small model on PyPI has, with random weights.

* :func:`make_hybrid`: a 4-layer ``qwen35`` (Qwen3.5's gated-delta-net linear attention on layers 0-2, gated full
  attention on layer 3), ~42 MB (F32 but the embedding rows), with the default model's tokenizer and chat template
  copied over, so chat requests render as they do for SmolLM2. ``llama_model_is_hybrid`` is true for it: its
  memory is a recurrent state per sequence plus an attention KV cache.

Answers are noise: tests compare a reused, restored or batched path with the same model evaluated cold (same
greedy tokens, same F32 logits), never with expected text. The recipe is shared/reference/models-2026.md's
(keys and shapes from llama.cpp's ``src/models/qwen35.cpp`` and ``llama-model.cpp``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# llama.cpp logs each buffer it allocates with two decimals of MiB ("KV buffer size =     1.11 MiB"), which is all
# ``ModelInfo.allocations`` reads: a buffer's size from the log is off by up to half a hundredth of a MiB (and the
# byte ``int`` drops). A planner figure exact to the byte matches to this, per buffer line: ``LOG_STEP * lines``.
LOG_STEP = (1 << 20) // 200 + 2

HYBRID_DIMS = {"D": 128, "FF": 256, "H": 4, "Hkv": 2, "hd": 32, "S": 32, "G": 2, "V": 4, "K": 4, "layers": 4}


def _copy_tokenizer(w: Any, src: Path) -> None:
    """Every ``tokenizer.*`` key of the GGUF ``src``, with its exact types (the chat template included)."""
    import gguf

    reader = gguf.GGUFReader(src, "r")
    for f in reader.fields.values():
        if not f.name.startswith("tokenizer."):
            continue
        vt = f.types[0]
        w.add_key_value(f.name, f.contents(), vt, sub_type=f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)


def _n_vocab(src: Path) -> int:
    import gguf

    reader = gguf.GGUFReader(src, "r")
    return len(reader.get_field("tokenizer.ggml.tokens").contents())


def make_hybrid(tokenizer_src: Path, dst: Path, *, seed: int = 0, f32: bool = True, tied: bool = False) -> Path:
    """Write (once, atomically) the made ``qwen35`` hybrid at ``dst`` with the tokenizer of ``tokenizer_src``.

    ``f32``: 2-D weights in F32 (exact comparisons of logits; the file is ~2x the F16 size). ``tied``: no output
    matrix (the embedding's): the model then tends to repeat what it read, so prompt-lookup drafts are accepted
    part of the time (a test of drafting needs both accepted and rejected tokens)."""
    if dst.is_file():
        return dst
    import gguf
    import numpy as np

    d = HYBRID_DIMS
    D, FF, H, Hkv, hd, S, G, V, K, L = (d[k] for k in ("D", "FF", "H", "Hkv", "hd", "S", "G", "V", "K", "layers"))
    n_vocab = _n_vocab(tokenizer_src)
    rng = np.random.default_rng(seed)
    wtype = np.float32 if f32 else np.float16

    def mat(n_in: int, n_out: int) -> Any:  # ggml [n_in, n_out] = numpy (n_out, n_in)
        return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(wtype)

    def ones(n: int) -> Any:
        return np.ones(n, dtype=np.float32)

    arch = "qwen35"
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), arch=arch)
    w.add_name("localllm-test-hybrid")
    u32 = {"context_length": 4096, "embedding_length": D, "block_count": L, "feed_forward_length": FF,
           "attention.head_count": H, "attention.head_count_kv": Hkv, "attention.key_length": hd,
           "attention.value_length": hd, "rope.dimension_count": hd, "ssm.conv_kernel": K, "ssm.state_size": S,
           "ssm.group_count": G, "ssm.time_step_rank": V, "ssm.inner_size": S * V, "full_attention_interval": 4}
    for k, v in u32.items():
        w.add_uint32(f"{arch}.{k}", v)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    w.add_array(f"{arch}.rope.dimension_sections", [hd // 4 - 2, hd // 8 + 1, hd // 8 + 1, 0])
    _copy_tokenizer(w, tokenizer_src)
    t: dict[str, Any] = {"token_embd.weight": rng.standard_normal((n_vocab, D)).astype(np.float16),  # (exact rows)
                         "output_norm.weight": ones(D)}
    if not tied:
        t["output.weight"] = mat(D, n_vocab)
    conv = 2 * S * G + S * V
    for i in range(L):
        b = f"blk.{i}."
        t[b + "attn_norm.weight"] = ones(D)
        t[b + "post_attention_norm.weight"] = ones(D)
        t[b + "ffn_gate.weight"] = mat(D, FF)
        t[b + "ffn_up.weight"] = mat(D, FF)
        t[b + "ffn_down.weight"] = mat(FF, D)
        if (i + 1) % 4 == 0:  # full attention
            t[b + "attn_q.weight"] = mat(D, 2 * hd * H)
            t[b + "attn_k.weight"] = mat(D, hd * Hkv)
            t[b + "attn_v.weight"] = mat(D, hd * Hkv)
            t[b + "attn_output.weight"] = mat(hd * H, D)
            t[b + "attn_q_norm.weight"] = ones(hd)
            t[b + "attn_k_norm.weight"] = ones(hd)
        else:  # gated delta net
            t[b + "attn_qkv.weight"] = mat(D, conv)
            t[b + "attn_gate.weight"] = mat(D, S * V)
            t[b + "ssm_conv1d.weight"] = (rng.standard_normal((conv, K)) / np.sqrt(K)).astype(np.float32)
            t[b + "ssm_dt.bias"] = np.zeros(V, dtype=np.float32)
            t[b + "ssm_a"] = -np.exp(rng.uniform(-1, 1, V)).astype(np.float32)
            t[b + "ssm_beta.weight"] = mat(D, V)
            t[b + "ssm_alpha.weight"] = mat(D, V)
            t[b + "ssm_norm.weight"] = ones(S)
            t[b + "ssm_out.weight"] = mat(S * V, D)
    for k, v in t.items():
        w.add_tensor(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(dst)
    return dst


SWA_DIMS = {"D": 128, "FF": 256, "H": 4, "Hkv": 2, "hd": 32, "layers": 4, "window": 32}


def make_swa(tokenizer_src: Path, dst: Path, *, seed: int = 0, tied: bool = False) -> Path:
    """Write (once, atomically) a made ``gemma3`` at ``dst``: 4 layers, the first three with a sliding window of
    32 tokens and the last global (``sliding_window_pattern`` 4), random F32 weights (F16 embedding rows), the
    tokenizer and chat template of ``tokenizer_src``: windows slide inside short tests."""
    if dst.is_file():
        return dst
    import gguf
    import numpy as np

    d = SWA_DIMS
    D, FF, H, Hkv, hd, L = (d[k] for k in ("D", "FF", "H", "Hkv", "hd", "layers"))
    n_vocab = _n_vocab(tokenizer_src)
    rng = np.random.default_rng(seed)

    def mat(n_in: int, n_out: int) -> Any:
        return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)

    def ones(n: int) -> Any:
        return np.ones(n, dtype=np.float32)

    arch = "gemma3"
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), arch=arch)
    w.add_name("localllm-test-swa")
    u32 = {"context_length": 4096, "embedding_length": D, "block_count": L, "feed_forward_length": FF,
           "attention.head_count": H, "attention.head_count_kv": Hkv, "attention.key_length": hd,
           "attention.value_length": hd, "attention.sliding_window": d["window"],
           "attention.sliding_window_pattern": L}
    for k, v in u32.items():
        w.add_uint32(f"{arch}.{k}", v)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    _copy_tokenizer(w, tokenizer_src)
    t: dict[str, Any] = {"token_embd.weight": (rng.standard_normal((n_vocab, D)) / np.sqrt(D)).astype(np.float16),
                         "output_norm.weight": ones(D)}
    if not tied:
        t["output.weight"] = mat(D, n_vocab)
    for i in range(L):
        b = f"blk.{i}."
        for n in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            t[b + n + ".weight"] = ones(D)
        t[b + "attn_q.weight"] = mat(D, hd * H)
        t[b + "attn_k.weight"] = mat(D, hd * Hkv)
        t[b + "attn_v.weight"] = mat(D, hd * Hkv)
        t[b + "attn_output.weight"] = mat(hd * H, D)
        t[b + "attn_q_norm.weight"] = ones(hd)
        t[b + "attn_k_norm.weight"] = ones(hd)
        t[b + "ffn_gate.weight"] = mat(D, FF)
        t[b + "ffn_up.weight"] = mat(D, FF)
        t[b + "ffn_down.weight"] = mat(FF, D)
    for k, v in t.items():
        w.add_tensor(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(dst)
    return dst


MOE_DIMS = {"D": 128, "FF": 128, "H": 4, "Hkv": 2, "hd": 32, "layers": 4, "window": 32, "experts": 4, "used": 2}


def make_moe(tokenizer_src: Path, dst: Path, *, seed: int = 0, dims: dict[str, int] | None = None) -> Path:
    """Write (once, atomically) a made ``gpt-oss`` at ``dst``: 4 layers of 4 experts (2 used per token), attention
    sinks, a 32-token sliding window on layers 0 and 2 (llama.cpp's pattern for it: every other layer), random F32
    weights (F16 embedding rows), the tokenizer and chat template of ``tokenizer_src`` (keys and shapes from
    llama.cpp's ``src/models/openai-moe.cpp``). ``dims``: sizes over :data:`MOE_DIMS`'s (larger experts for the
    placement tests)."""
    if dst.is_file():
        return dst
    import gguf
    import numpy as np

    d = {**MOE_DIMS, **(dims or {})}
    D, FF, H, Hkv, hd, L, E = (d[k] for k in ("D", "FF", "H", "Hkv", "hd", "layers", "experts"))
    n_vocab = _n_vocab(tokenizer_src)
    rng = np.random.default_rng(seed)

    def mat(n_in: int, n_out: int, *lead: int) -> Any:  # ggml [n_in, n_out, *] = numpy (*, n_out, n_in)
        return (rng.standard_normal((*lead, n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)

    def vec(*shape: int, scale: float = 0.1) -> Any:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    arch = "gpt-oss"
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), arch=arch)
    w.add_name("localllm-test-moe")
    u32 = {"context_length": 4096, "embedding_length": D, "block_count": L, "feed_forward_length": FF,
           "expert_feed_forward_length": FF, "expert_count": E, "expert_used_count": d["used"],
           "attention.head_count": H, "attention.head_count_kv": Hkv, "attention.key_length": hd,
           "attention.value_length": hd, "rope.dimension_count": hd, "attention.sliding_window": d["window"]}
    for k, v in u32.items():
        w.add_uint32(f"{arch}.{k}", v)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    _copy_tokenizer(w, tokenizer_src)
    t: dict[str, Any] = {"token_embd.weight": (rng.standard_normal((n_vocab, D)) / np.sqrt(D)).astype(np.float16),
                         "output_norm.weight": np.ones(D, dtype=np.float32), "output.weight": mat(D, n_vocab)}
    for i in range(L):
        b = f"blk.{i}."
        t[b + "attn_norm.weight"] = np.ones(D, dtype=np.float32)
        t[b + "post_attention_norm.weight"] = np.ones(D, dtype=np.float32)
        t[b + "attn_q.weight"] = mat(D, hd * H)
        t[b + "attn_k.weight"] = mat(D, hd * Hkv)
        t[b + "attn_v.weight"] = mat(D, hd * Hkv)
        t[b + "attn_output.weight"] = mat(hd * H, D)
        t[b + "attn_output.bias"] = vec(D)
        t[b + "attn_sinks.weight"] = vec(H, scale=1.0)
        t[b + "ffn_gate_inp.weight"] = mat(D, E)
        t[b + "ffn_gate_inp.bias"] = vec(E)
        t[b + "ffn_gate_exps.weight"] = mat(D, FF, E)
        t[b + "ffn_up_exps.weight"] = mat(D, FF, E)
        t[b + "ffn_down_exps.weight"] = mat(FF, D, E)
        t[b + "ffn_gate_exps.bias"] = vec(E, FF)
        t[b + "ffn_up_exps.bias"] = vec(E, FF)
        t[b + "ffn_down_exps.bias"] = vec(E, D)
    for k, v in t.items():
        w.add_tensor(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(dst)
    return dst
