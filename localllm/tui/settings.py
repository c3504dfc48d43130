"""The app's part of the config file (``paths().config_file``, TOML)::

    default_model = "smollm2:135m"

    [keymap]             # binding id = keys (comma separated); `localllm chat` → F1 lists the ids
    "chat.new" = "ctrl+n"
    "prompt.newline" = "ctrl+j,shift+enter"

Only ``default_model`` is ever written back, by editing that one line, so comments and other
sections of the file are kept.
"""

from __future__ import annotations

import json
import re
import tomllib
from typing import Any

from localllm.config import paths
from localllm.errors import LocalLLMError


def load_config() -> dict[str, Any]:
    """The parsed config file ({} when there is none)."""
    path = paths().config_file
    if not path.is_file():
        return {}
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise LocalLLMError(f"The config file {path} is not valid TOML: {e}.") from None


def default_model() -> str | None:
    value = load_config().get("default_model")
    return str(value) if value else None


def keymap() -> dict[str, str]:
    """``[keymap]`` as binding id → keys."""
    table = load_config().get("keymap", {})
    if not isinstance(table, dict):
        raise LocalLLMError("The [keymap] of the config file must be a table of binding id = \"keys\".")
    return {str(k): str(v) for k, v in table.items()}


_KEY_LINE = re.compile(r"^\s*default_model\s*=.*$", re.M)
_TABLE = re.compile(r"^\s*\[", re.M)


def set_default_model(name: str) -> None:
    """Write ``default_model = "name"`` into the config file, keeping everything else."""
    path = paths().config_file
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    line = f"default_model = {json.dumps(name)}"
    if _KEY_LINE.search(text.split("[", 1)[0] if _TABLE.search(text) else text):
        text = _KEY_LINE.sub(line, text, count=1)
    else:
        text = line + "\n" + text
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
