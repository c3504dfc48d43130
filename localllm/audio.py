"""Audio clips a user sends, checked before any backend sees them (the CLI, the TUI and the server share this).

A model with an audio projector (mmproj with an audio encoder) takes WAV, MP3 and FLAC: llama.cpp's mtmd decodes
and resamples them itself. What is checked here, from the bytes' header and **before anything is decoded**:

* the size: at most ``LOCALLLM_MAX_AUDIO_BYTES`` (default 20 MiB, as images) of encoded audio;
* the format, by its magic bytes: WAV, MP3 or FLAC; a known other one (Ogg/Opus, M4A/AAC, WebM, AIFF) is named
  as unsupported; anything else is "not audio";
* the duration the header declares (WAV: the data's frames / sample rate; FLAC: STREAMINFO's samples / rate; MP3: the
  bytes over the first frame's bitrate, or a Xing/Info header's frame count): at most
  ``LOCALLLM_MAX_AUDIO_SECONDS`` (default 600 s: mtmd cuts a clip into 30 s chunks, each its own encode and a
  block of tokens, so 10 minutes is 20 chunks); a header that cannot be read, or a WAV whose data chunk is cut
  short, is "truncated".

As in Ollama, a clip travels with a message's images (``message["images"]``): the backend and the checks tell
audio from an image by these magic bytes. :func:`extract_paths` finds audio files named in a prompt, as images
are found (``localllm run MODEL "Transcribe ./memo.wav"``).
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from backends.contract.media import audio_format
from localllm.errors import LocalLLMError

DEFAULT_MAX_BYTES = 20 << 20  # base64 of it (27 MiB) stays under the server's 32 MiB body limit
DEFAULT_MAX_SECONDS = 600.0
AUDIO_SUFFIXES = (".wav", ".mp3", ".flac")
AUDIO_FORMATS = ("wav", "mp3", "flac")  # what input_audio's ``format`` may say

# formats we recognise but mtmd does not decode: named in the refusal
_OTHER = {b"OggS": "Ogg (Vorbis/Opus)", b"\x1aE\xdf\xa3": "WebM/Matroska", b"FORM": "AIFF", b"#!AMR": "AMR"}


class AudioError(LocalLLMError):
    """An audio clip that is refused (one sentence)."""


@dataclass(frozen=True)
class ClipInfo:
    """What a clip's header says: its format and its duration in seconds."""

    format: str  # "WAV", "MP3", "FLAC"
    seconds: float


def max_bytes() -> int:
    try:
        return max(1, int(os.environ.get("LOCALLLM_MAX_AUDIO_BYTES", DEFAULT_MAX_BYTES)))
    except ValueError:
        return DEFAULT_MAX_BYTES


def max_seconds() -> float:
    try:
        return max(0.1, float(os.environ.get("LOCALLLM_MAX_AUDIO_SECONDS", DEFAULT_MAX_SECONDS)))
    except ValueError:
        return DEFAULT_MAX_SECONDS


def is_audio(data: bytes) -> bool:
    """Whether media bytes are a WAV, MP3 or FLAC clip (else they are taken for an image)."""
    return audio_format(data) is not None


def other_format(data: bytes) -> str | None:
    """The name of a known audio format that is not supported (Ogg, M4A, WebM, AIFF, AMR), else None."""
    for magic, name in _OTHER.items():
        if data.startswith(magic):
            return name
    if data[4:8] == b"ftyp":
        return "MP4/M4A (AAC)"
    return None


def _wav(data: bytes) -> float | None:
    """Duration of a RIFF/WAVE clip from its ``fmt `` and ``data`` chunks: the data's frames over the **sample rate**
    (what a decoder plays and resamples; the header's byte rate is not used, a forged one would understate the
    length); None when they are unreadable; the declared duration negated when the data chunk is cut short (so an
    absurd length is named as such first).

    A frame's bytes are ``channels × bits / 8`` (4-bit ADPCM: half a byte a mono frame), or the block alignment
    where that is smaller: the shorter frame gives the longer duration, so no field can make a clip look shorter
    than what dr_wav (mtmd's decoder) takes from it."""
    i, rate, frame = 12, 0, 0.0
    while i + 8 <= len(data):
        cid, size = data[i:i + 4], struct.unpack("<I", data[i + 4:i + 8])[0]
        if cid == b"fmt ":
            if i + 24 > len(data) or size < 16:
                return None
            channels, rate, _byte_rate, align, bits = struct.unpack("<HIIHH", data[i + 10:i + 24])
            sizes = [n for n in (channels * bits / 8, float(align)) if n > 0]
            frame = min(sizes) if sizes else 0.0
        elif cid == b"data":
            if not rate or not frame:
                return None
            # a streamed WAV's 0xFFFFFFFF "unknown" length: the bytes there are
            n = len(data) - i - 8 if size == 0xFFFFFFFF else size
            secs = n / frame / rate
            # a declared length beyond the bytes: truncated
            return -secs if size != 0xFFFFFFFF and i + 8 + size > len(data) + 1 else secs
        i += 8 + size + (size & 1)
    return None


def _flac(data: bytes) -> float | None:
    # "fLaC", then the STREAMINFO block: 4-byte header, then 18 bytes; rate (20 bits) and total samples (36 bits)
    if len(data) < 8 + 18 or data[4] & 0x7F != 0:
        return None
    b = int.from_bytes(data[18:26], "big")
    rate, total = b >> 44, b & ((1 << 36) - 1)
    if not rate:
        return None
    return total / rate if total else 0.0  # 0: the encoder did not know; the size limit bounds it


_MP3_KBPS = {  # (version bits, layer bits) -> kbit/s by index; MPEG-1 and MPEG-2/2.5 layer III and II
    (3, 1): [0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320],
    (3, 2): [0, 32, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384],
    (2, 1): [0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160],
}
_MP3_RATES = {3: [44100, 48000, 32000], 2: [22050, 24000, 16000], 0: [11025, 12000, 8000]}


def _mp3(data: bytes) -> float | None:
    i = 0
    if data[:3] == b"ID3" and len(data) >= 10:  # skip the ID3v2 tag (a syncsafe size)
        i = 10 + ((data[6] & 0x7F) << 21 | (data[7] & 0x7F) << 14 | (data[8] & 0x7F) << 7 | (data[9] & 0x7F))
    end = min(len(data) - 4, i + 64 * 1024)
    while i < end and not (data[i] == 0xFF and data[i + 1] & 0xE0 == 0xE0):
        i += 1
    if i >= end:
        return None
    h = int.from_bytes(data[i:i + 4], "big")
    ver, layer, br_i, sr_i = (h >> 19) & 3, (h >> 17) & 3, (h >> 12) & 15, (h >> 10) & 3
    kbps = _MP3_KBPS.get((ver, layer)) or _MP3_KBPS.get((2, 1) if ver in (0, 2) else (3, 1))
    if ver == 1 or layer == 0 or br_i in (0, 15) or sr_i == 3 or kbps is None:
        return None
    rate = _MP3_RATES[ver][sr_i]
    xing = data.find(b"Xing", i, i + 64)
    if xing < 0:
        xing = data.find(b"Info", i, i + 64)
    if xing >= 0 and len(data) >= xing + 12 and data[xing + 7] & 1:  # a frame count: VBR exact
        frames = struct.unpack(">I", data[xing + 8:xing + 12])[0]
        return frames * (1152 if ver == 3 else 576) / rate
    return (len(data) - i) * 8 / (kbps[br_i] * 1000)


def clip_info(data: bytes) -> ClipInfo | None:
    """(format, declared seconds) from the header, without decoding; None when it is not WAV, MP3 or FLAC.
    A clip whose header is cut short has ``seconds < 0``.

    >>> import io, wave
    >>> buf = io.BytesIO()
    >>> with wave.open(buf, "wb") as w:
    ...     w.setnchannels(1); w.setsampwidth(2); w.setframerate(16000); w.writeframes(b"\\0\\0" * 8000)
    >>> clip_info(buf.getvalue())
    ClipInfo(format='WAV', seconds=0.5)
    """
    fmt = audio_format(data)
    if fmt is None:
        return None
    try:
        secs = {"WAV": _wav, "FLAC": _flac, "MP3": _mp3}[fmt](data)
    except (struct.error, IndexError):
        secs = None
    return ClipInfo(fmt, -1.0 if secs is None else secs)


def _declared(data: bytes) -> tuple[str, float, bool] | None:
    """(format, declared seconds, truncated) from the header; None when not WAV/MP3/FLAC."""
    info = clip_info(data)
    if info is None:
        return None
    if info.seconds < 0:  # unreadable (-1) or a WAV cut short (minus its declared length)
        return info.format, (-info.seconds if info.seconds != -1.0 else 0.0), True
    return info.format, info.seconds, False


def check_audio(data: bytes, where: str, fmt: str | None = None) -> bytes:
    """``data`` if it is a clip we accept; else :class:`AudioError` naming ``where`` and what is wrong. ``fmt``:
    the format the request declared (OpenAI's ``input_audio.format``), checked against the supported ones."""
    if fmt is not None and fmt.lower() not in AUDIO_FORMATS:
        raise AudioError(f"{where}: the audio format {fmt[:20]!r} is not supported; send WAV, MP3 or FLAC")
    if not data:
        raise AudioError(f"{where}: the audio clip is empty")
    if len(data) > max_bytes():
        raise AudioError(f"{where}: the audio clip is {len(data):,} bytes, more than the {max_bytes():,} allowed "
                         "(LOCALLLM_MAX_AUDIO_BYTES)")
    found = _declared(data)
    if found is None:
        other = other_format(data)
        if other:
            raise AudioError(f"{where}: {other} audio is not supported; send WAV, MP3 or FLAC")
        raise AudioError(f"{where}: the data is not a WAV, MP3 or FLAC audio clip")
    fmt_found, secs, truncated = found
    if secs > max_seconds():  # before decoding, and before "truncated": a header claiming hours is named as such
        raise AudioError(f"{where}: the clip lasts {secs:,.0f} s, more than the {max_seconds():,.0f} s allowed "
                         "(LOCALLLM_MAX_AUDIO_SECONDS)")
    if truncated:
        raise AudioError(f"{where}: the {fmt_found} clip is truncated or its header is unreadable")
    return data


def read_audio(path: str | os.PathLike[str]) -> bytes:
    """The checked bytes of an audio file (:class:`AudioError` when it cannot be read or is refused)."""
    p = Path(path).expanduser()
    try:
        if p.stat().st_size > max_bytes():
            raise AudioError(f"{p}: the audio clip is {p.stat().st_size:,} bytes, more than the {max_bytes():,} "
                             "allowed (LOCALLLM_MAX_AUDIO_BYTES).")
        data = p.read_bytes()
    except OSError as e:
        raise AudioError(f"Cannot read the audio file {p}: {e.strerror or e}.") from None
    return check_audio(data, str(p))


def duration_label(data: bytes) -> str:
    """``"1.5 s"`` / ``"2:05"``: a clip's declared length for a chip or a status line ("?" when unknown)."""
    info = clip_info(data)
    if info is None or info.seconds < 0:
        return "?"
    s = info.seconds
    return f"{s:.1f} s" if s < 60 else f"{int(s // 60)}:{int(s % 60):02d}"


def transcription_prompt(language: str | None = None, prompt: str | None = None) -> str:
    """The user turn that goes with a clip to transcribe (``localllm transcribe``, ``/v1/audio/transcriptions``).

    >>> transcription_prompt("fr")
    'Transcribe the speech in this audio clip (language: fr). Write only the words spoken, nothing else.'
    """
    text = "Transcribe the speech in this audio clip" + (f" (language: {language})" if language else "") + \
        ". Write only the words spoken, nothing else."
    if prompt:
        text += f"\nThe text before this clip, for context and spelling: {prompt}"
    return text


_PATH_RE = re.compile(r"(?:[~.]?/|[A-Za-z]:\\)?(?:[^\s'\"]|\\ )+\.(?:wav|mp3|flac)\b", re.IGNORECASE)


def extract_paths(text: str) -> tuple[str, list[Path]]:
    """(the prompt without them, the audio files it names that exist), as images are found.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); (d / "memo.wav").write_bytes(b"x") and None
    >>> text, found = extract_paths(f"Transcribe {d}/memo.wav please")
    >>> text, [p.name for p in found]
    ('Transcribe please', ['memo.wav'])
    """
    from localllm.images import extract_paths as extract

    return extract(text, _PATH_RE)
