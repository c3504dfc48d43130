"""An installed model as the APIs describe it (``/api/show``, ``/api/tags``, ``/api/ps``, ``/v1/models``): its
capabilities, Ollama's ``details`` block, digest, dates and size, from the GGUF metadata cached at install."""

from __future__ import annotations

from datetime import UTC
from typing import Any

from localllm.ggufinfo import capabilities_of
from localllm.store import InstalledModel
from localllm.thinking import thinks


def template_supports_tools(template: str | None) -> bool:
    """Whether a chat template renders tools (it reads a ``tools`` variable)."""
    return template is not None and "tools" in template


def info_of(model: InstalledModel) -> dict[str, Any]:
    """The GGUF metadata cached at install (``GGUFInfo.as_dict()``)."""
    return model.info or {}


def capabilities(model: InstalledModel) -> list[str]:
    """What a model can do, as ``/api/show`` lists it."""
    info = info_of(model)
    pooled = capabilities_of(info)
    if pooled is not None:  # an embedding / rerank model: no completion
        return pooled
    caps = ["completion"]
    if template_supports_tools(info.get("chat_template")):
        caps.append("tools")
    extra = info.get("extra") or {}
    if extra.get("vision") or (model.projector is not None and model.projector.vision):
        caps.append("vision")
    if model.projector is not None and model.projector.audio:
        caps.append("audio")
    if thinks(info):
        caps.append("thinking")
    return caps


def details_of(model: InstalledModel) -> dict[str, Any]:
    """Ollama's ``details`` block."""
    info = info_of(model)
    arch = info.get("architecture") or ""
    params = info.get("parameters") or 0
    label = info.get("parameter_label")
    if not label and params:
        label = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{round(params / 1e6)}M"
    return {
        "parent_model": model.base or "",
        "format": "gguf",  # every installed model has its GGUF (MLX weights come beside it)
        "family": arch,
        "families": [arch] if arch else None,
        "parameter_size": label or "",
        "quantization_level": info.get("file_type") or model.quant or "",
    }


def digest_hex(digest: str | None) -> str:
    """``sha256:<hex>`` → ``<hex>`` (as ``/api/tags`` and ``/api/ps`` write it)."""
    d = digest or ""
    return d.split(":", 1)[1] if ":" in d else d


def modified_of(model: InstalledModel) -> str:
    return model.modified.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def modified_ts(model: InstalledModel) -> int:
    return int(model.modified.timestamp())


def size_of(model: InstalledModel) -> int:
    return int(model.size or info_of(model).get("file_size") or 0)


def projector_info(model: InstalledModel) -> dict[str, Any] | None:
    """Ollama's ``projector_info``: the projector GGUF's scalar metadata (``clip.*``, ``general.architecture``)."""
    if model.projector is None:
        return None
    from localllm.ggufinfo import projector_metadata

    return projector_metadata(model.projector.path)
