"""Paths and settings. Every path is under platformdirs' dirs, or under ``$LOCALLLM_HOME`` when set.

Environment variables (all documented in the README):

=========================  ===================================================  ==================
variable                   meaning                                              default
=========================  ===================================================  ==================
LOCALLLM_HOME              one root for models, cache, config, chats            platformdirs dirs
LOCALLLM_MODELS            where installed models live                          <data>/models
LOCALLLM_HOST              server address (serve binds it, faces attach to it)  127.0.0.1:11434
LOCALLLM_KEEP_ALIVE        how long an idle model stays loaded                  5m
LOCALLLM_KV_CACHE_TYPE     f16 | q8_0 | q4_0                                    f16
LOCALLLM_NUM_PARALLEL      parallel requests per model                          1
LOCALLLM_MAX_LOADED_MODELS models loaded at once (0 = as memory allows)         0
LOCALLLM_MAX_QUEUE         queued requests before 503                           512
LOCALLLM_ORIGINS           extra CORS origins, comma separated                  (loopback only)
LOCALLLM_API_KEY           require ``Authorization: Bearer <key>``              (none)
LOCALLLM_DEBUG             verbose logs, llama.cpp's included                   0
=========================  ===================================================  ==================
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

APP = "localllm"
DEFAULT_MODEL = "smollm2:135m"
DEFAULT_HOST = "127.0.0.1:11434"


@dataclass(frozen=True)
class Paths:
    data: Path  # models, chats
    cache: Path  # downloads in flight
    config: Path  # settings, keymap
    models: Path  # installed models (manifests + blobs)

    @property
    def blobs(self) -> Path:
        return self.models / "blobs"

    @property
    def manifests(self) -> Path:
        return self.models / "manifests"

    @property
    def downloads(self) -> Path:
        return self.cache / "downloads"

    @property
    def chats_db(self) -> Path:
        return self.data / "chats.sqlite3"

    @property
    def config_file(self) -> Path:
        return self.config / "config.toml"


def paths() -> Paths:
    """Resolve the directories now (env vars are read at call time, so tests can set them)."""
    home = os.environ.get("LOCALLLM_HOME")
    if home:
        root = Path(home).expanduser()
        data, cache, config = root / "data", root / "cache", root / "config"
    else:
        import platformdirs

        data = Path(platformdirs.user_data_dir(APP))
        cache = Path(platformdirs.user_cache_dir(APP))
        config = Path(platformdirs.user_config_dir(APP))
    models_env = os.environ.get("LOCALLLM_MODELS")
    models = Path(models_env).expanduser() if models_env else data / "models"
    return Paths(data=data, cache=cache, config=config, models=models)


def env_str(name: str, default: str) -> str:
    value = os.environ.get(name, "").strip()
    return value or default


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"{name} must be an integer, got {value!r}.") from None


def host() -> str:
    """``host:port`` to bind or attach to (``LOCALLLM_HOST``; a bare port or scheme is accepted)."""
    value = env_str("LOCALLLM_HOST", DEFAULT_HOST)
    for prefix in ("http://", "https://"):
        if value.startswith(prefix):
            value = value[len(prefix):]
    value = value.rstrip("/")
    if value.startswith(":"):
        value = "127.0.0.1" + value
    if ":" not in value:
        value = value + ":11434"
    return value


def kv_cache_type() -> str:
    value = env_str("LOCALLLM_KV_CACHE_TYPE", "f16").lower()
    if value not in ("f16", "q8_0", "q4_0"):
        raise SystemExit(f"LOCALLLM_KV_CACHE_TYPE must be f16, q8_0 or q4_0, got {value!r}.")
    return value
