"""Images as the APIs send them → checked bytes for the backend, each bad one a 400 in the API's own shape.

Every face decodes here: Ollama's ``images`` (base64 strings), OpenAI's ``image_url`` parts and Responses'
``input_image`` (``data:`` URIs), Anthropic's ``image`` blocks (``source.type == "base64"``). What is checked,
before anything reaches the projector:

* base64 that decodes, a ``data:`` URI that is well formed;
* the size: at most ``LOCALLLM_MAX_IMAGE_BYTES`` (default 20 MiB) of encoded image;
* the format, by its magic bytes: PNG, JPEG, GIF, BMP or WebP (what llama.cpp's stb_image decodes);
* the declared pixel count, read from the header **before decoding** (decompression bombs): at most
  ``LOCALLLM_MAX_IMAGE_PIXELS`` (default 50 megapixels); a header that cannot be read is "truncated".

Remote ``http(s)://`` image URLs are refused unless ``LOCALLLM_IMAGE_URLS=1`` allows them; then they are
fetched (:func:`fetch_remote`) with a size and time limit, never from a private, loopback or link-local
address. ``file://`` is never read.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from urllib.parse import urlsplit

from localllm.server.errors import APIError, bad_request

DEFAULT_MAX_BYTES = 20 << 20
DEFAULT_MAX_PIXELS = 50_000_000
FETCH_TIMEOUT_S = 10.0


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


def urls_allowed() -> bool:
    return os.environ.get("LOCALLLM_IMAGE_URLS", "") not in ("", "0", "false", "no")


@dataclass(frozen=True)
class RemoteImage:
    """An ``http(s)`` image URL a request named, fetched by :func:`resolve` before the engine is called."""

    url: str
    where: str


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
    """``data`` if it is an image we accept; else a 400 naming ``where`` and what is wrong."""
    if not data:
        raise bad_request(f"{where}: the image is empty")
    if len(data) > max_bytes():
        raise bad_request(f"{where}: the image is {len(data):,} bytes, more than the {max_bytes():,} allowed "
                          "(LOCALLLM_MAX_IMAGE_BYTES)")
    found = image_size(data)
    if found is None:
        raise bad_request(f"{where}: the data is not a PNG, JPEG, GIF, BMP or WebP image")
    fmt, w, h = found
    if not w or not h:
        raise bad_request(f"{where}: the {fmt} image is truncated or its header is unreadable")
    if w * h > max_pixels():
        raise bad_request(f"{where}: the image declares {w}x{h} pixels, more than the {max_pixels():,} allowed "
                          "(LOCALLLM_MAX_IMAGE_PIXELS)")
    return data


def from_base64(text: object, where: str) -> bytes:
    """Decode a base64 image (Ollama's and Anthropic's form) and check it."""
    if not isinstance(text, str):
        raise bad_request(f"{where}: an image must be a base64 string")
    if len(text) > max_bytes() * 4 // 3 + 8:
        raise bad_request(f"{where}: the image is more than the {max_bytes():,} bytes allowed "
                          "(LOCALLLM_MAX_IMAGE_BYTES)")
    try:
        data = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{where}: the image is not valid base64") from None
    return check_image(data, where)


def from_url(url: object, where: str) -> bytes | RemoteImage:
    """An OpenAI / Responses image URL: a ``data:`` URI decoded now, an ``http(s)`` one to fetch (when allowed)."""
    if not isinstance(url, str) or not url:
        raise bad_request(f"{where}: image_url must be a non-empty string")
    low = url[:16].lower()
    if low.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep or ";base64" not in head.lower():
            raise bad_request(f"{where}: a data: URI image must be base64 (data:image/png;base64,...)")
        return from_base64(payload, where)
    if low.startswith(("http://", "https://")):
        if not urls_allowed():
            raise bad_request(f"{where}: remote image URLs are not fetched by default; send the image as a base64 "
                              "data: URI, or start the server with LOCALLLM_IMAGE_URLS=1 to let it fetch them")
        return RemoteImage(url, where)
    if low.startswith("file:"):
        raise bad_request(f"{where}: file: URLs are never read; send the image as a base64 data: URI")
    raise bad_request(f"{where}: an image URL must be a base64 data: URI (or http(s) where the server allows it)")


def _public(host: str) -> bool:
    """Every address ``host`` resolves to is a public one (no loopback, private, link-local, reserved)."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    for info in infos:
        ip = ipaddress.ip_address(info[4][0])
        if ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_reserved or ip.is_multicast \
                or ip.is_unspecified:
            return False
    return bool(infos)


def fetch_remote(img: RemoteImage) -> bytes:
    """Fetch an allowed remote image (no redirects; size and time bounded; public addresses only)."""
    import httpx

    parts = urlsplit(img.url)
    if not parts.hostname or not _public(parts.hostname):
        raise bad_request(f"{img.where}: the image URL's host is not a public address; it is not fetched")
    limit = max_bytes()
    try:
        with httpx.Client(timeout=FETCH_TIMEOUT_S, follow_redirects=False) as client, \
                client.stream("GET", img.url) as r:
            if r.status_code != 200:
                raise bad_request(f"{img.where}: fetching the image gave HTTP {r.status_code}")
            buf = bytearray()
            for chunk in r.iter_bytes():
                buf += chunk
                if len(buf) > limit:
                    raise bad_request(f"{img.where}: the remote image is more than the {limit:,} bytes allowed")
    except httpx.HTTPError as e:
        raise bad_request(f"{img.where}: the image could not be fetched ({type(e).__name__})") from None
    return check_image(bytes(buf), img.where)


def resolve(messages: list[dict[str, object]]) -> None:
    """Fetch the remote images of ``messages`` in place (blocking: run it off the event loop)."""
    for m in messages:
        imgs = m.get("images")
        if isinstance(imgs, list) and any(isinstance(i, RemoteImage) for i in imgs):
            m["images"] = [fetch_remote(i) if isinstance(i, RemoteImage) else i for i in imgs]


__all__ = ["APIError", "RemoteImage", "check_image", "fetch_remote", "from_base64", "from_url", "image_size",
           "resolve"]
