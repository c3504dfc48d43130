"""Images and audio in prompts: the marker a rendered prompt holds per image, the placeholder ids a prompt's
media positions take, and how audio is told from an image (by its magic bytes, as mtmd does)."""

from __future__ import annotations

from dataclasses import dataclass

IMAGE_MARKER = "<__media__>"  # where an image goes in a rendered prompt (mtmd's default marker)


def is_image_token(token: int) -> bool:
    """Image positions are negative placeholder ids in a prompt's token list (see :meth:`TokenSource.prompt_media`):
    derived from the image's content hash, so prefix reuse, parking and the disk cache key images by content."""
    return token < 0


AUDIO_MAGIC = {"WAV": lambda b: b[:4] == b"RIFF" and b[8:12] == b"WAVE", "FLAC": lambda b: b[:4] == b"fLaC",
               "MP3": lambda b: b[:3] == b"ID3" or (len(b) > 1 and b[0] == 0xFF and b[1] & 0xE0 == 0xE0)}


def audio_format(data: bytes) -> str | None:
    r""""WAV", "MP3" or "FLAC" when ``data`` starts as one (the test mtmd's decoder makes), else None.

    >>> audio_format(b"RIFF\x00\x00\x00\x00WAVEfmt "), audio_format(b"\x89PNG\r\n\x1a\n")
    ('WAV', None)
    """
    if len(data) < 12:
        return None
    return next((name for name, test in AUDIO_MAGIC.items() if test(data)), None)


def is_audio(data: bytes) -> bool:
    """Whether media bytes are an audio clip (else they are taken for an image)."""
    return audio_format(data) is not None


@dataclass
class MediaWork:
    """What :meth:`TokenSource.encode_images` did for one chunk of a prompt (or since load)."""

    images: int = 0  # images encoded now (0: their embeddings were cached)
    tokens: int = 0  # image tokens those produced
    ns: int = 0  # time the projector took on images
    audio: int = 0  # audio chunks encoded (a clip is one per 30 s, as mtmd cuts it)
    audio_tokens: int = 0  # audio tokens those produced
    audio_ns: int = 0  # time the projector took on audio
