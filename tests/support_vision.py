"""A vision projector the suite can make offline, and test images.

No real vision model is reachable from the build machines, so the test model is *made*: an ``mlp``
(LLaVA-1.5 style) projector GGUF with random weights, written with the ``gguf`` package, that llama.cpp's
mtmd loads beside the default model (SmolLM2-135M, n_embd 576): 64 px images, 16 px patches, a two-block
ViT of width 64 -> **16 image tokens** per image, 1.9 MB. Its answers mean nothing; the pipeline is real
(decode, resize, normalise, ViT, MLP, embeddings into the batched context). The recipe and its traps are in
shared/reference/vision-mtmd.md (UINT32 keys, ``n_ff != n_embd`` of the tower, ``mm.2`` width = n_embd).

**M-RoPE** (Qwen2-VL family): :func:`make_mrope_model` derives a ``qwen2vl`` text model from the default model (same
weights, q/k rows re-ordered for NEOX-style rotation, zero q/k/v biases, ``rope.dimension_sections``), so it answers
text as SmolLM2 does, and ``make_projector(kind="qwen2vl")`` writes a ``qwen2vl_merger`` projector for it: 8 px
patches merged 2x2, so a 96x64 image is a 6x4 grid of **24 image tokens taking 6 positions** (``max(nx, ny)``).
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Any

IMAGE_TOKENS = 16  # what one image becomes with the projector below (64 px / 16 px patches = 4 x 4)
MROPE_IMAGE = (96, 64)  # the M-RoPE tests' image size: 6 x 4 merged patches of the qwen2vl projector
MROPE_IMAGE_TOKENS, MROPE_IMAGE_POSITIONS = 24, 6


def make_mrope_model(src: Path, dst: Path, sections: tuple[int, int, int, int] = (8, 12, 12, 0)) -> Path:
    """Write (once, atomically) a ``qwen2vl`` copy of the LLaMA-architecture GGUF ``src`` (the default model):
    llama.cpp then runs it with M-RoPE positions (``LLAMA_ROPE_TYPE_MROPE``), and mtmd gives its images 2-D
    positions. LLaMA's converter interleaves each head's rotary halves in the q/k rows (for llama.cpp's "normal"
    rotation); Qwen2-VL rotates NEOX-style, so those rows are put back in the checkpoint's order (whole rows: a
    quantized row's blocks stay intact). For text, all four sections hold the same position, which is NEOX RoPE:
    the copy answers as the original does. ``sections`` (t, h, w, extra rotary pairs) sum to head_dim / 2."""
    if dst.is_file():
        return dst
    import os

    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src, "r")
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    if arch != "llama":
        raise ValueError(f"{src} is a {arch} model; make_mrope_model derives from a llama one")

    def val(key: str) -> int:
        return int(reader.get_field(key).contents())

    n_head, n_head_kv = val("llama.attention.head_count"), val("llama.attention.head_count_kv")
    if 2 * sum(sections) != val("llama.embedding_length") // n_head:
        raise ValueError(f"rope sections {sections} do not cover the head size")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), arch="qwen2vl", endianess=reader.endianess)
    for f in reader.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        name = "qwen2vl." + f.name[len("llama."):] if f.name.startswith("llama.") else f.name
        vt = f.types[0]
        w.add_key_value(name, f.contents(), vt, sub_type=f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    w.add_array("qwen2vl.rope.dimension_sections", list(sections))

    def unpermute(rows: np.ndarray, heads: int) -> np.ndarray:  # the inverse of convert_hf_to_gguf's permute
        n = rows.shape[0]
        return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)

    out = []
    for t in reader.tensors:
        d = t.data
        if t.name.endswith("attn_q.weight"):
            d = unpermute(d, n_head)
        elif t.name.endswith("attn_k.weight"):
            d = unpermute(d, n_head_kv)
        out.append((t.name, np.ascontiguousarray(d), t.tensor_type))
        if t.name.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight")):  # Qwen2's attention has biases
            out.append((t.name[:-len("weight")] + "bias", np.zeros(int(t.shape[1]), np.float32),
                        gguf.GGMLQuantizationType.F32))
    for name, d, tt in out:
        w.add_tensor_info(name, d.shape, d.dtype, d.nbytes, tt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, d, _ in out:
        w.write_tensor_data(d)
    w.close()
    tmp.replace(dst)
    return dst


def make_projector(path: Path, n_embd: int = 576, seed: int = 0, kind: str = "mlp") -> Path:
    """Write a random projector for a text model of width ``n_embd`` to ``path`` (once). ``kind="mlp"``: LLaVA-1.5
    style, causal, 16 tokens per image; ``kind="gemma3"``: Gemma 3 style (SigLIP tower, 2x2 average pool, RMS norm,
    input projection; ``<start_of_image>`` text around the image), which needs **non-causal** attention over the
    image's positions: 128 px images, 16 px patches, pooled to **16 tokens**; ``kind="qwen2vl"``: Qwen2-VL's merger
    (two patch convolutions, a ViT with 2-D rotary positions, 2x2 patches merged by an MLP) for an M-RoPE text model
    (:func:`make_mrope_model`): any size (aligned to 16 px, at least 8 tokens), 8 px patches, one token per 16 px
    square, ``<|vision_start|>``/``<|vision_end|>`` text around the image."""
    if path.is_file():
        return path
    import gguf
    import numpy as np

    if kind == "qwen2vl":
        return _make_qwen2vl_projector(path, n_embd, seed)

    img, patch, width, ff, blocks = (64 if kind == "mlp" else 128), 16, 64, 128, 2
    rng = np.random.default_rng(seed)

    def rnd(out: int, *inp: int) -> np.ndarray:  # numpy (out, in) = ggml ne [in, out]
        return (rng.standard_normal((out, *inp)) / np.sqrt(np.prod(inp))).astype(np.float32)

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), "clip")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", kind)
    w.add_bool("clip.use_gelu", True)
    if kind == "gemma3":
        w.add_uint32("clip.vision.projector.scale_factor", 2)
    for k, v in {"image_size": img, "patch_size": patch, "embedding_length": width, "feed_forward_length": ff,
                 "block_count": blocks, "projection_dim": n_embd, "attention.head_count": 4}.items():
        w.add_uint32("clip.vision." + k, v)  # the loader asserts UINT32
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.image_mean", [0.5] * 3)
    w.add_array("clip.vision.image_std", [0.5] * 3)
    t = {"v.patch_embd.weight": rnd(width, 3, patch, patch), "v.position_embd.weight": rnd((img // patch) ** 2, width)}
    if kind == "mlp":
        t.update({"mm.0.weight": rnd(n_embd, width), "mm.0.bias": np.zeros(n_embd, np.float32),
                  "mm.2.weight": rnd(n_embd, n_embd), "mm.2.bias": np.zeros(n_embd, np.float32)})
    else:  # ggml ne [n_embd, width]: the graph multiplies by its transpose
        t.update({"mm.input_projection.weight": rnd(width, n_embd) * np.float32(np.sqrt(n_embd / width)),
                  "mm.soft_emb_norm.weight": np.ones(width, np.float32)})
    for i in range(blocks):
        t.update({f"v.blk.{i}.{n}.weight": rnd(width, width) for n in ("attn_q", "attn_k", "attn_v", "attn_out")})
        t.update({f"v.blk.{i}.{n}.weight": np.ones(width, np.float32) for n in ("ln1", "ln2")})
        t[f"v.blk.{i}.ffn_up.weight"], t[f"v.blk.{i}.ffn_down.weight"] = rnd(ff, width), rnd(width, ff)
    return _write(w, t, tmp, path)


def _make_qwen2vl_projector(path: Path, n_embd: int, seed: int) -> Path:
    import gguf
    import numpy as np

    patch, width, ff, blocks = 8, 64, 128, 2
    rng = np.random.default_rng(seed)

    def rnd(out: int, *inp: int) -> np.ndarray:
        return (rng.standard_normal((out, *inp)) / np.sqrt(np.prod(inp))).astype(np.float32)

    def zeros(n: int) -> np.ndarray:
        return np.zeros(n, np.float32)

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), "clip")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", "qwen2vl_merger")
    w.add_bool("clip.use_gelu", True)
    for k, v in {"image_size": 64, "patch_size": patch, "embedding_length": width, "feed_forward_length": ff,
                 "block_count": blocks, "projection_dim": n_embd, "attention.head_count": 4,
                 "spatial_merge_size": 2}.items():
        w.add_uint32("clip.vision." + k, v)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.image_mean", [0.5] * 3)
    w.add_array("clip.vision.image_std", [0.5] * 3)
    t = {"v.patch_embd.weight": rnd(width, 3, patch, patch), "v.patch_embd.weight.1": rnd(width, 3, patch, patch),
         "mm.0.weight": rnd(4 * width, 4 * width), "mm.0.bias": zeros(4 * width),  # the 2x2 merge: 4 x width in
         "mm.2.weight": rnd(n_embd, 4 * width), "mm.2.bias": zeros(n_embd),
         "v.post_ln.weight": np.ones(width, np.float32), "v.post_ln.bias": zeros(width)}
    for i in range(blocks):
        for n in ("attn_q", "attn_k", "attn_v", "attn_out"):  # the graph adds q/k/v biases unconditionally
            t[f"v.blk.{i}.{n}.weight"], t[f"v.blk.{i}.{n}.bias"] = rnd(width, width), zeros(width)
        for n in ("ln1", "ln2"):
            t[f"v.blk.{i}.{n}.weight"], t[f"v.blk.{i}.{n}.bias"] = np.ones(width, np.float32), zeros(width)
        t[f"v.blk.{i}.ffn_up.weight"], t[f"v.blk.{i}.ffn_up.bias"] = rnd(ff, width), zeros(ff)
        t[f"v.blk.{i}.ffn_down.weight"], t[f"v.blk.{i}.ffn_down.bias"] = rnd(width, ff), zeros(width)
    return _write(w, t, tmp, path)


def png(width: int = 64, height: int = 64, seed: int = 0) -> bytes:
    """A PNG (RGB, stdlib zlib) whose pixels depend on ``seed``: different seeds, different pictures."""
    rows = []
    for y in range(height):
        row = bytearray([0])  # filter: none
        for x in range(width):
            v = (x * (3 + seed) + y * (5 + 2 * seed) + seed * 37) & 0xFF
            row += bytes([v, (v * 7 + seed * 11) & 0xFF, (255 - v + seed * 13) & 0xFF])
        rows.append(bytes(row))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"".join(rows)))
            + chunk(b"IEND", b""))


def reference_logits(model_path: str, projector: str, prompt: str, images: list[bytes], n_threads: int,
                     n_gen: int = 0, repeat_penalty: float = 1.1, repeat_last_n: int = 64,
                     image_max_tokens: int = 0, flash_attn: bool | None = None) -> Any:
    """The logits after ``prompt`` (one ``<__media__>`` per image) as llama.cpp's own helper evaluates it:
    ``mtmd_helper_eval_chunks`` on a fresh one-sequence context (what ``llama-mtmd-cli`` does): the yardstick for
    the batched loop's image path (non-causal and M-RoPE images included). ``n_gen > 0``: (those logits, the
    ``n_gen`` greedy tokens that follow, each evaluated at the position after the helper's ``n_past``, with the
    repeat penalty of Ollama's defaults over the tokens sampled, as llama.cpp's penalties sampler computes it).
    ``image_max_tokens``: mtmd's limit on an image's tokens (0: the projector's own). ``flash_attn``: as the load
    under test has it (None: llama.cpp's auto; a server plans it off on the CPU), so both compute the same sums."""
    import ctypes

    import llama_cpp as L
    import llama_cpp.mtmd_cpp as M
    import numpy as np

    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = L.llama_model_load_from_file(model_path.encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 1024, 512, 512, n_threads, n_threads
    cp.flash_attn_type = {None: L.LLAMA_FLASH_ATTN_TYPE_AUTO, True: L.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                          False: L.LLAMA_FLASH_ATTN_TYPE_DISABLED}[flash_attn]
    ctx = L.llama_init_from_model(model, cp)
    par = M.mtmd_context_params_default()
    par.use_gpu, par.n_threads, par.print_timings = False, n_threads, False
    if image_max_tokens:
        par.image_max_tokens = image_max_tokens
    mctx = M.mtmd_init_from_file(projector.encode(), model, par)
    bitmaps = []
    try:
        for data in images:
            buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
            bitmaps.append(M.mtmd_helper_bitmap_init_from_buf(mctx, buf, len(data), False))
        raw = prompt.encode()
        txt = M.mtmd_input_text()
        txt.text, txt.text_len, txt.add_special, txt.parse_special = raw, len(raw), True, True
        chunks = M.mtmd_input_chunks_init()
        arr = (M.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps)
        assert M.mtmd_tokenize(mctx, chunks, ctypes.byref(txt), arr, len(bitmaps)) == 0
        n_past = L.llama_pos(0)
        assert M.mtmd_helper_eval_chunks(mctx, ctx, chunks, 0, 0, 512, True, ctypes.byref(n_past)) == 0
        n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        out = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()
        M.mtmd_input_chunks_free(chunks)
        if n_gen <= 0:
            return out
        toks, row, pos = [], out, n_past.value
        b = L.llama_batch_init(1, 0, 1)
        try:
            for _ in range(n_gen):
                row = np.array(row, dtype=np.float32)
                seen = np.array(sorted(set(toks[-repeat_last_n:])), dtype=np.intp)
                if len(seen) and repeat_penalty != 1.0:
                    lg = row[seen]
                    row[seen] = np.where(lg <= 0, lg * np.float32(repeat_penalty), lg / np.float32(repeat_penalty))
                toks.append(int(np.argmax(row)))
                b.n_tokens, b.token[0], b.pos[0], b.n_seq_id[0], b.seq_id[0][0], b.logits[0] = 1, toks[-1], pos, 1, 0, 1
                assert L.llama_decode(ctx, b) == 0
                pos += 1
                row = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
        finally:
            L.llama_batch_free(b)
        return out, toks
    finally:
        for bm in bitmaps:
            M.mtmd_bitmap_free(bm)
        M.mtmd_free(mctx)
        L.llama_free(ctx)
        L.llama_model_free(model)


def reference_in_subprocess(model_path: str, projector: str, prompt: str, images: list[bytes], n_gen: int,
                            n_threads: int = 2, image_max_tokens: int = 0,
                            flash_attn: bool | None = None) -> tuple[list[float], list[int]]:
    """:func:`reference_logits` with ``n_gen`` in a fresh process (nothing of the caller's llama.cpp state, logging
    or contexts shared): (the 5 best log-probabilities after the prompt, best first; the greedy tokens)."""
    import base64
    import json
    import os
    import subprocess
    import sys

    code = ("import json, sys, base64, numpy as np\n"
            "from tests.support_vision import reference_logits\n"
            "a = json.loads(sys.stdin.read())\n"
            "imgs = [base64.b64decode(i) for i in a['i']]\n"
            "lg, toks = reference_logits(a['m'], a['p'], a['t'], imgs, a['n'], a['g'], image_max_tokens=a['x'],\n"
            "                            flash_attn=a['f'])\n"
            "lg = np.asarray(lg, dtype=np.float64); lse = lg.max() + np.log(np.exp(lg - lg.max()).sum())\n"
            "print('REF' + json.dumps([sorted((lg - lse).tolist(), reverse=True)[:5], toks]))\n")
    arg = json.dumps({"m": model_path, "p": projector, "t": prompt, "n": n_threads, "g": n_gen,
                      "x": image_max_tokens, "f": flash_attn,
                      "i": [base64.b64encode(i).decode() for i in images]})
    root = str(Path(__file__).resolve().parent.parent)
    r = subprocess.run([sys.executable, "-c", code], input=arg, capture_output=True, text=True, timeout=600, cwd=root,
                       env={**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")})
    line = next((x for x in r.stdout.splitlines() if x.startswith("REF")), None)
    assert r.returncode == 0 and line, r.stderr[-2000:]
    top, toks = json.loads(line[3:])
    return top, toks


def _write(w: Any, tensors: dict[str, Any], tmp: Path, path: Path) -> Path:
    """Add ``tensors`` to the GGUF writer ``w``, write it to ``tmp`` and move it into place at ``path``."""
    for k, v in tensors.items():
        w.add_tensor(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(path)
    return path
