"""The one generation path of the server: every API's chat and completion handler ends here.

A translator (:mod:`~localllm.server.ollama_routes`, :mod:`~localllm.server.openai_routes`,
:mod:`~localllm.server.responses_routes`, :mod:`~localllm.server.anthropic_routes`) turns its request body
into a :class:`Call` and the events back into its own frames (an :class:`Encoder`) or its own JSON (from a
:class:`Result`), with pure functions. This module does the rest, once:

1. the model name (a name, never a path) and the installed model (an unknown one is a 404 first);
2. the context: the request's ``num_ctx`` or the server's default (``LOCALLLM_CONTEXT_LENGTH``), capped to the
   model's trained context as Ollama does;
3. capability checks: tools, images and thinking (400 in Ollama's words, ``"<model>" does not support
   thinking``; dropped instead where the API relaxes it, as Ollama does for Anthropic's); a ``tool_choice``
   that forces a call becomes the grammar of that call (a parameter schema it cannot express is a 400 naming
   the keyword). What a request says on its own (options, the logprobs range, a ``format`` schema the grammar
   can follow) its translator checked, once, in :mod:`~localllm.server.options` and
   :mod:`~localllm.server.checks`;
4. the engine call (:meth:`~localllm.engine.Engine.agenerate`) and its first event, awaited before any byte
   is sent, so that what fails before the output (a full queue, a prompt that does not fit, a load that
   fails) answers with its real status; a client that disconnects meanwhile cancels at once;
5. streaming the encoder's frames (an error mid-stream becomes the API's own last frame; a client that
   goes away cancels the request and frees its slot), or collecting one :class:`Result`.

Embeddings share steps 1, 2 and the engine (:func:`embed_texts`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import Request
from fastapi.responses import StreamingResponse

from localllm.api import Done, Event, GenerateRequest, Pooled, TextChunk, TokenLogprob, ToolCalls
from localllm.loader import LoadOptions
from localllm.residency import Resident
from localllm.server.checks import check_name
from localllm.server.errors import APIError, bad_request, status_of
from localllm.server.modelinfo import capabilities, info_of
from localllm.server.options import options_of
from localllm.server.protocol import engine_of, run_cancellable, run_sync
from localllm.store import InstalledModel
from localllm.thinking import asks_to_think

if TYPE_CHECKING:
    from localllm.engine import Engine


class ClientGone(Exception):
    """The client disconnected before the first byte (answered 499, which nobody reads)."""


@dataclass
class Call:
    """One generation as any API asks for it; the translators build it from their request bodies."""

    model: str  # the name as the client wrote it (checked here, echoed in answers, named in errors)
    request: GenerateRequest
    options: LoadOptions = field(default_factory=LoadOptions)
    keep_alive: float | None = None
    images: bool = False  # some message carries an image or an audio clip (both ride in ``images``)
    relax_thinking: bool = False  # a model that cannot think ignores ``think`` (Anthropic's API) instead of a 400
    # tool_choice that forces a call: None = the model decides, [] = any of the tools, [name] = that one; the
    # answer is then constrained to a call by a grammar built from the tools' parameter schemas
    force_tools: list[str] | None = None


@dataclass
class Result:
    """A whole generation, collected: the answer, the reasoning apart, tool calls, logprobs, the end."""

    content: str
    thinking: str
    calls: list[dict[str, Any]]  # as the backend gave them; :func:`~localllm.server.framing.normalize_calls`
    logprobs: list[TokenLogprob]
    done: Done


class Encoder(Protocol):
    """Events → one API's stream frames."""

    media_type: str
    headers: dict[str, str]

    def head(self) -> list[bytes]:
        """Frames before the first event (Responses' ``response.created``, Anthropic's ``message_start``)."""
        ...

    def event(self, event: TextChunk | ToolCalls) -> list[bytes]: ...

    def done(self, done: Done) -> list[bytes]: ...

    def error(self, status: int, message: str) -> list[bytes]:
        """The API's own last frame for an error after the stream began."""
        ...


# ------------------------------------------------------------------------------------------ the path


async def installed(http: Request, model: Any, field: str = "model") -> tuple[str, InstalledModel]:
    """A request's model name (a name, never a path: a 400 otherwise) and the installed model (a 404 when there is
    none)."""
    name = check_name(model, field)
    return name, await run_sync(engine_of(http).store.get, name)


def context_of(http: Request, options: LoadOptions, model: InstalledModel) -> LoadOptions:
    """The context a request loads with: its ``num_ctx``, else the server's ``LOCALLLM_CONTEXT_LENGTH`` (for
    clients that cannot send one, such as Claude Code), else the planner's; capped to the trained context."""
    default = getattr(http.app.state, "context_length", None)
    if options.num_ctx is None and default:
        options = replace(options, num_ctx=int(default))
    return cap_ctx(options, model)


def cap_ctx(options: LoadOptions, model: InstalledModel) -> LoadOptions:
    """Like Ollama, a ``num_ctx`` above the model's trained context is capped to it."""
    if options.num_ctx is None:
        return options
    trained = info_of(model).get("context_length") or 0
    if trained and options.num_ctx > trained:
        return replace(options, num_ctx=int(trained))
    return options


def check_capabilities(call: Call, model: InstalledModel) -> None:
    """Tools, images and thinking against what the model can do; a forced tool call as a format. (The request's
    own fields, the logprobs range and the format schema among them, were checked by its translator.)"""
    req = call.request
    caps = capabilities(model)
    if "completion" not in caps:  # an embedding / rerank model
        what = "a reranking" if "rerank" in caps else "an embedding"
        raise bad_request(f'"{call.model}" is {what} model and does not support chat or text generation')
    if req.tools and "tools" not in caps:
        raise bad_request(f'"{call.model}" does not support tools', param="tools")
    if call.images:
        from localllm.server.images import media_kinds

        pictures, sound = media_kinds(req.messages, req.images)
        if sound and "audio" not in caps:
            raise bad_request(f'"{call.model}" does not support audio (it has no audio projector)')
        if pictures and "vision" not in caps:
            raise bad_request(f'"{call.model}" does not support images (it is not a multimodal model)')
    if asks_to_think(req.think) and "thinking" not in caps:
        if not call.relax_thinking:
            raise bad_request(f'"{call.model}" does not support thinking', param="think")
        req.think = None
    if call.force_tools is not None and req.tools:
        if req.format is not None:
            raise bad_request("a tool_choice that forces a tool call cannot be combined with a response format",
                              param="tool_choice")
        req.format = forced_call_schema(req.tools, call.force_tools)


def forced_call_schema(tools: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """:func:`localllm.toolschema.forced_call_schema` with its errors as a 400 naming the field.

    >>> forced_call_schema([{"type": "function", "function": {"name": "f"}}], [])["properties"]["name"]
    {'const': 'f'}
    """
    from localllm.toolschema import ToolSchemaError
    from localllm.toolschema import forced_call_schema as call_schema

    try:
        return call_schema(tools, names)
    except ToolSchemaError as e:
        raise bad_request(str(e), param=e.param) from None


async def begin(http: Request, call: Call) -> Run:
    """Steps 1–4: checks, the engine call, the first event. Raises (an HTTP error status) before any output."""
    name, model = await installed(http, call.model)
    check_capabilities(call, model)
    if call.images:  # the model takes images: check them (format, pixels), fetch http(s) ones where allowed
        from localllm.server.images import check_request, resolve

        check_request(call.request.messages, call.request.images)
        if call.request.messages is not None:
            await run_sync(resolve, call.request.messages, pool="work")
    options = context_of(http, call.options, model)
    agen = engine_of(http).agenerate(name, call.request, options, keep_alive=call.keep_alive, installed=model)
    first = await first_event(agen, http)  # a failure before any output raises here: a real status
    return Run(first, agen)


async def aclose(agen: AsyncIterator[Any]) -> None:
    """End the engine's stream (which cancels the request and frees its slot if it is still running)."""
    close = getattr(agen, "aclose", None)
    if close is not None:
        await close()


async def first_event(agen: AsyncIterator[Event], http: Request | None = None) -> Event:
    """The first event, so errors before the first byte get their real status. While waiting (in the
    queue, for a load, for the prompt) a client that disconnects cancels the request at once."""
    task = asyncio.ensure_future(agen.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.2)
            if done:
                return task.result()
            if http is not None and await http.is_disconnected():
                task.cancel()
                raise ClientGone()
    except BaseException:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # the generator ends with the cancellation: aclose must not race it
        await aclose(agen)
        raise


class Run:
    """A generation under way: its first event is in hand; stream it or collect it (once)."""

    def __init__(self, first: Event, agen: AsyncIterator[Event]):
        self.first = first
        self.agen = agen

    async def events(self) -> AsyncIterator[Event]:
        """The events up to and including :class:`Done` (fewer if the engine ends without one)."""
        event = self.first
        while True:
            yield event
            if isinstance(event, Done):
                return
            try:
                event = await self.agen.__anext__()
            except StopAsyncIteration:
                return

    def stream(self, encoder: Encoder) -> StreamingResponse:
        return StreamingResponse(self._frames(encoder), media_type=encoder.media_type, headers=encoder.headers)

    async def _frames(self, enc: Encoder) -> AsyncIterator[bytes]:
        try:
            for frame in enc.head():
                yield frame
            ended = False
            async for event in self.events():
                if isinstance(event, Done):
                    ended = True
                    frames = enc.done(event)
                else:
                    frames = enc.event(event)
                for frame in frames:
                    yield frame
            if not ended:
                for frame in enc.error(500, "the generation ended without a result"):
                    yield frame
        except Exception as e:  # noqa: BLE001 - reported in the stream, in the API's shape
            status, message = status_of(e)
            for frame in enc.error(status, message):
                yield frame
        finally:
            await aclose(self.agen)  # a client that went away (the task is cancelled) ends the request here

    async def collect(self) -> Result:
        content: list[str] = []
        thinking: list[str] = []
        calls: list[dict[str, Any]] = []
        logprobs: list[TokenLogprob] = []
        try:
            async for event in self.events():
                if isinstance(event, TextChunk):
                    (thinking if event.thinking else content).append(event.text)
                    logprobs.extend(event.logprobs or ())
                elif isinstance(event, ToolCalls):
                    calls.extend(event.calls)
                elif isinstance(event, Done):
                    return Result("".join(content), "".join(thinking), calls, logprobs, event)
        finally:
            await aclose(self.agen)
        raise APIError(500, "the generation ended without a result")


# ------------------------------------------------------------------------------------------ load, embed


async def load_or_unload(http: Request, model: str, keep_alive: float | None, options: LoadOptions) -> str:
    """An empty prompt loads the model (``load``); with ``keep_alive: 0`` it unloads it (``unload``)."""
    engine = engine_of(http)
    name, found = await installed(http, model)  # 404 for an unknown model
    if keep_alive == 0:
        await run_sync(engine.unload, name, pool="load")
        await run_sync(engine.unload, found.name, pool="load")  # loaded under its canonical name
        return "unload"
    await run_sync(engine.load, name, context_of(http, options, found), keep_alive=keep_alive, pool="load")
    return "load"


def shorten(model: str, found: InstalledModel, vectors: list[list[float]], dimensions: int | None,
            param: str = "dimensions") -> list[list[float]]:
    """Matryoshka truncation to ``dimensions``, renormalised, for a model whose catalog entry lists the sizes it was
    trained for (``matryoshka``); a smaller ``dimensions`` for any other model is a 400 (its shortened vectors would
    be noise). A ``dimensions`` at or above the width gives the vectors unchanged."""
    from localllm.api import shorten_vectors

    if not dimensions or not vectors or dimensions >= len(vectors[0]):
        return vectors
    sizes = found.catalog.matryoshka if found.catalog is not None else ()
    if not sizes:
        raise bad_request(f'"{model}" is not known to be Matryoshka-trained, so its {len(vectors[0])}-dimensional '
                          "embeddings cannot be shortened (dimensions)", param=param)
    if dimensions < min(sizes):
        raise bad_request(f'"{model}" was trained for embeddings of {min(sizes)} to {len(vectors[0])} dimensions, '
                          f"not {dimensions}", param=param)
    return shorten_vectors(vectors, dimensions)


async def embed_texts(http: Request, model: str, texts: list[str], options: dict[str, Any] | None,
                      keep_alive: float | None, *, truncate: bool = True) -> tuple[Pooled, int, InstalledModel]:
    """(embeddings with their token count and cut inputs, load ns, the installed model) for ``texts``. No texts
    loads the model as embeddings need it (so that the next embed finds it loaded) and answers no vectors; load ns
    is 0 unless this request loaded the model. A model with a rank head is a 400 (it scores pairs)."""
    engine = engine_of(http)
    name, found = await installed(http, model)
    if "rerank" in capabilities(found):
        raise bad_request(f'"{model}" is a reranking model and does not make embeddings; use /v1/rerank')
    _, load_options = options_of(options)
    load_options = replace(cap_ctx(load_options, found), embedding=True)
    before = loaded(engine, found.name)
    pooled = Pooled()
    if not texts:
        await run_sync(engine.load, name, load_options, keep_alive=keep_alive, pool="load")
    else:
        pooled = await run_cancellable(http, engine.embed_many, name, texts, load_options, keep_alive=keep_alive,
                                       truncate=truncate, pool="work")
    after = loaded(engine, found.name)
    load_ns = after.load_duration_ns if after is not None and after is not before else 0
    return pooled, load_ns, found


def loaded(engine: Engine, name: str) -> Resident | None:
    """The loaded model under its installed ``name`` (None when it is not loaded)."""
    return next((m for m in engine.ps() if m.name == name), None)
