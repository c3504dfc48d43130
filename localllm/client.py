"""The remote side of :mod:`localllm.api`: :class:`Client` speaks the Ollama API to a running server
(``localllm serve`` or a real Ollama) and is both a :class:`~localllm.api.Models` and a
:class:`~localllm.api.Runner`.

    client = connect(host)          # host: the --host option's value, or None
    if client is None:               # in-process: no --host, and no server answering on LOCALLLM_HOST
        ...                          # localllm.local.LocalModels / LocalRunner

Mapping: ``list`` → ``/api/tags``, ``show`` → ``/api/show``, ``pull`` → ``/api/pull`` (streamed progress),
``remove`` → ``/api/delete``, ``copy`` → ``/api/copy``, ``ps`` → ``/api/ps``, ``load``/``unload`` →
``/api/generate`` without a prompt (``keep_alive: 0`` unloads), ``generate``/``agenerate`` → ``/api/chat``
for messages and ``/api/generate`` (raw) for a prompt, streamed NDJSON turned into the engine's events
(``message.thinking`` / ``thinking`` → ``TextChunk(thinking=True)``). Errors are the project's:
:class:`~localllm.errors.ModelNotFoundError` for a 404, ``ServerBusyError`` for a 503,
:class:`~localllm.errors.LocalLLMError` (one sentence) for the rest, including "no server there".
``LOCALLLM_API_KEY`` is sent as a bearer token when set.
"""

from __future__ import annotations

import builtins
import json
import os
import threading
import time
from collections.abc import Generator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from localllm.api import DeviceUse, Installed, Loaded, ProgressFn, PullProgress, Ranked
from localllm.errors import LocalLLMError, ModelNotFoundError

if TYPE_CHECKING:
    from pathlib import Path

    import httpx

    from localllm.api import AsyncEventStream, Done, Event, EventStream, GenerateRequest
    from localllm.loader import LoadOptions
    from localllm.modelfile import Modelfile

DEFAULT_TIMEOUT = 600.0
JSON = dict[str, Any]  # a decoded Ollama API object


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


def parse_time(value: object) -> datetime | None:
    """An RFC 3339 time as Go writes it (nanoseconds, ``Z``) → an aware datetime; None if absent or bad.

    >>> parse_time("2026-01-01T00:00:00.123456789Z")
    datetime.datetime(2026, 1, 1, 0, 0, 0, 123456, tzinfo=datetime.timezone.utc)
    """
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


def _int(value: object) -> int:
    return int(value) if isinstance(value, int | float | str) and str(value).strip() else 0


def _formats(details: JSON) -> list[str]:
    fmt = str(details.get("format") or "")
    return [fmt.upper()] if fmt else []


def installed_from_tags(d: JSON) -> Installed:
    """One ``/api/tags`` entry."""
    details: JSON = d.get("details") or {}
    return Installed(name=str(d.get("name") or d.get("model") or ""), digest=_digest(d.get("digest")),
                     size=_int(d.get("size")), modified=parse_time(d.get("modified_at")), formats=_formats(details),
                     architecture=str(details.get("family") or ""),
                     parameter_size=str(details.get("parameter_size") or ""),
                     quantization=str(details.get("quantization_level") or ""),
                     capabilities=[str(c) for c in d.get("capabilities") or []])


def _digest(value: object) -> str:
    text = str(value or "")
    return text if not text or text.startswith("sha256:") else f"sha256:{text}"


def installed_from_show(name: str, d: JSON, listed: Installed | None) -> Installed:
    """An ``/api/show`` answer (plus the model's ``/api/tags`` entry for digest, size and time)."""
    details: JSON = d.get("details") or {}
    info: JSON = d.get("model_info") or {}
    arch = str(info.get("general.architecture") or details.get("family") or "")
    base = listed or Installed(name=name)
    return Installed(
        name=base.name, digest=base.digest, size=base.size, modified=base.modified or parse_time(d.get("modified_at")),
        formats=base.formats or _formats(details), architecture=arch,
        parameters=_int(info.get("general.parameter_count")), parameter_size=str(details.get("parameter_size") or ""),
        quantization=str(details.get("quantization_level") or ""),
        context_length=_int(info.get(f"{arch}.context_length")),
        embedding_length=_int(info.get(f"{arch}.embedding_length")), n_layers=_int(info.get(f"{arch}.block_count")),
        vocab_size=_int(info.get(f"{arch}.vocab_size")), chat_template=d.get("template") or None,
        license=d.get("license") or None, capabilities=[str(c) for c in d.get("capabilities") or []],
        base=str(details.get("parent_model") or "") or None, modelfile=str(d.get("modelfile") or ""),
        system=d.get("system") or None,
    )


def running_from_ps(d: JSON) -> Loaded:
    """One ``/api/ps`` entry."""
    return Loaded(name=str(d.get("name") or d.get("model") or ""), digest=_digest(d.get("digest")),
                   size=_int(d.get("size")), size_vram=_int(d.get("size_vram")),
                   context_length=_int(d.get("context_length")), expires_at=parse_time(d.get("expires_at")),
                   slots=_int(d.get("slots")), slots_busy=_int(d.get("slots_busy")),
                   batched=bool(d.get("batched", True)), drafting=str(d.get("drafting") or ""),
                   prompt_cache_entries=_int((d.get("prompt_cache") or {}).get("entries")),
                   prompt_cache_bytes=_int((d.get("prompt_cache") or {}).get("bytes")),
                   n_cpu_moe=_int(d.get("n_cpu_moe")), n_gpu_layers=_int(d.get("n_gpu_layers")),
                   n_layers=_int(d.get("n_layers")),
                   devices=[DeviceUse(str(x.get("name") or ""), _int(x.get("size")), _int(x.get("estimate")),
                                      str(x.get("description") or "")) for x in d.get("devices") or []
                            if isinstance(x, dict)])


def options_json(request: GenerateRequest | None = None, options: LoadOptions | None = None) -> JSON:
    """Sampling (+ LoadOptions) → Ollama ``options``: only the sampling fields the caller chose
    (:meth:`~localllm.api.Sampling.chosen`), so the server's model keeps its PARAMETERs for the others (sending
    every default would override a created model's ``temperature 0`` with 0.8).

    >>> from localllm.api import GenerateRequest, Sampling
    >>> chose = Sampling(temperature=0.8, top_k=40, given=frozenset({"temperature"}))
    >>> options_json(GenerateRequest(prompt="x", sampling=chose))
    {'temperature': 0.8}
    """
    out: JSON = {}
    if request is not None:
        s = request.sampling
        chosen = s.chosen()
        for key in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n",
                    "presence_penalty", "frequency_penalty"):
            if key in chosen:
                out[key] = getattr(s, key)
        if "seed" in chosen:
            out["seed"] = -1 if s.seed is None else s.seed
        if "max_tokens" in chosen:
            out["num_predict"] = s.max_tokens
        if "stop" in chosen:
            out["stop"] = list(s.stop)
    if options is not None:
        for key, value in (("num_ctx", options.num_ctx), ("num_gpu", options.num_gpu),
                           ("num_thread", options.num_thread)):
            if value is not None:
                out[key] = value
    return out


def _keep_alive(value: float) -> float | int:
    return -1 if value == float("inf") else value


def request_body(name: str, request: GenerateRequest, options: LoadOptions | None,
                 keep_alive: float | None) -> tuple[str, JSON]:
    """(path, body) of a streamed generation: messages → ``/api/chat``, a prompt → raw ``/api/generate``."""
    body: JSON = {"model": name, "stream": True, "options": options_json(request, options)}
    if request.format is not None:
        body["format"] = request.format
    if request.think is not None:
        body["think"] = request.think
    if keep_alive is not None:
        body["keep_alive"] = _keep_alive(keep_alive)
    if request.messages is not None:  # images (bytes in-process) travel as base64, as Ollama's API takes them
        body["messages"] = [{**m, "images": [_b64(i) for i in m["images"]]} if m.get("images") else m
                            for m in request.messages]
        if request.tools:
            body["tools"] = request.tools
        return "/api/chat", body
    body.update(prompt=request.prompt, raw=True)
    if request.images:
        body["images"] = [_b64(i) for i in request.images]
    return "/api/generate", body


def _b64(image: bytes | str) -> str:
    import base64

    return image if isinstance(image, str) else base64.b64encode(image).decode("ascii")


class _Events:
    """Ollama stream lines → the engine's events (one per text piece, tool calls, the closing Done)."""

    def __init__(self, chat: bool):
        self.chat = chat
        self.t0 = time.perf_counter_ns()
        self.thinking = 0  # thinking lines seen: Ollama streams one token per line

    def feed(self, obj: JSON) -> list[Event]:
        from localllm.api import Done, Stats, TextChunk, ToolCalls

        out: list[Event] = []
        msg: JSON = obj.get("message") or {}
        thought = msg.get("thinking") if self.chat else obj.get("thinking")
        text = msg.get("content") if self.chat else obj.get("response")
        calls = msg.get("tool_calls") or obj.get("tool_calls")
        if thought:
            self.thinking += 1
            out.append(TextChunk(str(thought), thinking=True))
        if text:
            out.append(TextChunk(str(text)))
        if calls:
            out.append(ToolCalls([{"name": (c.get("function") or {}).get("name", ""),
                                   "arguments": (c.get("function") or {}).get("arguments", {}),
                                   **({"id": c["id"]} if c.get("id") else {})} for c in calls]))
        if obj.get("done"):
            stats = Stats(**{k: _int(obj.get(k)) for k in (
                "prompt_eval_count", "prompt_eval_duration", "eval_count", "eval_duration",
                "load_duration", "total_duration")})
            stats.thinking_tokens = min(self.thinking, stats.eval_count) if stats.eval_count else self.thinking
            if not stats.total_duration:
                stats.total_duration = time.perf_counter_ns() - self.t0
            reason = obj.get("done_reason") or "stop"
            out.append(Done(stats, finish_reason="length" if reason == "length" else "stop"))
        return out

    def cancelled(self) -> Done:
        from localllm.api import Done, Stats

        return Done(Stats(total_duration=time.perf_counter_ns() - self.t0), finish_reason="cancelled")


class Client:
    """Talks to one server: :class:`~localllm.api.Models` and :class:`~localllm.api.Runner` over HTTP.
    Cheap to create; one connection pool (an asyncio stream opens its own)."""

    remote = True

    def __init__(self, host: str | None = None, *, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT):
        import httpx

        self.url = base_url(host)
        key = api_key if api_key is not None else os.environ.get("LOCALLLM_API_KEY")
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._timeout = httpx.Timeout(timeout, connect=5.0)
        self._http = httpx.Client(base_url=self.url, headers=self._headers, timeout=self._timeout)

    @property
    def label(self) -> str:
        return f"server {self.url}"

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing

    def _error(self, status: int, body: bytes) -> LocalLLMError:
        text = body.decode(errors="replace")
        try:
            err = json.loads(text).get("error", text)
            message = str(err.get("message", err)) if isinstance(err, dict) else str(err)
        except (ValueError, AttributeError):
            message = text.strip() or f"HTTP {status}"
        if status == 404:
            return ModelNotFoundError(message)
        if status == 503:
            from localllm.residency import ServerBusyError

            return ServerBusyError(message)
        if status == 401:
            return LocalLLMError(f"The server at {self.url} needs an API key; set LOCALLLM_API_KEY.")
        if status == 403:
            return LocalLLMError(f"The server at {self.url} refused the request (403).")
        return LocalLLMError(message)

    def _unreachable(self, e: Exception) -> LocalLLMError:
        return LocalLLMError(f"Could not reach a server at {self.url} ({type(e).__name__}); "
                             "is `localllm serve` (or Ollama) running there?")

    def _request(self, method: str, path: str, body: JSON | None = None) -> httpx.Response:
        import httpx

        try:
            r = self._http.request(method, path, json=body)
        except httpx.HTTPError as e:
            raise self._unreachable(e) from None
        if r.status_code >= 400:
            raise self._error(r.status_code, r.content)
        return r

    def _json(self, method: str, path: str, body: JSON | None = None) -> JSON:
        data = self._request(method, path, body).json()
        return data if isinstance(data, dict) else {}

    @staticmethod
    def _line(line: str) -> JSON | None:
        """One NDJSON line (None for a blank one); an ``{"error"}`` line raises."""
        if not line.strip():
            return None
        obj = json.loads(line)
        if not isinstance(obj, dict):
            return None
        if "error" in obj and len(obj) == 1:
            raise LocalLLMError(str(obj["error"]))
        return obj

    def _stream(self, path: str, body: JSON, cancel: threading.Event | None = None
                ) -> Generator[JSON, None, None]:
        """POST and yield the NDJSON objects. Closing the generator or setting ``cancel`` drops the
        connection, which makes the server stop generating."""
        import httpx

        try:
            with self._http.stream("POST", path, json=body) as r:
                if r.status_code >= 400:
                    raise self._error(r.status_code, r.read())
                for line in r.iter_lines():
                    if cancel is not None and cancel.is_set():
                        return
                    obj = self._line(line)
                    if obj is not None:
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
        return str(self._json("GET", "/api/version").get("version", ""))

    # ------------------------------------------------------------------ Models

    def list(self) -> builtins.list[Installed]:
        return [installed_from_tags(m) for m in self._json("GET", "/api/tags").get("models", [])]

    def show(self, name: str) -> Installed:
        data = self._json("POST", "/api/show", {"model": name})
        listed = self.list()
        # a name without a tag means ":latest" (Ollama's rule); an alias the server resolves otherwise
        # (smollm2 → smollm2:135m) keeps the name it was asked by, without digest and size
        wanted = {name, name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"}
        found = next((m for m in listed if m.name in wanted), None)
        return installed_from_show(name, data, found)

    def pull(self, name: str, *, progress: ProgressFn | None = None, cancel: threading.Event | None = None,
             mlx: bool | None = None, mmproj_file: str | None = None) -> Installed:
        """Pull on the server (it pulls into its own store; ``mlx`` and ``mmproj_file`` are the server's business:
        it takes the repo's default projector)."""
        for obj in self._stream("/api/pull", {"model": name, "stream": True}, cancel):
            if progress is not None:
                progress(PullProgress(status=str(obj.get("status", "")), digest=obj.get("digest"),
                                      total=_int(obj.get("total")), completed=_int(obj.get("completed"))))
        if cancel is not None and cancel.is_set():
            raise LocalLLMError(f"The pull of {name} was cancelled.")
        return self.show(name)

    def create(self, name: str, modelfile: Modelfile, *, progress: ProgressFn | None = None,
               quantize: str | None = None, requantize: bool = False) -> Installed:
        """``/api/create`` in Ollama's JSON form; a FROM that is a local ``.gguf`` is uploaded to ``/api/blobs``
        first (as the ``ollama`` client does) and named in ``files``."""
        from pathlib import Path

        from localllm.names import parse_name

        body: JSON = {"model": name, "stream": True}
        src = modelfile.from_
        if parse_name(src, allow_path=True).kind == "path":
            body["files"] = {Path(src).name: self._upload_blob(Path(src).expanduser())}
        else:
            body["from"] = src
        if modelfile.parameters:
            body["parameters"] = modelfile.parameters
        for key in ("system", "template", "draft"):
            if getattr(modelfile, key) is not None:
                body[key] = getattr(modelfile, key)
        if modelfile.messages:
            body["messages"] = modelfile.messages
        if modelfile.license:
            body["license"] = modelfile.license
        if modelfile.adapters:  # Ollama's form: {name: digest} of uploaded blobs, no scale
            from localllm.modelfile import split_adapter

            body["adapters"] = {}
            for a in modelfile.adapters:
                where, scale = split_adapter(a)
                if scale != 1.0:
                    raise LocalLLMError("An ADAPTER scale other than 1 works in-process only (Ollama's API has none).")
                body["adapters"][Path(where).name] = self._upload_blob(Path(where).expanduser())
        if modelfile.projector:  # ours: the digest of the uploaded projector GGUF, never a path on the server
            proj = modelfile.projector
            body["projector"] = proj if proj.startswith("sha256") else self._upload_blob(Path(proj).expanduser())
        if requantize:
            raise LocalLLMError("--requantize works in-process only (Ollama's API has no such field).")
        if quantize:
            body["quantize"] = quantize
        for obj in self._stream("/api/create", body):
            if progress is not None:
                progress(PullProgress(status=str(obj.get("status", "")), digest=obj.get("digest"),
                                      total=_int(obj.get("total")), completed=_int(obj.get("completed"))))
        return self.show(name)

    def _upload_blob(self, path: Path) -> str:
        """``sha256:<hex>`` of the file at ``path``, uploaded to the server's blobs unless it has it already."""
        import httpx

        from localllm.download import sha256_file

        if not path.is_file():
            raise LocalLLMError(f"{path} is not a file.")
        digest = "sha256:" + sha256_file(path)
        try:
            if self._http.head(f"/api/blobs/{digest}").status_code == 200:
                return digest
            with open(path, "rb") as fh:
                r = self._http.post(f"/api/blobs/{digest}", content=fh, timeout=None)
        except httpx.HTTPError as e:
            raise self._unreachable(e) from None
        if r.status_code >= 400:
            raise self._error(r.status_code, r.content)
        return digest

    def set_projector(self, name: str, path: str) -> Installed:
        raise LocalLLMError("A projector file is attached in-process only (the server cannot read this machine's "
                            "files); run `localllm pull NAME --mmproj PATH` without --host on the server's machine.")

    def remove(self, name: str) -> str:
        self._request("DELETE", "/api/delete", {"model": name})
        return name

    def copy(self, src: str, dst: str, *, force: bool = False) -> str:
        if not force:  # /api/copy replaces an existing name (Ollama's behaviour): asked first, unless forced
            try:
                there = self.show(dst)
            except ModelNotFoundError:
                pass
            else:
                raise LocalLLMError(f"{there.name} exists already; remove it first, or copy with --force to "
                                    "replace it.")
        self._request("POST", "/api/copy", {"source": src, "destination": dst})
        return dst

    # ------------------------------------------------------------------ Runner

    def ps(self) -> builtins.list[Loaded]:
        return [running_from_ps(m) for m in self._json("GET", "/api/ps").get("models", [])]

    def is_loaded(self, name: str) -> bool:
        return any(m.name == name for m in self.ps())

    def load(self, name: str, options: LoadOptions | None = None, *, keep_alive: float | None = None) -> Loaded:
        body: JSON = {"model": name, "stream": False, "options": options_json(None, options)}
        if keep_alive is not None:
            body["keep_alive"] = _keep_alive(keep_alive)
        self._request("POST", "/api/generate", body)
        loaded = self.ps()
        return next((m for m in loaded if m.name == name), None) or Loaded(name=name)

    def unload(self, name: str) -> bool:
        """Unload ``name`` now (``localllm stop``). True if it was loaded."""
        before = {m.name for m in self.ps()}
        self._request("POST", "/api/generate", {"model": name, "keep_alive": 0, "stream": False})
        return bool(before - {m.name for m in self.ps()})

    def generate(self, name: str, request: GenerateRequest, options: LoadOptions | None = None, *,
                 cancel: threading.Event | None = None, keep_alive: float | None = None) -> EventStream:
        path, body = request_body(name, request, options, keep_alive)
        events = _Events(chat=path == "/api/chat")
        stream = self._stream(path, body, cancel)
        try:
            for obj in stream:
                yield from events.feed(obj)
                if obj.get("done"):
                    return
            if cancel is not None and cancel.is_set():
                yield events.cancelled()
        finally:
            stream.close()

    async def agenerate(self, name: str, request: GenerateRequest, options: LoadOptions | None = None, *,
                        cancel: threading.Event | None = None, keep_alive: float | None = None) -> AsyncEventStream:
        import httpx

        path, body = request_body(name, request, options, keep_alive)
        events = _Events(chat=path == "/api/chat")
        try:
            async with httpx.AsyncClient(base_url=self.url, headers=self._headers, timeout=self._timeout) as http:
                async with http.stream("POST", path, json=body) as r:
                    if r.status_code >= 400:
                        raise self._error(r.status_code, await r.aread())
                    async for line in r.aiter_lines():
                        if cancel is not None and cancel.is_set():
                            break
                        obj = self._line(line)
                        if obj is None:
                            continue
                        for event in events.feed(obj):
                            yield event
                        if obj.get("done"):
                            return
        except httpx.HTTPError as e:
            raise self._unreachable(e) from None
        if cancel is not None and cancel.is_set():
            yield events.cancelled()

    def embed(self, name: str, texts: builtins.list[str], options: LoadOptions | None = None, *,
              keep_alive: float | None = None) -> builtins.list[builtins.list[float]]:
        body: JSON = {"model": name, "input": list(texts), "options": options_json(None, options)}
        if keep_alive is not None:
            body["keep_alive"] = _keep_alive(keep_alive)
        return builtins.list(self._json("POST", "/api/embed", body).get("embeddings", []))


    def rerank(self, name: str, query: str, documents: builtins.list[str], options: LoadOptions | None = None, *,
               keep_alive: float | None = None, truncate: bool = True) -> builtins.list[Ranked]:
        """``POST /api/rerank`` (localllm's; llama-server answers at ``/rerank``, Ollama has none)."""
        body: JSON = {"model": name, "query": query, "documents": list(documents), "truncate": truncate,
                      "return_documents": False, "options": options_json(None, options)}
        if keep_alive is not None:
            body["keep_alive"] = _keep_alive(keep_alive)
        try:
            results = self._json("POST", "/api/rerank", body).get("results") or []
        except ModelNotFoundError as e:
            if "not installed" in str(e) or "neither installed" in str(e):
                raise
            raise LocalLLMError(f"The server at {self.url} has no rerank endpoint (Ollama has none); use "
                                "`localllm serve` there.") from None
        return [Ranked(int(r["index"]), float(r["relevance_score"]), documents[int(r["index"])],
                       bool(r.get("truncated"))) for r in results]


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


if TYPE_CHECKING:
    from localllm.api import Models, Runner

    def _implements(client: Client) -> tuple[Models, Runner]:
        """mypy checks here that the client is both protocols (the types); tests/test_runner.py, the names."""
        return client, client
