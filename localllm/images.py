"""Images a user sends, checked before any backend sees them (the CLI, the TUI and the server share this).

* the size: at most ``LOCALLLM_MAX_IMAGE_BYTES`` (default 20 MiB) of encoded image;
* the format, by its magic bytes: PNG, JPEG, GIF, BMP or WebP (what llama.cpp's stb_image decodes);
* the declared pixel count, read from the header **before decoding** (decompression bombs): at most
  ``LOCALLLM_MAX_IMAGE_PIXELS`` (default 50 megapixels); a header that cannot be read is "truncated".

:func:`extract_paths` finds image files named in a prompt, as ``ollama run`` does
(``localllm run MODEL "What is in ./photo.jpg?"``).
"""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path

from localllm.errors import LocalLLMError

DEFAULT_MAX_BYTES = 20 << 20
DEFAULT_MAX_PIXELS = 50_000_000
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp")


class ImageError(LocalLLMError):
    """An image that is refused (one sentence)."""


def max_bytes() -> int:
    try:
        return max(1, int(os.environ.get("LOCALLLM_MAX_IMAGE_BYTES", DEFAULT_MAX_BYTES)))
    except ValueError:
        return DEFAULT_MAX_BYTES


def max_pixels() -> int:
    try:
        return max(1, int(os.environ.get("LOCALLLM_MAX_IMAGE_PIXELS", DEFAULT_MAX_PIXELS)))
    except ValueError:
        return DEFAULT_MAX_PIXELS


def image_size(data: bytes) -> tuple[str, int, int] | None:
    """(format, width, height) from the header, without decoding; None when it is no image we know.

    >>> head = b"\\x89PNG\\r\\n\\x1a\\n" + struct.pack(">I", 13) + b"IHDR"
    >>> image_size(head + struct.pack(">II", 64, 32) + b"\\x08\\x02")
    ('PNG', 64, 32)
    >>> image_size(b"hello") is None
    True
    """
    try:
        if data[:8] == b"\x89PNG\r\n\x1a\n":
            if data[12:16] != b"IHDR":
                return ("PNG", 0, 0)
            w, h = struct.unpack(">II", data[16:24])
            return ("PNG", w, h)
        if data[:3] == b"\xff\xd8\xff":
            i = 2
            while i + 9 < len(data):
                if data[i] != 0xFF:
                    i += 1
                    continue
                marker = data[i + 1]
                if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
                    i += 2
                    continue
                (seg,) = struct.unpack(">H", data[i + 2:i + 4])
                if marker in (0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF):
                    h, w = struct.unpack(">HH", data[i + 5:i + 9])
                    return ("JPEG", w, h)
                i += 2 + seg
            return ("JPEG", 0, 0)
        if data[:6] in (b"GIF87a", b"GIF89a"):
            w, h = struct.unpack("<HH", data[6:10])
            return ("GIF", w, h)
        if data[:2] == b"BM" and len(data) >= 26:
            w, h = struct.unpack("<ii", data[18:26])
            return ("BMP", abs(w), abs(h))
        if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            kind = data[12:16]
            if kind == b"VP8X":
                w = int.from_bytes(data[24:27], "little") + 1
                h = int.from_bytes(data[27:30], "little") + 1
                return ("WebP", w, h)
            if kind == b"VP8L":
                b = int.from_bytes(data[21:25], "little")
                return ("WebP", (b & 0x3FFF) + 1, ((b >> 14) & 0x3FFF) + 1)
            if kind == b"VP8 ":
                w, h = struct.unpack("<HH", data[26:30])
                return ("WebP", w & 0x3FFF, h & 0x3FFF)
            return ("WebP", 0, 0)
    except struct.error:
        return (data[:4].decode("latin-1"), 0, 0)
    return None


def check_image(data: bytes, where: str) -> bytes:
    """``data`` if it is an image we accept; else :class:`ImageError` naming ``where`` and what is wrong."""
    if not data:
        raise ImageError(f"{where}: the image is empty")
    if len(data) > max_bytes():
        raise ImageError(f"{where}: the image is {len(data):,} bytes, more than the {max_bytes():,} allowed "
                          "(LOCALLLM_MAX_IMAGE_BYTES)")
    found = image_size(data)
    if found is None:
        raise ImageError(f"{where}: the data is not a PNG, JPEG, GIF, BMP or WebP image")
    fmt, w, h = found
    if not w or not h:
        raise ImageError(f"{where}: the {fmt} image is truncated or its header is unreadable")
    if w * h > max_pixels():
        raise ImageError(f"{where}: the image declares {w}x{h} pixels, more than the {max_pixels():,} allowed "
                          "(LOCALLLM_MAX_IMAGE_PIXELS)")
    return data



def read_image(path: str | os.PathLike[str]) -> bytes:
    """The checked bytes of an image file (:class:`ImageError` when it cannot be read or is refused)."""
    p = Path(path).expanduser()
    try:
        if p.stat().st_size > max_bytes():
            raise ImageError(f"{p}: the image is {p.stat().st_size:,} bytes, more than the {max_bytes():,} allowed "
                             "(LOCALLLM_MAX_IMAGE_BYTES).")
        data = p.read_bytes()
    except OSError as e:
        raise ImageError(f"Cannot read the image {p}: {e.strerror or e}.") from None
    return check_image(data, str(p))


# a path-looking word ending in an image suffix; backslash-escaped spaces kept (as a shell would)
_PATH_RE = re.compile(r"(?:[~.]?/|[A-Za-z]:\\)?(?:[^\s'\"]|\\ )+\.(?:png|jpe?g|webp|gif|bmp)\b", re.IGNORECASE)


def extract_paths(text: str, pattern: re.Pattern[str] = _PATH_RE) -> tuple[str, list[Path]]:
    """(the prompt without them, the image files it names that exist), as ``ollama run`` does; ``pattern`` finds
    other files the same way (:func:`localllm.audio.extract_paths`: audio suffixes).

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); (d / "a.png").write_bytes(b"x") and None
    >>> text, found = extract_paths(f"What is in {d}/a.png? and in ./missing.jpg")
    >>> text, [p.name for p in found]
    ('What is in ? and in ./missing.jpg', ['a.png'])
    """
    found: list[Path] = []
    out = text
    for m in pattern.finditer(text):
        word = m.group(0).strip("\"'").replace("\\ ", " ")
        p = Path(word).expanduser()
        if p.is_file():
            found.append(p)
            out = out.replace(m.group(0), "", 1)
    return re.sub(r"[ \t]{2,}", " ", out).strip(), found
