"""A made Qwen3.5 (``qwen35``: gated-delta-net linear attention + gated full attention, 3:1) with random weights,
optionally with a multi-token-prediction (MTP, ``nextn``) block after its trunk, as the ``*-MTP-GGUF`` builds carry
(``qwen35.nextn_predict_layers`` = 1, ``block_count`` = trunk + 1). Written with the ``gguf`` package in about a
second; the tokenizer (and, unless given, the chat template) are the default model's. The recipe follows
``/work/shared/reference/models-2026.md`` and llama.cpp's ``src/models/qwen35.cpp`` (the MTP block is a full
attention decoder block plus ``nextn.eh_proj`` / ``enorm`` / ``hnorm``). Answers are noise: compare a model with
itself, never with expected text.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

D, H, HKV, HD, FF = 64, 2, 1, 32, 128  # hidden, heads, kv heads, head dim, feed-forward
S, G, V, K = 16, 1, 2, 4  # ssm state size, k heads (groups), v heads (time-step rank), conv kernel


def write_qwen35(src: Path, dst: Path, *, layers: int = 4, mtp: int = 0, template: str | None = None,
                 seed: int = 0, f32: bool = False, echo: bool = False) -> Path:
    """``dst``: a ``layers``-block qwen35 (every 4th block full attention) plus ``mtp`` MTP blocks, with the
    tokenizer of ``src`` (a GGUF) and ``template`` (default: ``src``'s).

    ``f32``: matrices in F32 (exact comparisons: greedy output with drafts equals it without). ``echo``: an MTP
    block that proposes the token it reads (its projection keeps the token's embedding, its attention and
    feed-forward add nothing); the output being tied to the embedding, the trunk tends to repeat what it read
    too, so MTP drafts are accepted part of the time, as a trained head's are (random weights: near never)."""
    import gguf

    rng = np.random.default_rng(seed)
    reader = gguf.GGUFReader(src, "r")
    vocab = len(reader.get_field("tokenizer.ggml.tokens").contents())
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(tmp, arch="qwen35")
    a = "qwen35."
    n_all = layers + mtp
    for key, val in (("context_length", 4096), ("embedding_length", D), ("block_count", n_all),
                     ("feed_forward_length", FF), ("attention.head_count", H), ("attention.head_count_kv", HKV),
                     ("attention.key_length", HD), ("attention.value_length", HD), ("rope.dimension_count", HD),
                     ("ssm.conv_kernel", K), ("ssm.state_size", S), ("ssm.group_count", G),
                     ("ssm.time_step_rank", V), ("ssm.inner_size", S * V), ("full_attention_interval", 4)):
        w.add_uint32(a + key, val)
    w.add_float32(a + "attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(a + "rope.freq_base", 10000.0)
    w.add_array(a + "rope.dimension_sections", [6, 5, 5, 0])
    if mtp:
        w.add_uint32(a + "nextn_predict_layers", mtp)
    w.add_name("made-qwen35" + ("-mtp" if mtp else ""))
    for f in reader.fields.values():
        if not f.name.startswith("tokenizer.") or (template is not None and f.name == "tokenizer.chat_template"):
            continue
        vtype = f.types[0]
        w.add_key_value(f.name, f.contents(), vtype,
                        sub_type=f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    if template is not None:
        w.add_chat_template(template)

    def mat(rows: int, cols: int) -> np.ndarray:  # numpy (rows, cols) = ggml {cols, rows}
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32 if f32 else np.float16)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    t: dict[str, np.ndarray] = {"token_embd.weight": mat(vocab, D), "output_norm.weight": ones(D)}
    if echo:  # embeddings of unit scale per dimension: the residual stream keeps the token, which the tied output reads
        t["token_embd.weight"] = rng.standard_normal((vocab, D)).astype(np.float32 if f32 else np.float16)

    def attention(i: int) -> None:
        t[f"blk.{i}.attn_q.weight"] = mat(2 * HD * H, D)  # query + output gate
        t[f"blk.{i}.attn_k.weight"] = mat(HD * HKV, D)
        t[f"blk.{i}.attn_v.weight"] = mat(HD * HKV, D)
        t[f"blk.{i}.attn_output.weight"] = mat(D, HD * H)
        t[f"blk.{i}.attn_q_norm.weight"] = ones(HD)
        t[f"blk.{i}.attn_k_norm.weight"] = ones(HD)

    def block_common(i: int) -> None:
        t[f"blk.{i}.attn_norm.weight"] = ones(D)
        t[f"blk.{i}.post_attention_norm.weight"] = ones(D)
        t[f"blk.{i}.ffn_gate.weight"] = mat(FF, D)
        t[f"blk.{i}.ffn_up.weight"] = mat(FF, D)
        t[f"blk.{i}.ffn_down.weight"] = mat(D, FF)

    conv = 2 * S * G + S * V
    for i in range(layers):
        block_common(i)
        if (i + 1) % 4 == 0:
            attention(i)
        else:
            t[f"blk.{i}.attn_qkv.weight"] = mat(conv, D)
            t[f"blk.{i}.attn_gate.weight"] = mat(S * V, D)
            t[f"blk.{i}.ssm_conv1d.weight"] = (rng.standard_normal((conv, K)) / 2).astype(np.float32)
            t[f"blk.{i}.ssm_dt.bias"] = np.zeros(V, dtype=np.float32)
            t[f"blk.{i}.ssm_a"] = -np.exp(rng.standard_normal(V)).astype(np.float32)
            t[f"blk.{i}.ssm_beta.weight"] = mat(V, D)
            t[f"blk.{i}.ssm_alpha.weight"] = mat(V, D)
            t[f"blk.{i}.ssm_norm.weight"] = ones(S)
            t[f"blk.{i}.ssm_out.weight"] = mat(D, S * V)
    for i in range(layers, n_all):  # the MTP block: a full-attention decoder block + the nextn projections
        block_common(i)
        attention(i)
        t[f"blk.{i}.nextn.eh_proj.weight"] = mat(D, 2 * D)
        if echo:  # [embedding | hidden] -> embedding; the block's own attention and FFN add zero to it
            t[f"blk.{i}.nextn.eh_proj.weight"] = np.hstack([np.eye(D), np.zeros((D, D))]).astype(np.float32)
            t[f"blk.{i}.attn_output.weight"] = np.zeros((D, HD * H), dtype=np.float32)
            t[f"blk.{i}.ffn_down.weight"] = np.zeros((D, FF), dtype=np.float32)
        t[f"blk.{i}.nextn.enorm.weight"] = ones(D)
        t[f"blk.{i}.nextn.hnorm.weight"] = ones(D)
        t[f"blk.{i}.nextn.shared_head_norm.weight"] = ones(D)
    for name, arr in t.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, dst)
    return dst
