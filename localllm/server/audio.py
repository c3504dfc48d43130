"""Audio as the APIs send it → checked bytes for the backend, each bad clip a 400 in the API's own shape.

* OpenAI chat's and Responses' ``input_audio`` parts: ``{"data": base64, "format": "wav" | "mp3"}`` (``flac``
  too); :func:`from_input_audio`.
* Ollama's native API: a clip rides in ``images`` (base64), as Ollama itself takes Gemma 4's audio: told from an
  image by its magic bytes (RIFF/WAVE, ID3 or an MPEG frame sync, fLaC).
* ``POST /v1/audio/transcriptions``: a multipart upload (:mod:`localllm.server.transcriptions`).

The clip joins its message's ``images`` (the backend tells the two apart the same way); its format, size and the
duration its header declares are checked by :func:`localllm.server.images.check_request` once the model is known
to take audio, so a model without an audio projector answers "does not support audio" first.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from localllm import audio as core
from localllm.server.errors import bad_request


class SentAudio(bytes):
    """A clip's bytes as a request sent them, with where in the request it was (``messages[0].content[1]``) and the
    format it declared (OpenAI's ``input_audio.format``; None where the API has none, as Ollama's ``images``)."""

    where: str = "audio"
    fmt: str | None = None


def sent_audio(data: bytes, where: str, fmt: str | None = None) -> SentAudio:
    clip = SentAudio(data)
    clip.where, clip.fmt = where, fmt
    return clip


def check_clip(data: bytes, where: str, fmt: str | None = None) -> bytes:
    """``data`` if it is a clip we accept; else a 400 naming ``where`` and what is wrong."""
    try:
        return core.check_audio(data, where, fmt)
    except core.AudioError as e:
        raise bad_request(str(e)) from None


def from_input_audio(value: Any, where: str, param: str = "messages") -> SentAudio:
    """An ``input_audio`` object (``{"data": base64, "format": "wav"}``) → the clip's bytes (checked later)."""
    if hasattr(value, "model_dump"):
        value = value.model_dump()
    if not isinstance(value, dict):
        raise bad_request(f"{where}: input_audio must be an object with data and format", param=param)
    data, fmt = value.get("data"), value.get("format")
    if not isinstance(data, str) or not data:
        raise bad_request(f"{where}.data must be a non-empty base64 string", param=param)
    if fmt is not None and not isinstance(fmt, str):
        raise bad_request(f"{where}.format must be a string (wav, mp3 or flac)", param=param)
    if fmt is not None and fmt.lower() not in core.AUDIO_FORMATS:
        raise bad_request(f"{where}: the audio format {fmt[:20]!r} is not supported; send wav, mp3 or flac",
                          param=param)
    limit = core.max_bytes()
    if len(data) > limit * 4 // 3 + 8:
        raise bad_request(f"{where}: the audio clip is more than the {limit:,} bytes allowed "
                          "(LOCALLLM_MAX_AUDIO_BYTES)", param=param)
    try:
        raw = base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{where}.data is not valid base64", param=param) from None
    return sent_audio(raw, where, fmt)
