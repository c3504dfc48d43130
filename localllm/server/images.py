"""Images as the APIs send them → checked bytes for the backend, each bad one a 400 in the API's own shape.

Every face decodes here: Ollama's ``images`` (base64 strings), OpenAI's ``image_url`` parts and Responses'
``input_image`` (``data:`` URIs), Anthropic's ``image`` blocks (``source.type == "base64"``). What is checked,
before anything reaches the projector:

* base64 that decodes, a ``data:`` URI that is well formed;
* size, format and the declared pixel count (decompression bombs): :mod:`localllm.images`, shared with the
  CLI and the TUI.

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
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from localllm import audio as core_audio
from localllm import images as core
from localllm.images import max_bytes
from localllm.server.audio import SentAudio, check_clip
from localllm.server.errors import APIError, bad_request

FETCH_TIMEOUT_S = 10.0


def urls_allowed() -> bool:
    return os.environ.get("LOCALLLM_IMAGE_URLS", "") not in ("", "0", "false", "no")


class SentImage(bytes):
    """An image's bytes as a request sent them (decoded, size-checked), with where in the request it was
    (``messages[0].images[1]``): its format and pixel count are checked by :func:`check_request` once the model
    is known to take images, so a text-only model answers "does not support images" first, as Ollama does."""

    where: str = "image"


def sent(data: bytes, where: str) -> SentImage:
    img = SentImage(data)
    img.where = where
    return img


@dataclass(frozen=True)
class RemoteImage:
    """An ``http(s)`` image URL a request named, fetched by :func:`resolve` before the engine is called."""

    url: str
    where: str


def image_size(data: bytes) -> tuple[str, int, int] | None:
    return core.image_size(data)


def check_image(data: bytes, where: str) -> bytes:
    """``data`` if it is an image we accept; else a 400 naming ``where`` and what is wrong."""
    try:
        return core.check_image(data, where)
    except core.ImageError as e:
        raise bad_request(str(e)) from None


def from_base64(text: object, where: str) -> bytes:
    """Decode a base64 image (Ollama's and Anthropic's form) and check it. An audio clip in Ollama's ``images``
    (as Ollama takes it) may be as large as audio is allowed to be; it is checked as audio later."""
    if not isinstance(text, str):
        raise bad_request(f"{where}: an image must be a base64 string")
    if len(text) > max(max_bytes(), core_audio.max_bytes()) * 4 // 3 + 8:
        raise bad_request(f"{where}: the image is more than the {max_bytes():,} bytes allowed "
                          "(LOCALLLM_MAX_IMAGE_BYTES)")
    try:
        data = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{where}: the image is not valid base64") from None
    if len(data) > max_bytes() and not core_audio.is_audio(data):
        raise bad_request(f"{where}: the image is {len(data):,} bytes, more than the {max_bytes():,} allowed "
                          "(LOCALLLM_MAX_IMAGE_BYTES)")
    return sent(data, where)


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


def check_media(data: bytes, where: str) -> bytes:
    """An image or an audio clip (told apart by magic bytes, or sent as ``input_audio``), checked as what it is."""
    if isinstance(data, SentAudio):
        return check_clip(data, where, data.fmt)
    if core_audio.is_audio(data) or core_audio.other_format(data):
        return check_clip(data, where)
    return check_image(data, where)


def check_request(messages: list[dict[str, object]] | None, images: list[bytes] | None = None) -> None:
    """Check every image (format, declared pixels) and audio clip (format, size, declared duration) of a request
    (a 400 naming the first bad one)."""
    for m in messages or []:
        imgs = m.get("images")
        for i in imgs if isinstance(imgs, list) else []:
            if isinstance(i, bytes):
                check_media(i, getattr(i, "where", "image"))
    for n, i in enumerate(images or []):
        check_media(i, getattr(i, "where", f"images[{n}]"))


def media_kinds(messages: list[dict[str, Any]] | None, images: list[bytes] | None = None) -> tuple[bool, bool]:
    """(some image, some audio clip) among a request's media: what the model must take."""
    items: list[object] = [i for m in messages or [] for i in (m.get("images") or [])]
    items += list(images or [])
    sound = [isinstance(i, SentAudio) or (isinstance(i, bytes) and (core_audio.is_audio(i)
                                                                     or core_audio.other_format(i) is not None))
             for i in items]
    return (not all(sound)) if items else True, any(sound)


__all__ = ["APIError", "RemoteImage", "check_image", "fetch_remote", "from_base64", "from_url", "image_size",
           "resolve"]
