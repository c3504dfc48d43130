"""Rewrite a real GGUF into another architecture's layout, for converter tests without more downloads.

The default model (SmolLM2-135M, ``llama``) dequantized to F32 is re-expressed as a ``qwen2``, ``qwen3`` or
``phi3`` GGUF (and a Llama-3.1-style ``llama`` with a ``rope_freqs`` tensor), truncated to a few layers.
llama.cpp runs each rewrite with its own code for that architecture, so comparing its logits with the
MLX conversion's checks the converter's name mapping, config and row fixes per architecture against
llama.cpp — the reference a GGUF is defined by. ``with_metadata`` changes only key/values (a tokenizer's
pre-type, ``add_space_prefix``) and copies the tensors byte for byte.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


@functools.lru_cache(maxsize=2)
def _read(src: str, mtime_ns: int) -> Any:
    import gguf

    return gguf.GGUFReader(src)


def _reader(src: Path) -> Any:
    """``gguf.GGUFReader`` of ``src``, parsed once for all the rewrites of one file (seconds: the vocabulary)."""
    return _read(str(src), os.stat(src).st_mtime_ns)


def _fields(reader: Any, arch_from: str, arch_to: str, drop: set[str]) -> list[tuple[str, Any, Any, Any]]:
    import gguf

    out = []
    for f in reader.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF.") or f.name in drop:
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        name = f.name
        if name.startswith(arch_from + "."):
            name = arch_to + name[len(arch_from):]
        out.append((name, f.contents(), vtype, sub))
    return out


def with_metadata(src: Path, dst: Path, changes: dict[str, tuple[Any, Any]]) -> Path:
    """A copy of ``src`` with key/values changed or added (``{key: (value, GGUFValueType)}``; scalars and
    strings). Byte-level: the other key/values, the tensor table and the tensor data are copied as they are
    (walked with :mod:`backends.gguf_header`, not parsed into arrays), so a 262k-vocabulary file takes a
    copy's time, not the seconds ``gguf.GGUFReader`` spends on its tokenizer. Atomic."""
    import mmap
    import shutil
    import struct

    from gguf import GGUFValueType as T

    from backends.gguf_header import _CODE, _Reader, read_header

    def string(text: str) -> bytes:
        raw = text.encode()
        return struct.pack("<Q", len(raw)) + raw

    def encode(key: str, value: Any, vtype: T) -> bytes:
        body = string(value) if vtype == T.STRING else struct.pack("<" + _CODE[vtype], value)
        return string(key) + struct.pack("<I", int(vtype)) + body

    header = read_header(src)
    assert header.byteorder == "<", "little-endian GGUFs only"
    align = header.fields.get("general.alignment", 32)
    with open(src, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        r = _Reader(str(src), buf, "<", 8)
        n_tensors, n_kv = r.u64(), r.u64()
        kept = []
        for _ in range(n_kv):
            begin = r.pos
            key = r.string()
            r.value(r._type())  # noqa: SLF001 - long arrays are skipped, not read
            if key not in changes:
                kept.append(buf[begin:r.pos])
        table = r.pos
        for _ in range(n_tensors):
            r.tensor_info()
        out = b"GGUF" + buf[4:8] + struct.pack("<QQ", n_tensors, len(kept) + len(changes))
        out += b"".join(kept) + b"".join(encode(k, v, t) for k, (v, t) in changes.items()) + buf[table:r.pos]
        tmp = dst.with_name(dst.name + f".part{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(out + b"\0" * (-len(out) % align))
            fh.seek(header.data_offset)
            shutil.copyfileobj(fh, f, 16 << 20)
    os.replace(tmp, dst)
    return dst


def _permute_inverse(w: np.ndarray, n: int) -> np.ndarray:
    """llama's Q/K rows back to the HF (NEOX rope) order every other architecture uses."""
    hd = w.shape[0] // n
    return w.reshape(n, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(head_dim: int, base: float, factor: float = 8.0, low: float = 1.0, high: float = 4.0,
                        old: int = 8192) -> np.ndarray:
    """The ``rope_freqs`` tensor convert_hf_to_gguf writes for Llama 3.1 (conversion/llama.py)."""
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def as_architecture(src: Path, dst: Path, arch: str, *, layers: int = 6) -> Path:
    """Rewrite the F32 llama GGUF ``src`` as ``arch`` (qwen2 | qwen3 | phi3 | llama3), keeping ``layers``
    layers. The result is a valid model of that architecture for llama.cpp (not a trained one for
    qwen3, whose added Q/K norms change the function; the comparison is llama.cpp vs MLX)."""
    import gguf

    r = _reader(src)
    assert r.fields["general.architecture"].contents() == "llama"
    n_head = int(r.fields["llama.attention.head_count"].contents())
    n_kv = int(r.fields["llama.attention.head_count_kv"].contents())
    hidden = int(r.fields["llama.embedding_length"].contents())
    head_dim = hidden // n_head
    target = "llama" if arch == "llama3" else arch
    drop = {"llama.block_count", "llama.vocab_size", "general.file_type"}
    tmp = dst.with_name(dst.name + f".part{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), target)
    for name, value, vtype, sub in _fields(r, "llama", target, drop):
        w.add_key_value(name, value, vtype, sub_type=sub)
    w.add_block_count(layers)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "phi3":
        w.add_rope_dimension_count(head_dim)
        w.add_key_value(f"{target}.rope.scaling.original_context_length", 8192, gguf.GGUFValueType.UINT32)
    tensors: dict[str, np.ndarray] = {}
    for t in r.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= layers:
            continue
        assert t.tensor_type.name == "F32", "as_architecture takes an F32 GGUF"
        tensors[t.name] = np.array(t.data, dtype=np.float32).reshape(tuple(reversed(t.shape.tolist())))
    put: Callable[[str, np.ndarray], None] = lambda name, a: w.add_tensor(name, np.ascontiguousarray(a))  # noqa: E731
    if arch == "llama3":
        rope_base = float(r.fields["llama.rope.freq_base"].contents())
        put("rope_freqs.weight", llama3_rope_factors(head_dim, rope_base))
    for name, a in tensors.items():
        if arch == "llama3":
            put(name, a)
            continue
        if name.endswith("attn_q.weight"):
            a = _permute_inverse(a, n_head)
        elif name.endswith("attn_k.weight"):
            a = _permute_inverse(a, n_kv)
        blk = name.rsplit(".", 2)[0]
        if arch == "phi3":
            if name.endswith(("attn_k.weight", "attn_v.weight", "ffn_gate.weight")):
                continue  # fused below
            if name.endswith("attn_q.weight"):
                k = _permute_inverse(tensors[f"{blk}.attn_k.weight"], n_kv)
                put(f"{blk}.attn_qkv.weight", np.concatenate([a, k, tensors[f"{blk}.attn_v.weight"]]))
                continue
            if name.endswith("ffn_up.weight"):
                put(name, np.concatenate([tensors[f"{blk}.ffn_gate.weight"], a]))
                continue
        put(name, a)
        if arch == "qwen2" and name.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight")):
            rng = np.random.default_rng(len(name))
            put(name.replace(".weight", ".bias"), rng.normal(0, 0.02, a.shape[0]).astype(np.float32))
        if arch == "qwen3" and name.endswith("attn_q.weight"):
            put(f"{blk}.attn_q_norm.weight", np.full(head_dim, 1.0, np.float32))
            put(f"{blk}.attn_k_norm.weight", np.linspace(0.9, 1.1, head_dim, dtype=np.float32))
    if arch == "phi3" and "output.weight" not in tensors:
        put("output.weight", tensors["token_embd.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, dst)
    return dst
