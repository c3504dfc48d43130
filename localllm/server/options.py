"""Request fields → engine options: Ollama's ``options`` and the OpenAI/Anthropic sampling fields (→
:class:`~localllm.api.Sampling` and :class:`~localllm.loader.LoadOptions`), ``keep_alive``, ``think`` and
``reasoning_effort`` (→ a :data:`~localllm.thinking.ThinkValue`), ``logit_bias`` and ``top_logprobs``. A wrong
type or an impossible value is a 400 with one sentence (:func:`~localllm.server.errors.bad_request`)."""

from __future__ import annotations

import json
import logging
from typing import Any

from localllm.api import MAX_TOP_LOGPROBS, Sampling, ThinkValue
from localllm.errors import LocalLLMError
from localllm.loader import LoadOptions
from localllm.residency import parse_keep_alive
from localllm.server.errors import bad_request
from localllm.thinking import parse_think

log = logging.getLogger("localllm.server")

MAX_NUM_CTX = 1 << 20
MAX_PREDICT = 1 << 20


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
    "penalize_newline": ((bool,), "boolean"), "cpu_moe": ((bool,), "boolean"),
    "num_cpu_moe": ((int,), "integer"),
    "stop": ((list, str), "array"),
}


# the Ollama options that are sampling fields → the field each sets
_SAMPLING_OPTIONS = {key: key for key in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n",
                                          "presence_penalty", "frequency_penalty", "seed", "stop")}
_SAMPLING_OPTIONS["num_predict"] = "max_tokens"


def _int_like(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) or (isinstance(v, float) and v.is_integer())


def options_of(options: dict[str, Any] | None, *, defaults: dict[str, Any] | None = None
               ) -> tuple[Sampling, LoadOptions]:
    """Ollama ``options`` → (Sampling, LoadOptions). Unknown keys are ignored (logged) as Ollama does;
    a wrong type or an impossible value is a 400 with one sentence. ``defaults`` (an API's own, as OpenAI's
    temperature 1.0) apply under ``options`` and are not the request's choice: the sampling's ``given`` names only
    what ``options`` set, so a created model's PARAMETERs win over ``defaults`` and lose to ``options``.

    >>> s, lo = options_of({"temperature": 0, "num_predict": 5, "num_ctx": 1024, "stop": "\\n"})
    >>> s.temperature, s.max_tokens, s.stop, lo.num_ctx, sorted(s.given or ())
    (0.0, 5, ['\\n'], 1024, ['max_tokens', 'stop', 'temperature'])
    """
    opts = dict(defaults or {})
    if options is not None and not isinstance(options, dict):
        raise bad_request("options must be an object")
    opts.update(options or {})
    chosen = {key for key, value in (options or {}).items() if value is not None}
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
    s.given = frozenset(_SAMPLING_OPTIONS[key] for key in chosen if key in _SAMPLING_OPTIONS)

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
    num_cpu_moe = opts.get("num_cpu_moe")
    if num_cpu_moe is not None and num_cpu_moe < 0:
        num_cpu_moe = None  # -1 = auto, as num_gpu
    load = LoadOptions(
        cpu_moe=bool(opts.get("cpu_moe", False)),
        num_cpu_moe=min(num_cpu_moe, 100000) if num_cpu_moe is not None else None,
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
    API's ``defaults``; fields left out (None) do not count, and ``defaults`` are not the request's choice (a
    created model's PARAMETERs win over them: :func:`options_of`)."""
    opts: dict[str, Any] = {}
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
    return options_of(opts, defaults=defaults)


_EFFORT: dict[str, ThinkValue] = {"none": False, "minimal": "low", "low": "low", "medium": "medium", "high": "high",
                                  "max": "high", "xhigh": "high", "ultra": "high"}


def think_from_effort(effort: Any, field: str = "reasoning_effort") -> ThinkValue:
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


def check_think(value: Any, field: str = "think") -> ThinkValue:
    """A request's ``think`` (True, False, "low", "medium", "high", "max"); Ollama's message otherwise."""
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
    """How many alternatives per token a request asks for (0-20; unset = 0)."""
    if value is None:
        return 0
    if not _int_like(value) or not 0 <= int(value) <= MAX_TOP_LOGPROBS:
        raise bad_request(f"{field} must be between 0 and {MAX_TOP_LOGPROBS}", param=field)
    return int(value)
