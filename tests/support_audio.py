"""An audio projector the suite can make offline, and test clips.

No real audio model is reachable from the build machines, so the test model is *made*: an ``ultravox`` projector
GGUF with random weights, written with the ``gguf`` package, that llama.cpp's mtmd loads beside the default model
(SmolLM2-135M, n_embd 576): a two-block Whisper-style encoder of width 64 over 80 mel bins, a stack factor of 25
and a two-layer projector. mtmd pads every clip to 30 s chunks (1500 encoder positions), so **each 30 s of audio
becomes 60 audio tokens** (a 1.5 s clip: 60; a 31 s clip: 120). Its answers mean nothing; the pipeline is real
(WAV/MP3/FLAC decode and resample, mel spectrogram, encoder, projector, embeddings into the batched context). The
recipe and its traps are in shared/reference/models-2026.md ("Making a tiny audio projector": the stack factor must
divide 1500; ``k`` has no bias).
"""

from __future__ import annotations

import io
import math
import os
import struct
import wave
from pathlib import Path

AUDIO_TOKENS = 60  # what each 30 s chunk of a clip becomes with the projector below


def make_audio_projector(path: Path, n_embd: int = 576, seed: int = 0) -> Path:
    """Write (once, atomically) a random ``ultravox`` audio projector for a text model of width ``n_embd``."""
    if path.is_file():
        return path
    import gguf
    import numpy as np

    width, ff, blocks, mels, stack, proj_ff = 64, 128, 2, 80, 25, 256
    rng = np.random.default_rng(seed)

    def rnd(out: int, *inp: int) -> np.ndarray:  # numpy (out, in) = ggml ne [in, out]
        return (rng.standard_normal((out, *inp)) / np.sqrt(np.prod(inp))).astype(np.float32)

    def zeros(n: int) -> np.ndarray:
        return np.zeros(n, np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, np.float32)

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")  # xdist workers may both make it
    w = gguf.GGUFWriter(str(tmp), "clip")
    w.add_bool("clip.has_audio_encoder", True)
    w.add_string("clip.projector_type", "ultravox")
    for k, v in {"embedding_length": width, "feed_forward_length": ff, "block_count": blocks,
                 "projection_dim": n_embd, "attention.head_count": 4, "num_mel_bins": mels,
                 "projector.stack_factor": stack}.items():
        w.add_uint32("clip.audio." + k, v)  # the loader asserts UINT32
    w.add_float32("clip.audio.attention.layer_norm_epsilon", 1e-5)
    t = {"a.conv1d.1.weight": rnd(width, mels, 3).astype(np.float16), "a.conv1d.1.bias": zeros(width)[:, None],
         "a.conv1d.2.weight": rnd(width, width, 3).astype(np.float16), "a.conv1d.2.bias": zeros(width)[:, None],
         "a.position_embd.weight": rnd(1500, width), "a.post_ln.weight": ones(width), "a.post_ln.bias": zeros(width),
         "mm.a.norm_pre.weight": ones(width * stack), "mm.a.mlp.1.weight": rnd(proj_ff, width * stack),
         "mm.a.norm_mid.weight": ones(proj_ff // 2), "mm.a.mlp.2.weight": rnd(n_embd, proj_ff // 2)}
    for i in range(blocks):
        for n in ("attn_q", "attn_k", "attn_v", "attn_out"):
            t[f"a.blk.{i}.{n}.weight"] = rnd(width, width)
            if n != "attn_k":  # Whisper's key projection has no bias
                t[f"a.blk.{i}.{n}.bias"] = zeros(width)
        for n in ("ln1", "ln2"):
            t[f"a.blk.{i}.{n}.weight"], t[f"a.blk.{i}.{n}.bias"] = ones(width), zeros(width)
        t[f"a.blk.{i}.ffn_up.weight"], t[f"a.blk.{i}.ffn_up.bias"] = rnd(ff, width), zeros(ff)
        t[f"a.blk.{i}.ffn_down.weight"], t[f"a.blk.{i}.ffn_down.bias"] = rnd(width, ff), zeros(width)
    for k, v in t.items():
        w.add_tensor(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(path)
    return path


def wav(seconds: float = 1.5, freq: float = 440.0, rate: int = 16000, seed: int = 0) -> bytes:
    """A mono 16-bit WAV (standard library ``wave``): a tone at ``freq`` Hz plus a chirp set by ``seed``, so
    different seeds or frequencies are different sounds."""
    n = int(seconds * rate)
    out = bytearray()
    for i in range(n):
        x = i / rate
        v = 0.5 * math.sin(2 * math.pi * freq * x) + 0.3 * math.sin(2 * math.pi * (200 + 150 * seed) * x * (1 + x))
        out += struct.pack("<h", int(max(-1.0, min(1.0, v)) * 32000))
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(bytes(out))
    return buf.getvalue()


def encoded(fmt: str, seconds: float = 1.5, seed: int = 0, rate: int = 16000) -> bytes:
    """The samples of :func:`wav` (same tone, same seed) as ``"FLAC"`` (lossless: the same 16-bit samples) or
    ``"MP3"``, written with ``soundfile`` (libsndfile's encoders, bundled in its wheels)."""
    import numpy as np
    import soundfile as sf

    with wave.open(io.BytesIO(wav(seconds, rate=rate, seed=seed)), "rb") as w:
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    buf = io.BytesIO()
    sf.write(buf, pcm, rate, format=fmt, subtype={"FLAC": "PCM_16", "MP3": "MPEG_LAYER_III"}[fmt])
    return buf.getvalue()


def forged_wav(rate: int, byte_rate: int, frames: int) -> bytes:
    """A 16-bit mono WAV of ``frames`` frames at ``rate`` Hz whose header claims ``byte_rate`` bytes a second."""
    fmt = struct.pack("<HHIIHH", 1, 1, rate, byte_rate, 2, 16)
    body = b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", frames * 2) + b"\1\0" * frames
    return b"RIFF" + struct.pack("<I", len(body)) + body
