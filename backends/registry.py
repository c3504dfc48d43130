"""Backend names to token-source classes, imported lazily (they pull heavy libraries).

Adding a backend: write ``backends/<name>.py`` with a :class:`~backends.base.TokenSource` subclass and
add one line to :data:`BACKENDS`.

    >>> sorted(BACKENDS)
    ['llamacpp', 'mlx']
"""

from __future__ import annotations

import importlib
from typing import Any

from backends.base import LoadSpec, TokenSource
from backends.loop import LoadedModel

BACKENDS: dict[str, str] = {  # name -> "module:Class"
    "llamacpp": "backends.llamacpp:LlamaCppSource",
    "mlx": "backends.mlx:MLXSource",
}


def source_class(name: str) -> type[TokenSource]:
    """``"llamacpp"`` or ``"mlx"`` → its :class:`TokenSource` class."""
    try:
        module, cls = BACKENDS[name].split(":")
    except KeyError:
        raise ValueError(f"unknown backend {name!r} (choose {' or '.join(sorted(BACKENDS))})") from None
    return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]


def available(name: str) -> tuple[bool, str]:
    """(usable on this machine, reason when not); never raises."""
    try:
        return source_class(name).available()
    except Exception as e:  # noqa: BLE001 - the module itself failed to import
        return False, str(e)


def load(backend: str | type[TokenSource], spec: LoadSpec, *, name: str = "model", **kwargs: Any) -> LoadedModel:
    """Load ``spec`` on its own decode loop. ``backend`` is a name from :data:`BACKENDS` or a class; the
    keyword arguments are :class:`~backends.loop.LoadedModel`'s (``prompt_cache``, ``before_load``...)."""
    cls = source_class(backend) if isinstance(backend, str) else backend
    return LoadedModel(cls, spec, name=name, **kwargs)
