"""A client for a running server over the Ollama API: ``localllm serve`` or a real Ollama.

The faces (``run``, ``list``, ``ps``, ``pull``, ``rm``, ``stop``, the TUI) run the engine in-process by
default and attach to a server when asked. One call decides::

    from localllm.client import connect

    client = connect(host)          # host: the --host option's value, or None
    if client is None:               # in-process: no --host, and no server answering on LOCALLLM_HOST
        engine = Engine()
        events = engine.generate(name, request, options, cancel=cancel, keep_alive=ka)
    else:                            # same signature, same event types (TextChunk, ToolCalls, Done)
        events = client.generate(name, request, options, cancel=cancel, keep_alive=ka)

:class:`Client` mirrors the engine and the store where the faces need them: ``generate`` / ``chat``
(events), ``embed``, ``load``, ``unload``, ``ps`` (:class:`RemoteModel` with ``processor`` and
``until``), ``list`` / ``get`` / ``show`` / ``pull(progress=)`` / ``remove`` / ``copy``. Errors are the
project's: :class:`~localllm.errors.ModelNotFoundError` for a 404, ``ServerBusyError`` for a 503,
:class:`~localllm.errors.LocalLLMError` (one sentence) for the rest, including "no server there".
``LOCALLLM_API_KEY`` is sent as a bearer token when set.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from localllm.errors import LocalLLMError, ModelNotFoundError

DEFAULT_TIMEOUT = 600.0


def base_url(host: str | None = None) -> str:
    """``--host`` / ``LOCALLLM_HOST`` → a URL; ``0.0.0.0`` means this machine (as Ollama's client).

    >>> base_url("127.0.0.1:11434"), base_url("0.0.0.0:8080"), base_url("https://example.com/")
    ('http://127.0.0.1:11434', 'http://127.0.0.1:8080', 'https://example.com')
    >>> base_url(":9000"), base_url("localhost")
    ('http://127.0.0.1:9000', 'http://localhost:11434')
    """
    from localllm import config

    value = (host or config.host()).strip().rstrip("/")
    scheme = "http"
    for prefix in ("http://", "https://"):
        if value.startswith(prefix):
            scheme, value = prefix[:-3], value[len(prefix):]
    if value.startswith(":"):
        value = "127.0.0.1" + value
    hostpart, _, port = value.rpartition(":") if not value.endswith("]") else (value, "", "")
    if not hostpart or (hostpart.count(":") and not hostpart.startswith("[")):  # no port given
        hostpart, port = value, ""
    port = port or ("443" if scheme == "https" else "11434")
    if hostpart in ("0.0.0.0", "[::]"):
        hostpart = "127.0.0.1"
    if scheme == "https" and port == "443":
        return f"https://{hostpart}"
    return f"{scheme}://{hostpart}:{port}"


def processor(size: int, size_vram: int) -> str:
    """Ollama's PROCESSOR column.

    >>> processor(100, 0), processor(100, 100), processor(100, 52)
    ('100% CPU', '100% GPU', '48%/52% CPU/GPU')
    """
    if size_vram <= 0 or size <= 0:
        return "100% CPU"
    if size_vram >= size:
        return "100% GPU"
    cpu = round((size - size_vram) / size * 100)
    return f"{cpu}%/{100 - cpu}% CPU/GPU"


def until(expires_at: datetime | None, now: datetime | None = None) -> str:
    """Ollama's UNTIL column: "4 minutes from now", "Never", "Stopping...".

    >>> t = datetime(2026, 1, 1, tzinfo=UTC)
    >>> until(datetime(2026, 1, 1, 0, 4, 30, tzinfo=UTC), t), until(None, t), until(t, t)
    ('4 minutes from now', 'Never', 'Stopping...')
    """
    if expires_at is None or expires_at.year > 2200:
        return "Never"
    now = now or datetime.now(UTC)
    left = (expires_at - now).total_seconds()
    if left <= 0:
        return "Stopping..."
    for unit, seconds in (("day", 86400), ("hour", 3600), ("minute", 60), ("second", 1)):
        if left >= seconds:
            n = int(left // seconds)
            return f"{n} {unit}{'s' if n != 1 else ''} from now"
    return "Less than a second from now"


def parse_time(value: Any) -> datetime | None:
    if not value:
        return None
    text = str(value)
    if text.endswith("Z"):
        text = text[:-1] + "+00:00"
    if "." in text:  # Go writes nanoseconds; Python takes microseconds
        head, _, tail = text.partition(".")
        digits = "".join(ch for ch in tail if ch.isdigit())
        rest = tail[len(digits):]
        text = f"{head}.{digits[:6]}{rest}"
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


@dataclass
class RemoteModel:
    """An installed (``list``) or loaded (``ps``) model on the server."""

    name: str
    digest: str = ""
    size: int = 0
    modified: datetime | None = None
    details: dict[str, Any] = field(default_factory=dict)
    size_vram: int = 0
    context_length: int = 0
    expires_at: datetime | None = None
    capabilities: list[str] = field(default_factory=list)

    @property
    def short_id(self) -> str:
        return self.digest.removeprefix("sha256:")[:12]

    @property
    def processor(self) -> str:
        return processor(self.size, self.size_vram)

    @property
    def until(self) -> str:
        return until(self.expires_at)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RemoteModel:
        return cls(name=d.get("name") or d.get("model") or "", digest=d.get("digest") or "",
                   size=int(d.get("size") or 0), modified=parse_time(d.get("modified_at")),
                   details=d.get("details") or {}, size_vram=int(d.get("size_vram") or 0),
                   context_length=int(d.get("context_length") or 0), expires_at=parse_time(d.get("expires_at")),
                   capabilities=list(d.get("capabilities") or []))


def options_json(request: Any = None, options: Any = None) -> dict[str, Any]:
    """Sampling (+ LoadOptions) → Ollama ``options``."""
    out: dict[str, Any] = {}
    s = getattr(request, "sampling", None)
    if s is not None:
        out.update(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                   repeat_penalty=s.repeat_penalty, repeat_last_n=s.repeat_last_n,
                   presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty)
        if s.seed is not None:
            out["seed"] = s.seed
        if s.max_tokens is not None and s.max_tokens >= 0:
            out["num_predict"] = s.max_tokens
        if s.stop:
            out["stop"] = list(s.stop)
    if options is not None:
        for key in ("num_ctx", "num_gpu", "num_thread"):
            value = getattr(options, key, None)
            if value is not None:
                out[key] = value
    return out


def _keep_alive(value: float | None) -> Any:
    if value is None:
        return None
    if value == float("inf"):
        return -1
    return value


class Client:
    """Talks to one server. Cheap to create; one HTTP connection pool."""

    def __init__(self, host: str | None = None, *, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT):
        import httpx

        self.url = base_url(host)
        key = api_key if api_key is not None else os.environ.get("LOCALLLM_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers,
                                  timeout=httpx.Timeout(timeout, connect=5.0))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing

    def _error(self, status: int, body: bytes | str) -> LocalLLMError:
        text = body.decode(errors="replace") if isinstance(body, bytes) else body
        try:
            data = json.loads(text)
            err = data.get("error", text)
            message = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        except (ValueError, AttributeError):
            message = text.strip() or f"HTTP {status}"
        if status == 404:
            return ModelNotFoundError(message)
        if status == 503:
            from localllm.engine import ServerBusyError

            return ServerBusyError(message)
        if status == 401:
            return LocalLLMError(f"The server at {self.url} needs an API key; set LOCALLLM_API_KEY.")
        if status == 403:
            return LocalLLMError(f"The server at {self.url} refused the request (403).")
        return LocalLLMError(message)

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        import httpx

        try:
            r = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            raise self._unreachable(e) from None
        if r.status_code >= 400:
            raise self._error(r.status_code, r.content)
        return r

    def _unreachable(self, e: Exception) -> LocalLLMError:
        return LocalLLMError(f"Could not reach a server at {self.url} ({type(e).__name__}); "
                             "is `localllm serve` (or Ollama) running there?")

    def _stream(self, path: str, body: dict[str, Any], cancel: threading.Event | None = None
                ) -> Iterator[dict[str, Any]]:
        """POST and yield the NDJSON objects; an ``{"error"}`` line raises. Closing the generator or
        setting ``cancel`` drops the connection, which makes the server stop generating."""
        import httpx

        try:
            with self._http.stream("POST", path, json=body) as r:
                if r.status_code >= 400:
                    raise self._error(r.status_code, r.read())
                for line in r.iter_lines():
                    if cancel is not None and cancel.is_set():
                        return
                    if not line.strip():
                        continue
                    obj = json.loads(line)
                    if "error" in obj and len(obj) == 1:
                        raise LocalLLMError(str(obj["error"]))
                    yield obj
        except httpx.HTTPError as e:
            raise self._unreachable(e) from None

    # ------------------------------------------------------------------ server

    def is_running(self, timeout: float = 1.0) -> bool:
        try:
            return self._http.get("/", timeout=timeout).status_code == 200
        except Exception:  # noqa: BLE001 - any failure means "not there"
            return False

    def version(self) -> str:
        return self._request("GET", "/api/version").json().get("version", "")

    # ------------------------------------------------------------------ models (the store's operations)

    def list(self) -> list[RemoteModel]:
        return [RemoteModel.from_json(m) for m in self._request("GET", "/api/tags").json().get("models", [])]

    def show(self, name: str) -> dict[str, Any]:
        return self._request("POST", "/api/show", json={"model": name}).json()

    def get(self, name: str) -> RemoteModel:
        """The installed model ``name`` (404 → ModelNotFoundError)."""
        data = self.show(name)
        found = next((m for m in self.list() if m.name == name), None)
        return found or RemoteModel(name=name, details=data.get("details") or {},
                                    capabilities=data.get("capabilities") or [])

    def pull(self, name: str, *, progress: Callable[[Any], None] | None = None,
             cancel: threading.Event | None = None) -> None:
        """Pull on the server; ``progress`` gets :class:`localllm.store.PullProgress` events."""
        from localllm.store import PullProgress

        for obj in self._stream("/api/pull", {"model": name, "stream": True}, cancel):
            if progress is not None:
                progress(PullProgress(status=obj.get("status", ""), digest=obj.get("digest"),
                                      total=int(obj.get("total") or 0), completed=int(obj.get("completed") or 0)))
        if cancel is not None and cancel.is_set():
            raise LocalLLMError(f"The pull of {name} was cancelled.")

    def remove(self, name: str) -> None:
        self._request("DELETE", "/api/delete", json={"model": name})

    delete = remove

    def copy(self, src: str, dst: str) -> None:
        self._request("POST", "/api/copy", json={"source": src, "destination": dst})

    # ------------------------------------------------------------------ running models (the engine's)

    def ps(self) -> list[RemoteModel]:
        return [RemoteModel.from_json(m) for m in self._request("GET", "/api/ps").json().get("models", [])]

    def is_loaded(self, name: str) -> bool:
        return any(m.name == name for m in self.ps())

    def load(self, name: str, options: Any = None, *, keep_alive: float | None = None) -> None:
        body: dict[str, Any] = {"model": name, "stream": False, "options": options_json(None, options)}
        if keep_alive is not None:
            body["keep_alive"] = _keep_alive(keep_alive)
        self._request("POST", "/api/generate", json=body)

    def unload(self, name: str) -> bool:
        """Unload ``name`` now (``localllm stop``). True if it was loaded."""
        before = {m.name for m in self.ps()}
        self._request("POST", "/api/generate", json={"model": name, "keep_alive": 0, "stream": False})
        return bool(before - {m.name for m in self.ps()})

    def generate(self, name: str, request: Any, options: Any = None, *, cancel: threading.Event | None = None,
                 keep_alive: float | None = None) -> Iterator[Any]:
        """Like :meth:`localllm.engine.Engine.generate`: TextChunk / ToolCalls events, then one Done.
        ``request.messages`` goes to ``/api/chat``; ``request.prompt`` to ``/api/generate`` (raw)."""
        from localllm.engine import Done, Stats, TextChunk, ToolCalls

        body: dict[str, Any] = {"model": name, "stream": True, "options": options_json(request, options)}
        if request.format is not None:
            body["format"] = request.format
        if keep_alive is not None:
            body["keep_alive"] = _keep_alive(keep_alive)
        if request.messages is not None:
            body["messages"] = request.messages
            if request.tools:
                body["tools"] = request.tools
            path = "/api/chat"
        else:
            body.update(prompt=request.prompt, raw=True)
            path = "/api/generate"
        t0 = time.perf_counter_ns()
        stream = self._stream(path, body, cancel)
        try:
            for obj in stream:
                msg = obj.get("message") or {}
                text = msg.get("content") if path == "/api/chat" else obj.get("response")
                calls = msg.get("tool_calls") or obj.get("tool_calls")
                if text:
                    yield TextChunk(text)
                if calls:
                    yield ToolCalls([{"name": (c.get("function") or {}).get("name", ""),
                                      "arguments": (c.get("function") or {}).get("arguments", {}),
                                      **({"id": c["id"]} if c.get("id") else {})} for c in calls])
                if obj.get("done"):
                    stats = Stats(**{k: int(obj.get(k) or 0) for k in (
                        "prompt_eval_count", "prompt_eval_duration", "eval_count", "eval_duration",
                        "load_duration", "total_duration")})
                    if not stats.total_duration:
                        stats.total_duration = time.perf_counter_ns() - t0
                    reason = obj.get("done_reason") or "stop"
                    yield Done(stats, finish_reason="length" if reason == "length" else "stop")
                    return
            if cancel is not None and cancel.is_set():
                yield Done(Stats(total_duration=time.perf_counter_ns() - t0), finish_reason="cancelled")
        finally:
            stream.close()

    def chat(self, name: str, messages: list[dict[str, Any]], *, options: Any = None, sampling: Any = None,
             format: Any = None, tools: list[dict[str, Any]] | None = None, cancel: threading.Event | None = None,
             keep_alive: float | None = None) -> Iterator[Any]:
        """Convenience: :meth:`generate` for a list of messages."""
        from localllm.engine import GenerateRequest, Sampling

        req = GenerateRequest(messages=messages, sampling=sampling or Sampling(), format=format, tools=tools)
        return self.generate(name, req, options, cancel=cancel, keep_alive=keep_alive)

    def embed(self, name: str, texts: list[str], options: Any = None, *,
              keep_alive: float | None = None) -> list[list[float]]:
        body: dict[str, Any] = {"model": name, "input": list(texts), "options": options_json(None, options)}
        if keep_alive is not None:
            body["keep_alive"] = _keep_alive(keep_alive)
        return self._request("POST", "/api/embed", json=body).json().get("embeddings", [])


def connect(host: str | None = None) -> Client | None:
    """The client a face should use, or ``None`` to run in-process.

    * ``host`` given (``--host URL``): a :class:`Client` for it; one sentence if nothing answers there.
    * else ``LOCALLLM_HOST`` set and a server answering there: a :class:`Client`.
    * else ``None``.
    """
    if host:
        client = Client(host)
        if not client.is_running(timeout=3.0):
            url = client.url
            client.close()
            raise LocalLLMError(f"No server is answering at {url}; start one with `localllm serve` "
                                "or check the --host value.")
        return client
    if os.environ.get("LOCALLLM_HOST", "").strip():
        client = Client()
        if client.is_running(timeout=0.5):
            return client
        client.close()
    return None


class RemoteEngine:
    """The part of :class:`localllm.engine.Engine` that ``localllm run`` uses, served by a server.

    ``store`` is the client itself (``get`` / ``pull``), so the same code pulls a missing model on the
    server. ``ps`` is empty: a server's loaded models carry no session details (``localllm ps --host``
    shows them)."""

    def __init__(self, client: Client):
        self.client = client
        self.store = client

    def generate(self, name: str, request: Any, options: Any = None, *, cancel: threading.Event | None = None,
                 keep_alive: float | None = None) -> Iterator[Any]:
        return self.client.generate(name, request, options, cancel=cancel, keep_alive=keep_alive)

    def load(self, name: str, options: Any = None, *, keep_alive: float | None = None) -> None:
        self.client.load(name, options, keep_alive=keep_alive)

    def unload(self, name: str) -> bool:
        return self.client.unload(name)

    def ps(self) -> list[Any]:
        return []

    def close(self) -> None:
        self.client.close()
