"""Model names: parse and validate what a user typed before anything touches the disk.

Three kinds of name are accepted::

    >>> parse_name("smollm2:135m", allow_path=False).name          # a catalog alias (or a copy's name)
    'smollm2:135m'
    >>> parse_name("Qwen2.5:7B-Q8_0", allow_path=False).quant      # alias with a quant suffix
    'Q8_0'
    >>> parse_name("hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:q4_k_m", allow_path=False).name
    'hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M'

A path to a local ``.gguf`` (``./model.gguf``, ``/models/x.gguf``) gives ``kind == "path"``, but only
with ``allow_path=True``.

Everything else raises :class:`InvalidNameError` with one sentence: names that would leave the models
directory (``../x``, ``/etc/passwd`` given to ``pull``, ``hf.co/../x``), control characters, empty or
absurdly long names. A name that parses is safe to use as a relative path under the store
(:meth:`ModelRef.storage_parts`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from localllm.errors import InvalidNameError

MAX_NAME_LEN = 200
DEFAULT_HF_QUANT = "Q4_K_M"

# a path component of an alias: lowercase, digits, '.', '_', '-'; starts with a letter or digit
_ALIAS_PART = r"[a-z0-9][a-z0-9._-]{0,79}"
_ALIAS_RE = re.compile(rf"^(?P<model>{_ALIAS_PART})(?::(?P<tag>{_ALIAS_PART}))?$")
# Hugging Face user / repo names (the Hub allows letters, digits, '-', '_', '.'; no leading '.' or '-')
_HF_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_HF_RE = re.compile(rf"^(?P<user>{_HF_PART})/(?P<repo>{_HF_PART})(?::(?P<quant>[A-Za-z0-9][A-Za-z0-9._-]{{0,39}}))?$")
_HF_PREFIXES = ("hf.co/", "huggingface.co/", "https://huggingface.co/", "https://hf.co/")
# quantization suffix of an alias tag: "135m-q4_k_m", "7b-f16", "1b-iq4_xs", "8b-bf16"
_QUANT_SUFFIX_RE = re.compile(r"-(?P<quant>(?:i?q\d[a-z0-9_]*)|f16|f32|bf16)$")


@dataclass(frozen=True)
class ModelRef:
    """A parsed model name. ``name`` is the canonical form, used as the installed model's name."""

    kind: Literal["alias", "hf", "path"]
    name: str
    repo: str | None = None  # "user/repo" for kind == "hf"
    quant: str | None = None  # upper case, e.g. "Q4_K_M"; None = the default
    path: Path | None = None  # kind == "path": the resolved file

    @property
    def base(self) -> str:
        """The alias without its quant suffix (``qwen2.5:7b-q8_0`` → ``qwen2.5:7b``); else ``name``."""
        if self.kind == "alias" and self.quant:
            return self.name[: -(len(self.quant) + 1)]
        return self.name

    def storage_parts(self) -> tuple[str, ...]:
        """Relative path components for this name's manifest (every part already validated).

        >>> parse_name("smollm2:135m", allow_path=False).storage_parts()
        ('library', 'smollm2', '135m')
        >>> parse_name("hf.co/u/r:Q8_0", allow_path=False).storage_parts()
        ('hf.co', 'u', 'r', 'Q8_0')
        """
        if self.kind == "path":
            raise InvalidNameError("A local file is used in place and has no entry in the store.")
        if self.kind == "hf":
            user, repo = (self.repo or "").split("/")
            return ("hf.co", user, repo, self.quant or "default")
        model, _, tag = self.name.partition(":")
        return ("library", model, tag or "latest")


def _show(text: str) -> str:
    """The name as it can be printed in one line: escaped and shortened."""
    r = repr(text)
    return r if len(r) <= 60 else r[:50] + "…" + r[-8:]


def _looks_like_path(text: str) -> bool:
    return (
        "/" in text or "\\" in text or text.startswith(("~", ".")) or text.lower().endswith(".gguf")
    )


def parse_name(text: str, *, allow_path: bool) -> ModelRef:
    """Parse ``text`` into a :class:`ModelRef` or raise :class:`InvalidNameError`.

    ``allow_path`` says whether a local ``.gguf`` path is acceptable (``run``, ``show``); ``pull`` and
    the store's own names pass ``False``. A path is only checked to exist here; its contents are
    validated when it is opened (``Store.get``).

    >>> parse_name("../../etc/passwd", allow_path=False)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    localllm.errors.InvalidNameError: '../../etc/passwd' is a file path, not a model name (try ...).
    """
    if not isinstance(text, str):
        raise InvalidNameError(f"A model name must be text, not {type(text).__name__}.")
    if any(ord(c) < 32 or ord(c) == 127 or 0x80 <= ord(c) < 0xA0 for c in text):
        raise InvalidNameError(f"The model name {_show(text)} contains control characters.")
    text = text.strip()
    if not text:
        raise InvalidNameError("A model name cannot be empty.")
    if len(text) > MAX_NAME_LEN:
        raise InvalidNameError(f"That model name is {len(text)} characters long; the limit is {MAX_NAME_LEN}.")

    lowered = text.lower()
    for prefix in _HF_PREFIXES:
        if lowered.startswith(prefix):
            return _parse_hf(text, text[len(prefix):])

    if _looks_like_path(text):
        if not allow_path:
            raise InvalidNameError(
                f"{_show(text)} is a file path, not a model name "
                "(try a name like smollm2:135m or hf.co/user/repo:Q4_K_M)."
            )
        path = Path(text).expanduser()
        if not path.is_file():
            raise InvalidNameError(f"{_show(text)} looks like a file path, but there is no such file.")
        return ModelRef(kind="path", name=str(path.resolve()), path=path.resolve())

    m = _ALIAS_RE.match(lowered)
    if not m or ".." in lowered:
        raise InvalidNameError(
            f"{_show(text)} is not a valid model name: use letters, digits, '.', '_' and '-', "
            "like smollm2:135m or qwen2.5:7b-q8_0."
        )
    tag = m.group("tag") or ""
    q = _QUANT_SUFFIX_RE.search(tag)
    quant = q.group("quant").upper() if q and q.start() > 0 else None
    return ModelRef(kind="alias", name=lowered, quant=quant)


def _parse_hf(text: str, rest: str) -> ModelRef:
    m = _HF_RE.match(rest)
    if not m or ".." in rest:
        raise InvalidNameError(
            f"{_show(text)} is not a valid Hugging Face model name; expected hf.co/user/repo or "
            "hf.co/user/repo:QUANT."
        )
    repo = f"{m.group('user')}/{m.group('repo')}"
    quant = m.group("quant").upper() if m.group("quant") else None
    name = f"hf.co/{repo}:{quant}" if quant else f"hf.co/{repo}"
    return ModelRef(kind="hf", name=name, repo=repo, quant=quant)
