"""GGUF → MLX model directory, offline (no Hugging Face, no torch).

The conversion here; the GGUF reader it builds on is :mod:`backends.mlx._gguf`, the tokenizer files
:mod:`backends.mlx._tokenizer`'s.

Any GGUF of an architecture mlx-lm has a model class for, whose tensor names map cleanly onto it,
becomes a directory that ``mlx_lm.load(dir)`` accepts as it is::

    from backends.mlx.convert import convert_gguf, inspect_gguf
    inspect_gguf("gemma-3-270m-q4_k_m.gguf").model_type                   # 'gemma3_text'
    convert_gguf("gemma-3-270m-q4_k_m.gguf", "gemma-mlx", progress=print)  # PosixPath('gemma-mlx')

Architectures (``general.architecture`` → mlx-lm ``model_type``): ``llama`` (Llama 2/3/3.1/3.2, Mistral 7B,
SmolLM — Mistral GGUFs are written as ``llama``), ``qwen2``, ``qwen3``, ``gemma3`` (→ ``gemma3_text``) and
``phi3`` (Phi-3/3.5 and Phi-4-mini). Anything else is refused by name.

Tensor types (the header read by ``backends.gguf_header``, each tensor memory-mapped in turn):

* **kept exactly** — Q4_0, Q4_1, Q8_0 are MLX affine blocks already (group 32: ``w = d·q + m``), so their
  bytes are repacked, not requantized: the MLX weights equal llama.cpp's bit for bit;
* **requantized** — every other GGML type ``gguf.quants`` can dequantize (K-quants, Q5_0/Q5_1, IQ*, TQ*,
  MXFP4): dequantized to float32 and quantized with ``mx.quantize`` (affine, group 64): **8 bits** for the
  Q6/Q8 class, **4 bits** for the rest;
* **float** — F32/F16/BF16 stay float (cast to ``dtype``);
* any other type is refused by name.

Row-wise fixes per architecture: llama's Q/K rows are un-permuted (``convert_hf_to_gguf`` permutes them
for llama.cpp's RoPE), Gemma's norm weights lose the ``+1`` llama.cpp folds in, Llama-3.1's ``rope_freqs``
tensor becomes a ``llama3`` rope-scaling block (checked against the tensor), Phi-3's long/short RoPE
factors become a ``longrope`` block. The tokenizer is rebuilt from ``tokenizer.ggml.*`` with the
``tokenizers`` library: byte-level BPE (``gpt2``: Llama 3, Qwen, SmolLM, Phi-4) with llama.cpp's
pre-tokenizer regexes, and SentencePiece (``llama``: Gemma, Llama 2, Mistral, Phi-3) with merges ranked
by the vocabulary's scores and byte fallback.

Scales, biases and float weights are stored as ``dtype``: float32 by default (lossless for GGUF's f16
scales and about 30× faster than float16 on mlx's CPU backend), float16 for Metal. The conversion is
atomic (a temporary directory beside the target, renamed at the end; leftovers of a killed run are
removed by the next one), writes safetensors shards of at most 1 GiB (memory stays near one shard)
and reports progress as ``progress(done_bytes, total_bytes)`` over the GGUF's tensor data.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from backends.contract.errors import UnsupportedError
from backends.mlx._gguf import GGUFFile, np_shape
from backends.mlx._tokenizer import check_tokenizer, write_tokenizer

if TYPE_CHECKING:
    from backends.gguf_header import TensorInfo

Progress = Callable[[int, int], None]

# ------------------------------------------------------------------------------------ quant policy

FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})
EXACT_TYPES = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}  # repacked bit for bit (group 32)
REQUANT_8 = frozenset({"Q6_K", "Q8_1", "Q8_K"})
REQUANT_4 = frozenset({"Q2_K", "Q3_K", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS",
                       "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4", "NVFP4"})
GROUP_SIZE = 64  # of requantized tensors (policy "mlx")
# "faithful": the source's own bit width, group 32 (K-quant sub-blocks and Q5_0/Q5_1 blocks are 32 wide)
_FAITHFUL_BITS = {"Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6, "Q8_1": 8, "Q8_K": 8}
POLICIES = ("mlx", "faithful", "float")
SHARD_BYTES = 1 << 30

ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text", "phi3": "phi3"}


def _requant_bits(ttype: str) -> int | None:
    if ttype in REQUANT_8:
        return 8
    if ttype in REQUANT_4:
        return 4
    return None


def _target(ttype: str, shape: tuple[int, ...], policy: str) -> tuple[int, int] | None:
    """(group size, bits) a requantized tensor gets, or None when it becomes float (or is kept exactly)."""
    bits = _requant_bits(ttype)
    if policy == "float" or bits is None or len(shape) != 2 or ttype in EXACT_TYPES:
        return None
    if policy == "faithful":
        bits = _FAITHFUL_BITS.get(ttype, bits)
        group = 32 if shape[-1] % 32 == 0 else None
    else:
        group = _group_for(shape[-1])
    return (group, bits) if group else None


def _dequantizable(ttype: str) -> bool:
    try:
        from gguf import GGMLQuantizationType
        from gguf.quants import _type_traits  # the types gguf-py can dequantize

        return GGMLQuantizationType[ttype] in _type_traits
    except (ImportError, KeyError):
        return False


# ------------------------------------------------------------------------------------ tensor names

_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_BY_ARCH: dict[str, dict[str, str]] = {
    "llama": _LAYER,
    "qwen2": _LAYER,
    "qwen3": {**_LAYER, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    "gemma3": {**_LAYER, "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm", "attn_q_norm": "self_attn.q_norm",
               "attn_k_norm": "self_attn.k_norm"},
    "phi3": {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj", "ffn_up": "mlp.gate_up_proj",
             "ffn_down": "mlp.down_proj"},
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# tensors that configure the model instead of being weights of it
_CONFIG_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def _target_name(arch: str, gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    layer = _LAYER_BY_ARCH[arch]
    if m and m.group(2) in layer:
        return f"model.layers.{m.group(1)}.{layer[m.group(2)]}.{suffix}"
    if base in _TOP:
        return f"{_TOP[base]}.{suffix}"
    raise UnsupportedError(f"The MLX converter does not know the {arch} GGUF tensor {gguf_name!r}.")


# ------------------------------------------------------------------------------------ what converts


@dataclass(frozen=True)
class ConversionInfo:
    """What :func:`convert_gguf` will do with a GGUF (from its header only)."""

    architecture: str  # general.architecture
    model_type: str  # mlx-lm's
    tokenizer: str  # "gpt2" (byte-level BPE) | "llama" (SentencePiece)
    tensor_types: dict[str, int]  # GGUF type -> tensors
    policy: dict[str, str]  # GGUF type -> "kept 4-bit" | "requantized 8-bit" | "float"
    source_bytes: int  # tensor data in the GGUF (the progress total)
    estimated_bytes: int  # the MLX weights at ``dtype``
    dtype: str
    n_tensors: int
    notes: tuple[str, ...] = field(default_factory=tuple)

    def describe(self) -> str:
        parts = [f"{t} ×{n} {self.policy[t]}" for t, n in sorted(self.tensor_types.items())]
        return f"{self.architecture} → MLX {self.model_type}: " + ", ".join(parts)


def _policy(ttype: str, policy: str = "mlx") -> str:
    if ttype in FLOAT_TYPES:
        return "float"
    if ttype in EXACT_TYPES:
        return f"kept {EXACT_TYPES[ttype]}-bit"
    bits = _requant_bits(ttype)
    if not bits or not _dequantizable(ttype):
        return ""
    if policy == "float":
        return "float"
    if policy == "faithful":
        return f"requantized {_FAITHFUL_BITS.get(ttype, bits)}-bit"
    return f"requantized {bits}-bit"


def _refuse_types(types: Counter[str]) -> None:
    bad = sorted(t for t in types if not _policy(t))
    if bad:
        raise UnsupportedError(
            f"The MLX converter cannot handle GGUF tensor type{'s' if len(bad) > 1 else ''} {', '.join(bad)}; "
            f"it takes F32/F16/BF16, Q4_0/Q4_1/Q8_0, the K-quants, Q5_0/Q5_1 and the IQ/TQ types."
        )


def _out_bytes(ttype: str, shape: tuple[int, ...], dtype_size: int, policy: str = "mlx") -> int:
    """Bytes of one tensor once converted (weights + scales + biases)."""
    n = math.prod(shape)
    if ttype in EXACT_TYPES and len(shape) == 2:
        group, bits = 32, EXACT_TYPES[ttype]
    else:
        target = _target(ttype, shape, policy)
        if target is None:
            return n * dtype_size
        group, bits = target
    return n * bits // 8 + 2 * (n // group) * dtype_size


def _group_for(cols: int) -> int | None:
    for g in (GROUP_SIZE, 32):
        if cols % g == 0:
            return g
    return None


_DTYPE_SIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def inspect_gguf(gguf_path: str | os.PathLike[str], *, dtype: str = "float32", policy: str = "mlx") -> ConversionInfo:
    """What the conversion of ``gguf_path`` would do; raises :class:`UnsupportedError` (one sentence
    naming the architecture, tensor type or tokenizer) when it cannot be converted. Reads the header only."""
    if dtype not in _DTYPE_SIZE:
        raise ValueError(f"dtype must be float32, float16 or bfloat16, not {dtype!r}")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, not {policy!r}")
    g = GGUFFile(Path(gguf_path))
    return _inspect(g, dtype, policy)


def _inspect(g: GGUFFile, dtype: str, policy: str = "mlx") -> ConversionInfo:
    arch = g.arch
    if arch not in ARCHITECTURES:
        raise UnsupportedError(
            f"The MLX converter does not handle the {arch or 'unknown'!r} architecture "
            f"(it handles {', '.join(sorted(ARCHITECTURES))}; Mistral GGUFs are 'llama')."
        )
    pooling = g.a("pooling_type")
    if isinstance(pooling, int) and pooling > 0:  # Qwen3-Embedding / -Reranker: a qwen3 decoder with a pooling head
        raise UnsupportedError(f"This {arch} GGUF is an embedding or reranking model (its own pooling head); mlx-lm "
                               "has no pooling, so it runs on llama.cpp.")
    tok = check_tokenizer(g)
    weights = [t for name, t in g.tensors.items() if name not in _CONFIG_TENSORS]
    for t in weights:
        _target_name(arch, t.name)  # raises on an unknown tensor
    types = Counter(t.type.name for t in weights)
    _refuse_types(types)
    _config(g)  # raises on unsupported hyper-parameters (RoPE scaling, soft-capping, ...)
    size = _DTYPE_SIZE[dtype]
    est = sum(_out_bytes(t.type.name, np_shape(t), size, policy) for t in weights)
    return ConversionInfo(
        architecture=arch, model_type=ARCHITECTURES[arch], tokenizer=tok, tensor_types=dict(types),
        policy={t: _policy(t, policy) for t in types}, source_bytes=sum(t.n_bytes for t in g.tensors.values()),
        estimated_bytes=est, dtype=dtype, n_tensors=len(weights),
    )


def check_convertible(gguf_path: str | os.PathLike[str]) -> ConversionInfo:
    """Raise :class:`UnsupportedError` (one sentence) if this GGUF cannot become an MLX model; else say how
    it converts (:class:`ConversionInfo`). Cheap: reads the header only."""
    return inspect_gguf(gguf_path)


# ------------------------------------------------------------------------------------ config.json


def _int(v: Any, default: int = 0) -> int:
    if isinstance(v, list):
        v = max(v) if v else default
    return int(v) if v is not None else default


def _config(g: GGUFFile) -> dict[str, Any]:
    arch = g.arch
    hidden = _int(g.a("embedding_length"))
    n_head = _int(g.a("attention.head_count"))
    if isinstance(g.a("attention.head_count"), list) or isinstance(g.a("attention.head_count_kv"), list):
        raise UnsupportedError("Per-layer head counts are not supported by the MLX converter.")
    n_kv = _int(g.a("attention.head_count_kv"), n_head)
    if not hidden or not n_head:
        raise UnsupportedError("The GGUF lacks embedding_length or head_count, which the MLX config needs.")
    head_dim = _int(g.a("attention.key_length"), hidden // n_head)
    if _int(g.a("attention.value_length"), head_dim) != head_dim:
        raise UnsupportedError("Different key and value head sizes are not supported by the MLX converter.")
    rope_dim = _int(g.a("rope.dimension_count"), head_dim)
    eps = float(g.a("attention.layer_norm_rms_epsilon", 1e-5))
    n_vocab = _int(g.a("vocab_size")) or len(g.fields["tokenizer.ggml.tokens"])
    tied = "output.weight" not in g.tensors
    cfg: dict[str, Any] = {
        "model_type": ARCHITECTURES[arch],
        "hidden_size": hidden,
        "num_hidden_layers": _int(g.a("block_count")),
        "intermediate_size": _int(g.a("feed_forward_length")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": float(f"{eps:.7g}"),
        "rope_theta": float(g.a("rope.freq_base", 10000.0)),
        "max_position_embeddings": _int(g.a("context_length"), 4096),
        "vocab_size": n_vocab,
        "tie_word_embeddings": tied,
    }
    if rope_dim != head_dim and arch != "phi3":
        raise UnsupportedError(f"Partial RoPE (rope dims {rope_dim} < head dim {head_dim}) is not supported on MLX "
                               f"for {arch}.")
    if g.get(f"{arch}.final_logit_softcapping") or g.get(f"{arch}.attn_logit_softcapping"):
        raise UnsupportedError(f"Logit soft-capping ({arch}) is not supported by the MLX converter.")
    scaling = g.a("rope.scaling.type")
    if scaling and scaling != "none":
        if scaling != "linear" or arch == "phi3":
            raise UnsupportedError(f"RoPE scaling {scaling!r} is not supported by the MLX converter for {arch}.")
        cfg["rope_scaling"] = {"type": "linear", "rope_type": "linear",
                               "factor": float(g.a("rope.scaling.factor", 1.0))}
    if arch == "llama":
        cfg["architectures"] = ["LlamaForCausalLM"]
        cfg["attention_bias"] = "blk.0.attn_q.bias" in g.tensors
        cfg["mlp_bias"] = "blk.0.ffn_up.bias" in g.tensors
        if "rope_freqs.weight" in g.tensors:
            cfg["rope_scaling"] = _llama3_rope(g, cfg)
    elif arch == "qwen2":
        cfg["architectures"] = ["Qwen2ForCausalLM"]
        if "blk.0.attn_q.bias" not in g.tensors:
            raise UnsupportedError("This qwen2 GGUF has no attention biases, which mlx-lm's qwen2 model expects.")
    elif arch == "qwen3":
        cfg["architectures"] = ["Qwen3ForCausalLM"]
    elif arch == "gemma3":
        cfg["architectures"] = ["Gemma3ForCausalLM"]
        cfg["sliding_window"] = _int(g.a("attention.sliding_window"), 0) or cfg["max_position_embeddings"]
        pattern = g.a("attention.sliding_window_pattern")
        if isinstance(pattern, list):
            raise UnsupportedError("A per-layer sliding-window pattern is not supported by the MLX converter.")
        cfg["sliding_window_pattern"] = _int(pattern, 6) if g.a("attention.sliding_window") else 1
        cfg["rope_local_base_freq"] = float(g.a("rope.freq_base_swa", 10000.0))
        # llama.cpp (gemma3.cpp): 1/sqrt(head_dim), except the 27B (62 layers): 1/sqrt(hidden/heads)
        cfg["query_pre_attn_scalar"] = hidden // n_head if cfg["num_hidden_layers"] == 62 else head_dim
    elif arch == "phi3":
        cfg["architectures"] = ["Phi3ForCausalLM"]
        if head_dim != hidden // n_head:
            raise UnsupportedError("mlx-lm's phi3 needs head size = hidden size / heads, which this GGUF breaks.")
        cfg["partial_rotary_factor"] = rope_dim / head_dim
        cfg["original_max_position_embeddings"] = _int(g.a("rope.scaling.original_context_length"),
                                                       cfg["max_position_embeddings"])
        if "rope_factors_long.weight" in g.tensors:
            long = g.array("rope_factors_long.weight").reshape(-1).tolist()
            short = (g.array("rope_factors_short.weight").reshape(-1).tolist()
                     if "rope_factors_short.weight" in g.tensors else long)
            cfg["rope_scaling"] = {"type": "longrope", "long_factor": long, "short_factor": short}
    for key, name in (("bos", "bos_token_id"), ("padding", "pad_token_id")):
        v = g.get(f"tokenizer.ggml.{key}_token_id")
        if v is not None:
            cfg[name] = int(v)
    return cfg


def _llama3_rope(g: GGUFFile, cfg: dict[str, Any]) -> dict[str, Any]:
    """Llama 3.1/3.2 write their RoPE scaling as per-frequency factors; mlx-lm wants the parameters that
    produce them. Recover them (factor = the largest factor; Meta's 8192/1/4 otherwise) and check."""
    import numpy as np

    factors = g.array("rope_freqs.weight").reshape(-1)
    dim = cfg["head_dim"]
    base = cfg["rope_theta"]
    factor = float(factors.max())
    for old, low, high in ((8192, 1.0, 4.0), (4096, 1.0, 4.0), (8192, 1.0, 2.0)):
        freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
        want = []
        for f in freqs:
            wavelen = 2 * math.pi / f
            if wavelen < old / high:
                want.append(1.0)
            elif wavelen > old / low:
                want.append(factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                want.append(1 / ((1 - smooth) / factor + smooth))
        if len(want) == len(factors) and np.allclose(np.array(want, dtype=np.float32), factors, rtol=1e-4):
            return {"rope_type": "llama3", "type": "llama3", "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": old}
    raise UnsupportedError("This GGUF's per-frequency RoPE factors (rope_freqs) do not match Llama 3's scaling, "
                           "so the MLX converter cannot express them.")


# ------------------------------------------------------------------------------------ weights


def _unpermute(w: Any, n: int, head_dim: int) -> Any:
    """Inverse of convert_hf_to_gguf's ``permute``: rows (output features) only, so it applies to raw GGUF
    block rows, packed quantized weights, scales and biases alike (numpy or mlx arrays)."""
    shape = w.shape
    rest = tuple(shape[1:])
    return w.reshape(n, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(shape)


def _repack(raw: Any, ttype: str, rows: int, cols: int) -> tuple[Any, Any, Any]:
    """Q4_0/Q4_1/Q8_0 blocks (``raw``: rows × bytes, uint8) → MLX affine (weight uint32, scales, biases) in
    float32, group 32. Exact: ``w = d·(q - 8)``, ``d·q + m`` and ``d·q`` are affine with those scales/biases."""
    import numpy as np

    nb = cols // 32
    if ttype == "Q8_0":
        b = raw.reshape(rows, nb, 34)
        d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        q = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        packed = np.ascontiguousarray(q.reshape(rows, cols)).view(np.uint32)
        return packed, d, -128.0 * d
    size = 18 if ttype == "Q4_0" else 20
    b = raw.reshape(rows, nb, size)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if ttype == "Q4_0":
        bias, qs = -8.0 * d, b[..., 2:]
    else:
        bias, qs = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32), b[..., 4:]
    # GGUF: byte j holds element j (low nibble) and j + 16 (high); MLX: byte k holds 2k (low) and 2k + 1
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # rows × nb × 32, element order
    pairs = q.reshape(rows, nb, 16, 2)
    packed_bytes = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)
    packed = np.ascontiguousarray(packed_bytes.reshape(rows, cols // 2)).view(np.uint32)
    return packed, d, bias


@dataclass
class _Converted:
    arrays: dict[str, Any]
    quant: tuple[int, int] | None  # (group_size, bits)


def _convert_tensor(g: GGUFFile, t: TensorInfo, cfg: dict[str, Any], dtype: Any, policy: str = "mlx") -> _Converted:
    import mlx.core as mx
    import numpy as np

    arch, name = g.arch, t.name
    ttype = t.type.name
    target = _target_name(arch, name)
    module, _, suffix = target.rpartition(".")
    shape = np_shape(t)
    raw = g.data(t)
    # llama: undo the RoPE row permutation of Q and K (rows of any representation: raw blocks included)
    if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias")):
        n = cfg["num_attention_heads"] if ".attn_q." in name else cfg["num_key_value_heads"]
        raw = _unpermute(np.asarray(raw), n, cfg["head_dim"])

    if ttype in EXACT_TYPES and len(shape) == 2:
        rows, cols = shape
        step = max(1, _CHUNK_ELEMENTS // cols)
        chunks = [_repack(np.asarray(raw[r:r + step]), ttype, min(step, rows - r), cols) for r in range(0, rows, step)]
        w, s, b = (np.concatenate([c[i] for c in chunks]) if len(chunks) > 1 else chunks[0][i] for i in range(3))
        return _Converted({f"{module}.weight": mx.array(w), f"{module}.scales": mx.array(s).astype(dtype),
                           f"{module}.biases": mx.array(b).astype(dtype)}, (32, EXACT_TYPES[ttype]))

    requant = _target(ttype, shape, policy)
    if requant is None:
        w = _floats(np.asarray(raw), t.type, shape)
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's (1 + weight); mlx-lm's RMSNorm adds the 1 itself
        return _Converted({target: mx.array(w).astype(dtype)}, None)
    # requantize in row chunks: the float32 copy of a big matrix (an embedding) never exists whole
    group, bits = requant
    rows, cols = shape
    step = max(1, _CHUNK_ELEMENTS // cols)
    parts: list[tuple[Any, Any, Any]] = []
    for r in range(0, rows, step):
        w = _floats(np.asarray(raw[r:r + step]), t.type, (min(step, rows - r), cols))
        wq, s, b = mx.quantize(mx.array(w), group_size=group, bits=bits)
        mx.eval(wq, s, b)
        parts.append((wq, s.astype(dtype), b.astype(dtype)))
        del w
    wq, s, b = (mx.concatenate([p[i] for p in parts]) if len(parts) > 1 else parts[0][i] for i in range(3))
    return _Converted({f"{module}.weight": wq, f"{module}.scales": s, f"{module}.biases": b}, (group, bits))


_CHUNK_ELEMENTS = 1 << 24  # 64 MiB of float32 per requantization step


def _floats(raw: Any, qtype: Any, shape: tuple[int, ...]) -> Any:
    import numpy as np
    from gguf.quants import dequantize

    if qtype.name in ("F32", "F16"):
        return np.asarray(raw, dtype=np.float32).reshape(shape)
    return np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(shape)


def _nbytes(arrays: dict[str, Any]) -> int:
    return sum(int(a.nbytes) for a in arrays.values())


# ------------------------------------------------------------------------------------ the conversion


def _clean_stale(out: Path) -> None:
    """Remove temporary directories of conversions of ``out`` whose process is gone (a SIGKILL)."""
    for p in out.parent.glob(f".{out.name}.*-*"):
        m = re.fullmatch(rf"\.{re.escape(out.name)}\.(?:tmp|old)-(\d+)", p.name)
        if not m:
            continue
        pid = int(m.group(1))
        alive = pid == os.getpid()
        if not alive:
            try:
                os.kill(pid, 0)
                alive = True
            except ProcessLookupError:
                alive = False
            except PermissionError:
                alive = True
        if not alive:
            shutil.rmtree(p, ignore_errors=True)


def _write_weights(g: GGUFFile, cfg: dict[str, Any], tmp: Path, dtype: Any, policy: str,
                   progress: Progress | None, total: int) -> dict[str, tuple[int, int]]:
    """Convert every tensor into safetensors shards of at most SHARD_BYTES; return module → (group, bits)."""
    import mlx.core as mx

    quant: dict[str, tuple[int, int]] = {}
    shard: dict[str, Any] = {}
    files: list[tuple[Path, list[str]]] = []

    def flush() -> None:
        if shard:
            path = tmp / f"shard-{len(files):05d}.safetensors"
            mx.save_safetensors(str(path), shard, metadata={"format": "mlx"})
            files.append((path, list(shard)))
            shard.clear()

    done = 0
    for name, t in g.tensors.items():
        done += int(t.n_bytes)
        if name in _CONFIG_TENSORS:
            continue
        conv = _convert_tensor(g, t, cfg, dtype, policy)
        mx.eval(*conv.arrays.values())
        if conv.quant:
            quant[next(iter(conv.arrays)).rpartition(".")[0]] = conv.quant
        if shard and _nbytes(shard) + _nbytes(conv.arrays) > SHARD_BYTES:
            flush()
        shard.update(conv.arrays)
        del conv
        if progress:
            progress(min(done, total), total)
    flush()
    n = len(files)  # shard names as mlx-lm / transformers expect them
    weight_map: dict[str, str] = {}
    for i, (path, keys) in enumerate(files):
        final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        path.rename(tmp / final)
        weight_map.update(dict.fromkeys(keys, final))
    if n > 1:
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"format": "mlx"}, "weight_map": dict(sorted(weight_map.items()))}, indent=2),
            encoding="utf-8")
    return quant


def convert_gguf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    dtype: str = "float32",
    progress: Progress | None = None,
    policy: str = "mlx",
) -> Path:
    """Convert ``gguf_path`` into an MLX model directory at ``out_dir`` (replaced atomically if present).

    ``dtype`` is the float type of norms, scales, biases and float weights: ``float32`` (default, fastest on
    CPU), ``float16`` or ``bfloat16`` (half the size, for Metal). ``progress(done, total)`` is called with
    the bytes of GGUF tensor data converted so far (0 first, ``total`` last). ``policy`` decides what the types that
    are not kept exactly become: ``"mlx"`` (default) 4-bit, or 8-bit for the Q6/Q8 class, group 64 — the
    usual MLX sizes; ``"faithful"`` the source's own bit width (Q5 → 5, Q6_K → 6) at group 32, ~20 % larger
    and closer to the GGUF; ``"float"`` dequantized to ``dtype`` (exact, several times larger). Raises
    :class:`UnsupportedError` (nothing written) for what MLX cannot run and :class:`ModelLoadError` for an
    unreadable file.
    """
    import mlx.core as mx

    try:
        mx_dtype = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[dtype]
    except KeyError:
        raise ValueError(f"dtype must be float32, float16 or bfloat16, not {dtype!r}") from None
    src, out = Path(gguf_path), Path(out_dir)
    g = GGUFFile(src)
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, not {policy!r}")
    info = _inspect(g, dtype, policy)  # refuses before anything is written
    cfg = _config(g)
    total = info.source_bytes
    if progress:
        progress(0, total)

    out.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        # the tokenizer first: its vocabulary (read from the file here, not kept) is gone before the weights come in
        cfg["eos_token_id"] = write_tokenizer(g, tmp, cfg)
        quant = _write_weights(g, cfg, tmp, mx_dtype, policy, progress, total)
        if quant:
            common = Counter(quant.values()).most_common(1)[0][0]
            block: dict[str, Any] = {"group_size": common[0], "bits": common[1], "mode": "affine"}
            for module, (gs, bits) in sorted(quant.items()):
                if (gs, bits) != common:
                    block[module] = {"group_size": gs, "bits": bits, "mode": "affine"}
            cfg["quantization"] = block
            cfg["quantization_config"] = block
        cfg["torch_dtype"] = dtype
        cfg["converted_from"] = {"gguf": src.name, "file_type": _file_type(g), "policy": policy,
                                 "tensor_types": info.policy}
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
        gen = {"eos_token_id": cfg["eos_token_id"]}
        if "bos_token_id" in cfg:
            gen["bos_token_id"] = cfg["bos_token_id"]
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2), encoding="utf-8")
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if progress:
        progress(total, total)
    return out


def _file_type(g: GGUFFile) -> str | None:
    ft = g.get("general.file_type")
    if ft is None:
        return None
    try:
        from gguf import LlamaFileType

        return LlamaFileType(int(ft)).name.removeprefix("MOSTLY_")
    except (ImportError, ValueError):
        return str(ft)


def code_digest() -> str:
    """The converter's code (this module, the GGUF reader and the tokenizer builder it uses, the header parser
    under them) as a hex digest: a cache of conversions or of what converts, keyed by it, is redone when any
    of them changes."""
    import hashlib

    from backends import gguf_header
    from backends.mlx import _gguf as mlx_gguf
    from backends.mlx import _tokenizer as mlx_tokenizer

    h = hashlib.sha256()
    for m in (sys.modules[__name__], mlx_gguf, mlx_tokenizer, gguf_header):
        h.update(Path(str(m.__file__)).read_bytes())
    return h.hexdigest()


def is_mlx_dir(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` looks like a complete MLX model directory (config, weights, tokenizer)."""
    p = Path(path)
    return (
        p.is_dir()
        and (p / "config.json").is_file()
        and any(p.glob("model*.safetensors"))
        and ((p / "tokenizer.json").is_file() or (p / "tokenizer.model").is_file())
    )
