"""What every API shares: request errors and their shape per API, model-name checks, Ollama options → engine
options, ``think`` and logprobs checks, JSON schemas the grammar can follow, tool calls in one shape, stream
frames (NDJSON, SSE), the store behind a thread, and error messages safe to send (no paths, no tracebacks)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
from datetime import UTC, datetime
from typing import Any

from localllm.engine import LoadOptions, Sampling, parse_keep_alive
from localllm.errors import InvalidNameError, LocalLLMError
from localllm.names import parse_name
from localllm.store import InstalledModel

log = logging.getLogger("localllm.server")

# Ollama's answer to /api/version: clients gate features on it, so report a recent Ollama.
OLLAMA_COMPAT_VERSION = "0.12.0"
DIGEST_RE = re.compile(r"^sha256[:-][0-9a-fA-F]{64}$")
MAX_NUM_CTX = 1 << 20
MAX_PREDICT = 1 << 20
MAX_TOP_LOGPROBS = 20


class APIError(Exception):
    """An error with an HTTP status; rendered as ``{"error": msg}`` (Ollama) or OpenAI's shape (/v1)."""

    def __init__(self, status: int, message: str, *, type_: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


# ------------------------------------------------------------------------------------- error shapes

OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error", 503: "api_error"}
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                   503: "overloaded_error", 529: "overloaded_error"}


def api_of(path: str) -> str:
    """Which API a path belongs to, for the shape of its errors: "anthropic", "openai" or "ollama".

    >>> api_of("/v1/messages"), api_of("/v1/responses"), api_of("/api/chat")
    ('anthropic', 'openai', 'ollama')
    """
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return "anthropic"
    return "openai" if path == "/v1" or path.startswith("/v1/") else "ollama"


def error_payload(path: str, status: int, message: str, *, param: str | None = None) -> dict[str, Any]:
    """The error body of the API ``path`` belongs to: Ollama's ``{"error": msg}``, OpenAI's
    ``{"error": {message, type, param, code}}``, Anthropic's ``{"type": "error", "error": {type, message}}``.

    >>> error_payload("/v1/messages", 404, "no such model")["error"]
    {'type': 'not_found_error', 'message': 'no such model'}
    """
    api = api_of(path)
    if api == "anthropic":
        kind = ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": message},
                "request_id": f"req_{secrets.token_hex(12)}"}
    if api == "openai":
        kind = OPENAI_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
        return {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return {"error": message}


# ------------------------------------------------------------------------------------------ frames


def ndjson(obj: Any) -> bytes:
    """One NDJSON line (Ollama's streams)."""
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode()


def sse(obj: Any, event: str | None = None) -> bytes:
    """One server-sent event: ``data: {...}`` (Chat Completions), with ``event: <type>`` before it
    (Responses, Anthropic Messages)."""
    data = b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"
    return b"event: " + event.encode() + b"\n" + data if event else data


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


def api_options(options: Any, defaults: dict[str, Any] | None = None, *, max_tokens: Any = None,
                max_field: str = "max_tokens", stop: Any = None, **fields: Any) -> tuple[Sampling, LoadOptions]:
    """The sampling fields of the OpenAI and Anthropic APIs (plus the ``options`` extension: any Ollama
    option) → (Sampling, LoadOptions). Explicit top-level fields win over ``options``, which win over the
    API's ``defaults``; fields left out (None) do not count."""
    opts: dict[str, Any] = dict(defaults or {})
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("options must be an object", param="options")
        opts.update(options)
    opts.update({k: v for k, v in fields.items() if v is not None})
    if max_tokens is not None:
        if max_tokens < 1:
            raise bad_request(f"{max_field} must be at least 1", param=max_field)
        opts["num_predict"] = max_tokens
    if stop is not None:
        opts["stop"] = [stop] if isinstance(stop, str) else list(stop)
        if len(opts["stop"]) > 16:
            raise bad_request("stop takes at most 16 sequences", param="stop")
    return options_of(opts)


_EFFORT = {"none": False, "minimal": "low", "low": "low", "medium": "medium", "high": "high", "max": "high",
           "xhigh": "high", "ultra": "high"}


def think_from_effort(effort: Any, field: str = "reasoning_effort") -> Any:
    """OpenAI's ``reasoning_effort`` (or ``reasoning.effort``) → ``think``, as Ollama maps it: none → off,
    minimal → low, low/medium/high as they are, max/xhigh/ultra → the highest; unset → the model's default.

    >>> think_from_effort("none"), think_from_effort("minimal"), think_from_effort(None)
    (False, 'low', None)
    """
    if effort is None or effort == "":
        return None
    if not isinstance(effort, str) or effort not in _EFFORT:
        raise bad_request(f"invalid reasoning value: {json.dumps(effort)[:40]} (must be none, minimal, low, "
                          "medium, high, max, xhigh or ultra)", param=field)
    return _EFFORT[effort]


def check_format(value: Any, field: str = "format") -> str | dict[str, Any] | None:
    """Ollama's ``format``: ``"json"``, a JSON Schema object the grammar can follow, or nothing."""
    if value is None or value == "":
        return None
    if value == "json":
        return "json"
    if isinstance(value, dict):
        problem = schema_problem(value)
        if problem:
            raise bad_request(f"{field}: {problem}", param=field)
        return value
    raise bad_request(f'invalid format: expected "json" or a JSON schema object, got {scrub(str(value))[:60]!r}')


def schema_problem(schema: Any) -> str | None:
    """The first thing in a JSON schema the backend that will follow it cannot express (one sentence), or None:
    the backends' own rules (:func:`localllm.hardware.schema_problem`)."""
    from localllm.hardware import schema_problem as backend_schema_problem

    return backend_schema_problem(schema)


def check_tools(tools: Any, field: str = "tools") -> list[dict[str, Any]] | None:
    """Tools in OpenAI's/Ollama's shape (``{"type": "function", "function": {name, description, parameters}}``);
    a malformed one is a 400 naming it."""
    if not tools:
        return None
    if not isinstance(tools, list):
        raise bad_request(f"{field} must be a list", param=field)
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"{field}[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                              param=field)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"{field}[{i}].function.parameters must be a JSON schema object", param=field)
    return tools


def forced_tools(choice: Any) -> list[str] | None:
    """A ``tool_choice`` that forces a call → the tools it allows ([] = any); None when the model decides.
    Reads OpenAI's (``"required"``, ``{"type": "function", "function": {"name"}}``), the Responses API's
    (``{"type": "function", "name"}``) and Anthropic's (``{"type": "any"}``, ``{"type": "tool", "name"}``).

    >>> forced_tools("required"), forced_tools({"type": "tool", "name": "f"}), forced_tools("auto")
    ([], ['f'], None)
    """
    if choice in ("required", "any"):
        return []
    if not isinstance(choice, dict):
        return None
    kind = choice.get("type")
    if kind in ("any", "required"):
        return []
    if kind in ("function", "tool"):
        fn = choice.get("function")
        name = choice.get("name") or (fn.get("name") if isinstance(fn, dict) else None)
        if not isinstance(name, str) or not name:
            raise bad_request("tool_choice must name the tool it forces", param="tool_choice")
        return [name]
    return None


def check_think(value: Any, field: str = "think") -> Any:
    """A request's ``think`` (True, False, "low", "medium", "high", "max"); Ollama's message otherwise."""
    from localllm.thinking import parse_think

    try:
        return parse_think(value)
    except ValueError as e:
        raise bad_request(str(e), param=field) from None


def logit_bias(value: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token id as a string -> bias in [-100, 100]) -> {token id: bias}.

    >>> logit_bias({"2": -100, "17": 5.5})
    {2: -100.0, 17: 5.5}
    """
    out: dict[int, float] = {}
    for key, bias in (value or {}).items():
        if not key.strip().isdigit():
            raise bad_request(f"logit_bias keys must be token ids (integers), not {key!r}", param="logit_bias")
        if not -100 <= bias <= 100:
            raise bad_request(f"logit_bias values must be between -100 and 100 (token {key}: {bias})",
                              param="logit_bias")
        out[int(key)] = float(bias)
    return out


def check_top_logprobs(value: Any, field: str = "top_logprobs") -> int:
    if value is None:
        return 0
    if not _int_like(value) or not 0 <= int(value) <= MAX_TOP_LOGPROBS:
        raise bad_request(f"{field} must be between 0 and {MAX_TOP_LOGPROBS}", param=field)
    return int(value)


def normalize_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Backend tool calls (``{"name", "arguments"}`` or ``{"function": {...}}``) → Ollama's shape
    ``{"id"?, "function": {"index", "name", "arguments": {...}}}``.

    >>> normalize_calls([{"name": "f", "arguments": '{"x": 1}'}])
    [{'function': {'index': 0, 'name': 'f', 'arguments': {'x': 1}}}]
    """
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = {"value": args}
        entry: dict[str, Any] = {"function": {"index": i, "name": fn.get("name", ""), "arguments": args or {}}}
        if call.get("id"):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def logprob_item(lp: Any, top: bool) -> dict[str, Any]:
    """One token's logprob as Ollama and OpenAI's Chat Completions write it: ``{token, logprob, bytes,
    top_logprobs: [{token, logprob, bytes}]}`` (alternatives only when asked for)."""
    item: dict[str, Any] = {"token": lp.token, "logprob": lp.logprob, "bytes": lp.bytes}
    if top:
        item["top_logprobs"] = [{"token": t, "logprob": p, "bytes": b} for t, p, b in lp.top]
    return item


def call_id(call: dict[str, Any], prefix: str = "call_") -> str:
    """A tool call's id, or a fresh one."""
    return str(call.get("id") or f"{prefix}{secrets.token_hex(12)}")


# ---------------------------------------------------------------------------------------- store access


async def run_sync(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run blocking work (store, loads) off the event loop."""
    return await asyncio.to_thread(fn, *args, **kwargs)


def template_supports_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template  # type: ignore[operator]


def info_of(model: InstalledModel) -> dict[str, Any]:
    """The GGUF metadata cached at install (``GGUFInfo.as_dict()``)."""
    return model.info or {}


def capabilities(model: InstalledModel) -> list[str]:
    """What a model can do, as ``/api/show`` lists it."""
    info = info_of(model)
    caps = ["completion"]
    if template_supports_tools(info.get("chat_template")):
        caps.append("tools")
    extra = info.get("extra") or {}
    if extra.get("vision"):
        caps.append("vision")
    from localllm.thinking import thinks

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
        "parent_model": "",
        "format": "gguf",  # every installed model has its GGUF (MLX weights come beside it)
        "family": arch,
        "families": [arch] if arch else None,
        "parameter_size": label or "",
        "quantization_level": info.get("file_type") or model.quant or "",
    }


def digest_hex(model: InstalledModel) -> str:
    d = model.digest or ""
    return d.split(":", 1)[1] if ":" in d else d


def modified_of(model: InstalledModel) -> str:
    return model.modified.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def modified_ts(model: InstalledModel) -> int:
    return int(model.modified.timestamp())


def size_of(model: InstalledModel) -> int:
    return int(model.size or info_of(model).get("file_size") or 0)


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
