"""What both APIs share: request errors, model-name checks, Ollama options → engine options, the
store behind a thread, and error messages safe to send (no paths, no tracebacks)."""

from __future__ import annotations

import asyncio
import logging
import re
from datetime import UTC, datetime
from typing import Any

from localllm.engine import LoadOptions, Sampling, parse_keep_alive
from localllm.errors import InvalidNameError, LocalLLMError
from localllm.names import parse_name

log = logging.getLogger("localllm.server")

# Ollama's answer to /api/version: clients gate features on it, so report a recent Ollama.
OLLAMA_COMPAT_VERSION = "0.12.0"
DIGEST_RE = re.compile(r"^sha256[:-][0-9a-fA-F]{64}$")
MAX_NUM_CTX = 1 << 20
MAX_PREDICT = 1 << 20


class APIError(Exception):
    """An error with an HTTP status; rendered as ``{"error": msg}`` (Ollama) or OpenAI's shape (/v1)."""

    def __init__(self, status: int, message: str, *, type_: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param


def bad_request(message: str) -> APIError:
    return APIError(400, message)


def now_rfc3339() -> str:
    """``created_at`` as Ollama writes it (RFC 3339 with nanoseconds, UTC)."""
    t = datetime.now(UTC)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond:06d}000Z"


def rfc3339(ts: float | None) -> str:
    if ts is None:  # "never": Ollama shows a far-future time
        return "2318-11-26T00:00:00Z"
    t = datetime.fromtimestamp(ts, UTC)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond:06d}000Z"


def check_name(value: Any, field: str = "model") -> str:
    """A model name from a request: a name, never a path. Raises a 400 with one sentence."""
    if value is None or value == "":
        raise bad_request(f"{field} is required")
    try:
        return parse_name(value, allow_path=False).name
    except InvalidNameError as e:
        raise bad_request(str(e)) from None


def check_digest(value: str) -> str:
    """``sha256:<64 hex>`` (or ``sha256-``); anything else is refused before it can reach a path."""
    if not isinstance(value, str) or not DIGEST_RE.match(value):
        raise bad_request(f"invalid digest format: expected sha256:<64 hex digits>, got {scrub(str(value))[:80]!r}")
    return "sha256:" + value[7:].lower()


def keep_alive_of(value: Any) -> float | None:
    if value is None:
        return None
    try:
        return parse_keep_alive(value)
    except LocalLLMError as e:
        raise bad_request(str(e)) from None


_NUMBER = (int, float)
# Ollama option -> (type check, kind) ; kind "load" forces a reload when it changes
_OPTION_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "num_ctx": ((int,), "integer"), "num_gpu": ((int,), "integer"), "num_thread": ((int,), "integer"),
    "num_batch": ((int,), "integer"), "main_gpu": ((int,), "integer"), "num_keep": ((int,), "integer"),
    "seed": ((int,), "integer"), "num_predict": ((int,), "integer"), "top_k": ((int,), "integer"),
    "repeat_last_n": ((int,), "integer"), "draft_num_predict": ((int,), "integer"),
    "temperature": (_NUMBER, "number"), "top_p": (_NUMBER, "number"), "min_p": (_NUMBER, "number"),
    "typical_p": (_NUMBER, "number"), "repeat_penalty": (_NUMBER, "number"),
    "presence_penalty": (_NUMBER, "number"), "frequency_penalty": (_NUMBER, "number"),
    "use_mmap": ((bool,), "boolean"), "numa": ((bool,), "boolean"), "low_vram": ((bool,), "boolean"),
    "penalize_newline": ((bool,), "boolean"),
    "stop": ((list, str), "array"),
}


def _int_like(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) or (isinstance(v, float) and v.is_integer())


def options_of(options: dict[str, Any] | None, *, defaults: dict[str, Any] | None = None
               ) -> tuple[Sampling, LoadOptions]:
    """Ollama ``options`` → (Sampling, LoadOptions). Unknown keys are ignored (logged) as Ollama does;
    a wrong type or an impossible value is a 400 with one sentence.

    >>> s, lo = options_of({"temperature": 0, "num_predict": 5, "num_ctx": 1024, "stop": "\\n"})
    >>> s.temperature, s.max_tokens, s.stop, lo.num_ctx
    (0.0, 5, ['\\n'], 1024)
    """
    opts = dict(defaults or {})
    if options is not None and not isinstance(options, dict):
        raise bad_request("options must be an object")
    opts.update(options or {})
    for key, value in list(opts.items()):
        if key not in _OPTION_TYPES:
            log.warning("invalid option provided: %s", key)
            del opts[key]
            continue
        if value is None:
            del opts[key]
            continue
        types, kind = _OPTION_TYPES[key]
        if kind == "integer":
            ok = _int_like(value)
            if ok:
                opts[key] = int(value)
        elif kind == "number":
            ok = isinstance(value, _NUMBER) and not isinstance(value, bool)
            if ok:
                opts[key] = float(value)
                if opts[key] != opts[key] or abs(opts[key]) == float("inf"):
                    raise bad_request(f'option "{key}" must be a finite number')
        elif kind == "boolean":
            ok = isinstance(value, bool)
        else:
            ok = isinstance(value, str) or (isinstance(value, list) and all(isinstance(s, str) for s in value))
        if not ok:
            raise bad_request(f'option "{key}" must be of type {kind}')

    s = Sampling()
    if "temperature" in opts:
        if opts["temperature"] < 0:
            raise bad_request('option "temperature" must not be negative')
        s.temperature = opts["temperature"]
    if "top_k" in opts:
        s.top_k = max(0, opts["top_k"])
    if "top_p" in opts:
        s.top_p = min(1.0, max(0.0, opts["top_p"]))
    if "min_p" in opts:
        s.min_p = min(1.0, max(0.0, opts["min_p"]))
    if "repeat_penalty" in opts:
        if opts["repeat_penalty"] < 0:
            raise bad_request('option "repeat_penalty" must not be negative')
        s.repeat_penalty = opts["repeat_penalty"]
    if "repeat_last_n" in opts:
        s.repeat_last_n = opts["repeat_last_n"]
    for key in ("presence_penalty", "frequency_penalty"):
        if key in opts:
            setattr(s, key, opts[key])
    if "seed" in opts:
        s.seed = None if opts["seed"] < 0 else opts["seed"] % (1 << 32)
    if "num_predict" in opts:
        n = opts["num_predict"]
        s.max_tokens = -1 if n < 0 else min(n, MAX_PREDICT)
    if "stop" in opts:
        stop = opts["stop"]
        s.stop = [stop] if isinstance(stop, str) else [x for x in stop if x]

    num_ctx = opts.get("num_ctx")
    if num_ctx is not None and not 1 <= num_ctx <= MAX_NUM_CTX:
        raise bad_request(f'option "num_ctx" must be between 1 and {MAX_NUM_CTX}')
    num_gpu = opts.get("num_gpu")
    if num_gpu is not None and num_gpu < 0:
        num_gpu = None  # -1 = auto
    num_thread = opts.get("num_thread")
    if num_thread is not None and num_thread <= 0:
        num_thread = None  # 0 = auto
    if num_thread is not None and num_thread > 1024:
        raise bad_request('option "num_thread" must be at most 1024')
    draft_n = opts.get("draft_num_predict")
    load = LoadOptions(
        num_ctx=num_ctx,
        num_gpu=min(num_gpu, 100000) if num_gpu is not None else None,
        num_thread=num_thread,
        **({"num_draft": max(1, min(draft_n, 64))} if draft_n else {}),
    )
    return s, load


def check_format(value: Any) -> str | dict[str, Any] | None:
    """Ollama's ``format``: ``"json"``, a JSON Schema object, or nothing."""
    if value is None or value == "":
        return None
    if value == "json":
        return "json"
    if isinstance(value, dict):
        return value
    raise bad_request(f'invalid format: expected "json" or a JSON schema object, got {scrub(str(value))[:60]!r}')


# ---------------------------------------------------------------------------------------- store access


async def run_sync(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run blocking work (store, loads) off the event loop."""
    return await asyncio.to_thread(fn, *args, **kwargs)


def template_supports_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template  # type: ignore[operator]


def info_of(model: Any) -> dict[str, Any]:
    info = getattr(model, "info", None)
    if info is None:
        return {}
    if isinstance(info, dict):
        return info
    from dataclasses import asdict, is_dataclass

    return asdict(info) if is_dataclass(info) else dict(vars(info))


def capabilities(model: Any) -> list[str]:
    """What a model can do, as ``/api/show`` lists it."""
    info = info_of(model)
    caps = ["completion"]
    if template_supports_tools(info.get("chat_template")):
        caps.append("tools")
    extra = info.get("extra") or {}
    if extra.get("vision") or getattr(model, "vision", False):
        caps.append("vision")
    return caps


def details_of(model: Any) -> dict[str, Any]:
    """Ollama's ``details`` block."""
    info = info_of(model)
    arch = info.get("architecture") or ""
    params = info.get("parameters") or 0
    label = info.get("parameter_label")
    if not label and params:
        label = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{round(params / 1e6)}M"
    return {
        "parent_model": "",
        "format": "mlx" if getattr(model, "path", None) is None and getattr(model, "mlx_path", None) else "gguf",
        "family": arch,
        "families": [arch] if arch else None,
        "parameter_size": label or "",
        "quantization_level": info.get("file_type") or getattr(model, "quant", None) or "",
    }


def digest_hex(model: Any) -> str:
    d = str(getattr(model, "digest", "") or "")
    return d.split(":", 1)[1] if ":" in d else d


def modified_of(model: Any) -> str:
    for attr in ("modified_at", "modified", "installed_at", "mtime"):
        v = getattr(model, attr, None)
        if v is None:
            continue
        if isinstance(v, datetime):
            return v.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        if isinstance(v, int | float):
            return rfc3339(float(v))
        return str(v)
    return now_rfc3339()


def modified_ts(model: Any) -> int:
    for attr in ("modified_at", "modified", "installed_at", "mtime"):
        v = getattr(model, attr, None)
        if isinstance(v, datetime):
            return int(v.timestamp())
        if isinstance(v, int | float):
            return int(v)
    return 0


def size_of(model: Any) -> int:
    for attr in ("size", "size_bytes"):
        v = getattr(model, attr, None)
        if isinstance(v, int):
            return v
    return int(info_of(model).get("file_size") or 0)


# ------------------------------------------------------------------------------------- safe messages

_PATH_RE = re.compile(r"(?<![\w.:/~-])(?:[A-Za-z]:\\|~?/)(?:[^\s'\"():,;<>]+[/\\])+([^\s'\"():,;<>]*)")


def scrub(message: str) -> str:
    """Drop directories from any filesystem path in ``message`` (the file name stays), and keep it
    to one line: error bodies never reveal the layout of the machine.

    >>> scrub("cannot open /home/me/.local/share/localllm/models/blobs/sha256-ab: no such file")
    'cannot open sha256-ab: no such file'
    >>> scrub("see hf.co/user/repo and https://example.com/a/b")
    'see hf.co/user/repo and https://example.com/a/b'
    """
    text = _PATH_RE.sub(lambda m: m.group(1) or "<path>", str(message))
    return " ".join(text.split())[:2000]


def status_of(e: BaseException) -> tuple[int, str]:
    """An exception from the engine / store → (HTTP status, safe one-line message)."""
    from localllm.engine import BackendError, ContextOverflowError, ServerBusyError, UnsupportedError
    from localllm.errors import InvalidModelFileError, ModelNotFoundError, PlanError, PullError

    if isinstance(e, APIError):
        return e.status, scrub(e.message)
    if isinstance(e, ServerBusyError):
        return 503, str(e)
    if isinstance(e, ModelNotFoundError):
        return 404, scrub(str(e))
    if isinstance(e, InvalidNameError | UnsupportedError | ContextOverflowError):
        return 400, scrub(str(e))
    if isinstance(e, PlanError | InvalidModelFileError | PullError | BackendError):
        return 500, scrub(str(e))
    if isinstance(e, LocalLLMError):
        return 400, scrub(str(e))
    log.exception("internal error", exc_info=e)
    return 500, "internal server error"
