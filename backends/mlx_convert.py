"""GGUF → MLX model directory, offline (no Hugging Face, no torch).

``mlx.core.load`` reads GGUF and keeps Q4_0/Q4_1/Q8_0 tensors quantized (affine, group size 32), which
is exactly what mlx-lm's ``QuantizedLinear``/``QuantizedEmbedding`` use. This module renames the tensors
to mlx-lm's ``llama`` layout, undoes the row permutation ``convert_hf_to_gguf.py`` applies to the Q/K
projections for RoPE, writes ``config.json`` (with a per-module quantization block when bit widths are
mixed), and rebuilds the byte-level BPE tokenizer from the GGUF metadata with the ``tokenizers`` library.
The result loads with ``mlx_lm.load(dir)`` and nothing else::

    >>> from backends.mlx_convert import convert_gguf
    >>> convert_gguf("smollm2.gguf", "smollm2-mlx")        # doctest: +SKIP
    PosixPath('smollm2-mlx')

Scales and biases are stored as float32 by default: lossless (GGUF scales are f16) and about 30× faster
than float16 on mlx's CPU backend. Limits (each refused with :class:`UnsupportedError`): architecture
``llama`` only, byte-level BPE (``gpt2``) vocabularies with a known pre-tokenizer, no ``rope_freqs``
(llama-3.1 RoPE scaling), and tensor types mlx can read (F32/F16/BF16/Q4_0/Q4_1/Q8_0 kept, Q2_K/Q4_K/Q6_K
dequantized to float).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

from backends.base import ModelLoadError, UnsupportedError

# tensor types mx.load can read: kept quantized / turned into float
_KEPT_QUANTIZED = {"Q4_0", "Q4_1", "Q8_0"}
_READABLE = _KEPT_QUANTIZED | {"F32", "F16", "BF16", "Q2_K", "Q4_K", "Q6_K"}

_LAYER_NAMES = {
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
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# Control tokens that end a turn besides the declared EOS (llama.cpp's "end of generation" set, FIM excluded).
_EOG_TEXTS = {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "</s>"}

# llama.cpp's tokenizer.ggml.pre → the pre-tokenizer that splits text the same way.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SUPPORTED_PRE = ("smollm", "gpt2", "default", "llama-bpe", "llama3")


def _pre_tokenizer(pre: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    if pre in ("gpt2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("llama-bpe", "llama3"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise UnsupportedError(
        f"The GGUF's pre-tokenizer {pre!r} is not supported by the MLX converter "
        f"(supported: {', '.join(SUPPORTED_PRE)})."
    )


def _scalar(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    v = meta.get(key, default)
    if v is None:
        return None
    if hasattr(v, "item"):
        return v.item()
    return v


def check_convertible(gguf_path: str | os.PathLike[str]) -> None:
    """Raise :class:`UnsupportedError` (one sentence) if this GGUF cannot become an MLX model.

    Cheap: reads the header only (``gguf.GGUFReader`` memory-maps the file).
    """
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(gguf_path))
    except Exception as e:  # noqa: BLE001 - any parse failure is a bad file
        raise ModelLoadError(f"Cannot read {gguf_path} as GGUF: {e}") from e

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        if f is None:
            return None
        v = f.contents()
        return v

    arch = field("general.architecture")
    if arch != "llama":
        raise UnsupportedError(f"The MLX converter handles the llama architecture only, and this GGUF is {arch!r}.")
    if field("tokenizer.ggml.model") != "gpt2":
        raise UnsupportedError(
            "The MLX converter handles byte-level BPE vocabularies only, and this GGUF uses "
            f"{field('tokenizer.ggml.model')!r}."
        )
    pre = field("tokenizer.ggml.pre") or "default"
    if pre not in SUPPORTED_PRE:
        _pre_tokenizer(pre)  # raises with the list
    types = Counter(t.tensor_type.name for t in reader.tensors)
    bad = sorted(set(types) - _READABLE)
    if bad:
        raise UnsupportedError(
            f"MLX cannot read GGUF tensor types {', '.join(bad)}; convert a Q4_0, Q4_1, Q8_0 or F16 file instead."
        )
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise UnsupportedError("This GGUF uses per-frequency RoPE scaling (rope_freqs), which the MLX converter lacks.")


def _unpermute(w: Any, n: int, head_dim: int) -> Any:
    """Inverse of convert_hf_to_gguf's ``permute``: rows (output features) only, so it applies to packed
    quantized weights, scales and biases alike."""
    shape = w.shape
    rest = tuple(shape[1:])
    return w.reshape(n, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(shape)


def _config(meta: dict[str, Any], weights: dict[str, Any]) -> dict[str, Any]:
    p = "llama."
    hidden = int(_scalar(meta, p + "embedding_length"))
    n_head = int(_scalar(meta, p + "attention.head_count"))
    n_kv = int(_scalar(meta, p + "attention.head_count_kv", n_head))
    head_dim = int(_scalar(meta, p + "attention.key_length", hidden // n_head))
    rope_dim = _scalar(meta, p + "rope.dimension_count", head_dim)
    if int(rope_dim) != head_dim:
        raise UnsupportedError(f"Partial RoPE (rope dims {rope_dim} < head dim {head_dim}) is not supported on MLX.")
    eps = float(_scalar(meta, p + "attention.layer_norm_rms_epsilon", 1e-5))
    cfg: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(_scalar(meta, p + "block_count")),
        "intermediate_size": int(_scalar(meta, p + "feed_forward_length")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": float(f"{eps:.7g}"),
        "rope_theta": float(_scalar(meta, p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_scalar(meta, p + "context_length", 4096)),
        "vocab_size": int(_scalar(meta, p + "vocab_size", 0) or len(meta["tokenizer.ggml.tokens"])),
        "tie_word_embeddings": "output.weight" not in weights,
        "attention_bias": "blk.0.attn_q.bias" in weights,
        "mlp_bias": "blk.0.ffn_up.bias" in weights,
    }
    scaling = _scalar(meta, p + "rope.scaling.type")
    if scaling and scaling != "none":
        if scaling != "linear":
            raise UnsupportedError(f"RoPE scaling {scaling!r} is not supported by the MLX converter (linear only).")
        cfg["rope_scaling"] = {"type": "linear", "factor": float(_scalar(meta, p + "rope.scaling.factor", 1.0))}
    for key, name in (("bos", "bos_token_id"), ("padding", "pad_token_id")):
        v = _scalar(meta, f"tokenizer.ggml.{key}_token_id")
        if v is not None:
            cfg[name] = int(v)
    cfg["eos_token_id"] = _eos_ids(meta)
    return cfg


def _eos_ids(meta: dict[str, Any]) -> list[int]:
    tokens = meta["tokenizer.ggml.tokens"]
    types = _token_types(meta)
    ids: list[int] = []
    for key in ("eos", "eot", "eom"):
        v = _scalar(meta, f"tokenizer.ggml.{key}_token_id")
        if v is not None and int(v) not in ids:
            ids.append(int(v))
    for i, (tok, typ) in enumerate(zip(tokens, types, strict=False)):
        if typ == 3 and tok in _EOG_TEXTS and i not in ids:
            ids.append(i)
    return ids


def _token_types(meta: dict[str, Any]) -> list[int]:
    t = meta.get("tokenizer.ggml.token_type")
    if t is None:
        return [1] * len(meta["tokenizer.ggml.tokens"])
    return [int(x) for x in (t.tolist() if hasattr(t, "tolist") else t)]


def _weights(raw: dict[str, Any], cfg: dict[str, Any], dtype: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Rename, un-permute, cast; return (weights, quantization block or None)."""
    import mlx.core as mx

    n_head, n_kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    out: dict[str, Any] = {}
    for name, w in raw.items():
        base, _, suffix = name.rpartition(".")
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
        if m and m.group(2) in _LAYER_NAMES:
            new = f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
            if m.group(2) == "attn_q":
                w = _unpermute(w, n_head, hd)
            elif m.group(2) == "attn_k":
                w = _unpermute(w, n_kv, hd)
        elif base in _TOP_NAMES:
            new = _TOP_NAMES[base]
        else:
            raise UnsupportedError(f"The MLX converter does not know the GGUF tensor {name!r}.")
        if mx.issubdtype(w.dtype, mx.floating):
            w = w.astype(dtype)
        out[f"{new}.{suffix}"] = w
    # quantization: bits from packed width vs groups (group size 32 for every GGUF block type mx keeps)
    bits: dict[str, int] = {}
    for key, w in out.items():
        if key.endswith(".scales"):
            module = key[: -len(".scales")]
            packed = out[module + ".weight"].shape[-1]
            groups = w.shape[-1]
            bits[module] = packed * 32 // (groups * 32)
    if not bits:
        return out, None
    common = Counter(bits.values()).most_common(1)[0][0]
    quant: dict[str, Any] = {"group_size": 32, "bits": common, "mode": "affine"}
    for module, b in sorted(bits.items()):
        if b != common:
            quant[module] = {"group_size": 32, "bits": b, "mode": "affine"}
    return out, quant


def _tokenizer(meta: dict[str, Any], out: Path, cfg: dict[str, Any]) -> None:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja (no transformers import)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = _token_types(meta)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {t: i for i, t in enumerate(tokens)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tk.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre") or "default"))
    tk.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types, strict=False) if ty == 3]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types, strict=False) if ty == 4]
    tk.add_special_tokens(special)
    if user:
        tk.add_tokens(user)

    def tok(key: str) -> str | None:
        v = _scalar(meta, f"tokenizer.ggml.{key}_token_id")
        return tokens[int(v)] if v is not None and 0 <= int(v) < len(tokens) else None

    bos, eos, unk, pad = tok("bos"), tok("eos"), tok("unknown"), tok("padding")
    add_bos = bool(_scalar(meta, "tokenizer.ggml.add_bos_token", False))
    if add_bos and bos is not None:
        bos_id = vocab[bos]
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    else:
        tk.post_processor = processors.ByteLevel(trim_offsets=False)
    tk.save(str(out / "tokenizer.json"))
    template = meta.get("tokenizer.chat_template")
    tcfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg["max_position_embeddings"],
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "pad_token": pad,
    }
    if template:
        tcfg["chat_template"] = template
        (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2, ensure_ascii=False), encoding="utf-8")
    named = (("bos_token", bos), ("eos_token", eos), ("unk_token", unk), ("pad_token", pad))
    special_map = {k: v for k, v in named if v}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2), encoding="utf-8")


def _load_gguf(src: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``mx.load`` picks the format from the file name, so a blob without ``.gguf`` goes through a link."""
    import tempfile

    import mlx.core as mx

    try:
        if src.suffix.lower() == ".gguf":
            return mx.load(str(src), return_metadata=True)
        with tempfile.TemporaryDirectory(prefix="localllm-gguf-") as d:
            link = Path(d) / "model.gguf"
            link.symlink_to(src.resolve())
            return mx.load(str(link), return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise ModelLoadError(f"MLX could not read {src.name}: {e}") from e


def convert_gguf(
    gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, dtype: str = "float32"
) -> Path:
    """Convert ``gguf_path`` into an MLX model directory at ``out_dir`` (replaced atomically if present).

    ``dtype`` is the float type of norms, scales and biases: ``float32`` (default, fastest on CPU),
    ``float16`` or ``bfloat16`` (smaller, for Metal). Raises :class:`UnsupportedError` for what MLX
    cannot run and :class:`ModelLoadError` for an unreadable file.
    """
    import mlx.core as mx

    src, out = Path(gguf_path), Path(out_dir)
    check_convertible(src)
    try:
        mx_dtype = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[dtype]
    except KeyError:
        raise ValueError(f"dtype must be float32, float16 or bfloat16, not {dtype!r}") from None
    raw, meta = _load_gguf(src)
    cfg = _config(meta, raw)
    weights, quant = _weights(raw, cfg, mx_dtype)
    if quant:
        cfg["quantization"] = quant
        cfg["quantization_config"] = quant
    cfg["torch_dtype"] = dtype

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
        gen = {"eos_token_id": cfg["eos_token_id"]}
        if "bos_token_id" in cfg:
            gen["bos_token_id"] = cfg["bos_token_id"]
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2), encoding="utf-8")
        _tokenizer(meta, tmp, cfg)
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
    return out


def is_mlx_dir(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` looks like a complete MLX model directory (config, weights, tokenizer)."""
    p = Path(path)
    return (
        p.is_dir()
        and (p / "config.json").is_file()
        and any(p.glob("model*.safetensors"))
        and ((p / "tokenizer.json").is_file() or (p / "tokenizer.model").is_file())
    )
