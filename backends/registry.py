"""Backend names to token-source classes, imported lazily (they pull heavy libraries), and loading one.

The names and everything else about a backend are its descriptor's (:mod:`backends.descriptor`); adding a
backend is its ``backends/<name>.py`` with a :class:`~backends.contract.source.TokenSource` subclass and one
:func:`~backends.descriptor.register` call.

    >>> sorted(BACKENDS)
    ['llamacpp', 'mlx']
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, cast

from backends import descriptor
from backends.contract.source import TokenSource
from backends.contract.specs import LoadSpec
from backends.core.loop import LoadedModel


class _Sources(Mapping[str, str]):
    """name -> "module:Class", read from the descriptors each time (a backend registered later is in it)."""

    def __getitem__(self, name: str) -> str:
        if name not in descriptor.names():
            raise KeyError(name)
        return descriptor.get(name).source

    def __iter__(self) -> Iterator[str]:
        return iter(descriptor.names())

    def __len__(self) -> int:
        return len(descriptor.names())


BACKENDS: Mapping[str, str] = _Sources()


def source_class(name: str) -> type[TokenSource]:
    """A backend's name → its :class:`TokenSource` class."""
    return cast("type[TokenSource]", descriptor.get(name).source_class())


def available(name: str) -> tuple[bool, str]:
    """(usable on this machine, reason when not); never raises."""
    try:
        return descriptor.get(name).available()
    except ValueError as e:
        return False, str(e)


def load(backend: str | type[TokenSource], spec: LoadSpec, *, name: str = "model", **kwargs: Any) -> LoadedModel:
    """Load ``spec`` on its own decode loop. ``backend`` is a registered name or a class; the keyword
    arguments are :class:`~backends.core.loop.LoadedModel`'s (``prompt_cache``, ``before_load``...)."""
    cls = source_class(backend) if isinstance(backend, str) else backend
    return LoadedModel(cls, spec, name=name, **kwargs)
