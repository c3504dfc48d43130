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
LOCALLLM_SWA_FULL          1: sliding-window layers as long as the context      0
LOCALLLM_KV_UNIFIED        1: one KV pool for all slots, not a stream per slot  0
LOCALLLM_CPU_MOE           1: every expert tensor of a MoE model in RAM         0 (as few as needed)
LOCALLLM_NUM_PARALLEL      parallel requests (slots) per model                  auto (4 if it fits)
LOCALLLM_PROMPT_CACHE_SIZE disk for saved prompt prefixes (0 = off)             2GiB
LOCALLLM_MAX_LOADED_MODELS models loaded at once (0 = as memory allows)         0
LOCALLLM_MAX_QUEUE         queued requests before 503                           512
LOCALLLM_ORIGINS           extra CORS origins, comma separated                  (loopback only)
LOCALLLM_API_KEY           require ``Authorization: Bearer <key>``              (none)
LOCALLLM_DEBUG             verbose logs, llama.cpp's included                   0
LOCALLLM_RPC               llama.cpp RPC workers to use, host:port,...          (none)
LOCALLLM_DEVICE_MEMORY     cap per llama.cpp device: RPC0=2GiB,... or 4GiB      free memory - 512 MiB
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

    @property
    def prompt_cache(self) -> Path:
        """Saved KV states of long prompt prefixes, one directory per model digest."""
        return self.data / "prompt-cache"


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
    from backends.descriptor import KV_CACHE_TYPES

    value = env_str("LOCALLLM_KV_CACHE_TYPE", "f16").lower()
    if value not in KV_CACHE_TYPES:
        raise SystemExit(f"LOCALLLM_KV_CACHE_TYPE must be {', '.join(KV_CACHE_TYPES[:-1])} or {KV_CACHE_TYPES[-1]}, "
                         f"got {value!r}.")
    return value


def flash_attention() -> str:
    """``LOCALLLM_FLASH_ATTENTION``: ``auto`` (default: off on the CPU for generation models, whose new tokens deep in
    a long context then go ~2x faster decoding and up to ~6x in a short next turn, as llama.cpp's CPU kernel reads the
    cached keys one at a time; on where the GPU kernels cover the head size, for pooling models and for a quantized V
    cache), ``on`` or ``off`` (honoured on a GPU too; a quantized V cache keeps it on)."""
    value = env_str("LOCALLLM_FLASH_ATTENTION", "auto").lower()
    if value not in ("auto", "on", "off"):
        raise SystemExit(f"LOCALLLM_FLASH_ATTENTION must be auto, on or off, got {value!r}.")
    return value


def swa_full() -> bool:
    """``LOCALLLM_SWA_FULL=1``: sliding-window layers get a cache as long as the context (exact reuse from any
    position, at a global layer's memory); default off: the window per sequence, reuse through checkpoints."""
    return env_str("LOCALLLM_SWA_FULL", "0").lower() not in ("0", "false", "no", "off")


def kv_unified() -> bool:
    """``LOCALLLM_KV_UNIFIED=1``: llama.cpp keeps one KV pool for all of a model's slots (twice as many sequence ids,
    idle conversations kept and parked in RAM); default off: a KV stream per slot (llama-server's layout), where a
    step attends to each sequence's own cells only (8 streams decode ~10% faster). Models whose memory needs partial
    copies between sequences (sliding windows, recurrent or hybrid layers) use the unified pool either way."""
    return env_str("LOCALLLM_KV_UNIFIED", "0").lower() not in ("0", "false", "no", "off")


def cpu_moe() -> bool:
    """``LOCALLLM_CPU_MOE=1`` (``serve --cpu-moe``): a mixture of experts keeps every expert tensor in RAM
    (llama.cpp's ``--cpu-moe``); default off: the planner keeps as few layers' experts in RAM as the device needs."""
    return env_str("LOCALLLM_CPU_MOE", "0").lower() not in ("0", "false", "no", "off")


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
               "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes of ``"2GiB"``, ``"512MB"``, ``"1.5g"`` or a plain number (binary units, as disks are sold here).

    >>> parse_size("2GiB"), parse_size("512m"), parse_size("0")
    (2147483648, 536870912, 0)
    """
    import re

    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(text)
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


DEFAULT_PROMPT_CACHE = 2 << 30
DEFAULT_MAX_UPLOAD = 512 << 30
DEFAULT_UPLOAD_TIMEOUT = 60.0


def env_size(name: str, default: int, examples: str) -> int:
    """``name`` as a size in bytes (``64GiB``, ``500MB``, plain bytes), ``default`` when unset; a value that is not
    a size ends the program with one sentence naming ``examples``."""
    value = env_str(name, "")
    if not value:
        return default
    try:
        return parse_size(value)
    except ValueError:
        raise SystemExit(f"{name} must be a size like {examples}, got {value!r}.") from None


def max_upload() -> int:
    """``LOCALLLM_MAX_UPLOAD``: the largest model file ``POST /api/blobs`` takes, in bytes (default 512 GiB)."""
    return env_size("LOCALLLM_MAX_UPLOAD", DEFAULT_MAX_UPLOAD, "64GiB or 500MB")


def upload_timeout() -> float:
    """``LOCALLLM_UPLOAD_TIMEOUT``: seconds an upload's body may send nothing before the server drops it (60)."""
    value = env_str("LOCALLLM_UPLOAD_TIMEOUT", "")
    try:
        seconds = float(value) if value else DEFAULT_UPLOAD_TIMEOUT
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise SystemExit(f"LOCALLLM_UPLOAD_TIMEOUT must be a number of seconds above 0, got {value!r}.")
    return seconds


def prompt_cache_size() -> int:
    """``LOCALLLM_PROMPT_CACHE_SIZE`` in bytes (default 2 GiB; 0 turns the prompt cache off)."""
    return env_size("LOCALLLM_PROMPT_CACHE_SIZE", DEFAULT_PROMPT_CACHE, "2GiB, 500MB or 0")


def device_memory() -> dict[str, int]:
    """``LOCALLLM_DEVICE_MEMORY``: the most memory the planner may use on a llama.cpp device.

    ``"RPC0=2GiB,RPC1=512MiB"`` per device (names as ``localllm probe`` lists them), or one size for every
    device (``"4GiB"``; key ``"*"``). Unset: each device's free memory minus a margin.

    >>> import os; os.environ["LOCALLLM_DEVICE_MEMORY"] = "RPC0=1GiB, 512MiB"; device_memory()
    {'RPC0': 1073741824, '*': 536870912}
    >>> del os.environ["LOCALLLM_DEVICE_MEMORY"]
    """
    value = env_str("LOCALLLM_DEVICE_MEMORY", "")
    out: dict[str, int] = {}
    for part in (p.strip() for p in value.split(",")):
        if not part:
            continue
        name, _, size = part.rpartition("=")
        try:
            out[name.strip() or "*"] = parse_size(size)
        except ValueError:
            raise SystemExit(f"LOCALLLM_DEVICE_MEMORY must be sizes like RPC0=2GiB,CUDA0=6GiB or 4GiB, got "
                             f"{value!r}.") from None
    return out


def is_loopback(host: str) -> bool:
    """``host`` (a name or an address, no port) stays on this machine: what ``serve`` and ``worker`` bind freely.

    >>> is_loopback("127.0.0.1"), is_loopback("::1"), is_loopback("localhost"), is_loopback("0.0.0.0")
    (True, True, True, False)
    """
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_settings() -> None:
    """Read every server setting of the environment once, so a bad value stops ``serve`` at start with
    its one sentence (``SystemExit``) instead of failing each request later."""
    kv_cache_type()
    prompt_cache_size()
    device_memory()
    for name in ("LOCALLLM_NUM_PARALLEL", "LOCALLLM_CONTEXT_LENGTH", "LOCALLLM_MAX_BODY", "LOCALLLM_MAX_QUEUE",
                 "LOCALLLM_MAX_LOADED_MODELS"):
        if env_int(name, 0) < 0:
            raise SystemExit(f"{name} must be 0 or more, got {os.environ[name].strip()!r}.")
