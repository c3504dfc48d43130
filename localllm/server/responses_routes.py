"""OpenAI's Responses API (``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``; its translator
:data:`API`, errors in OpenAI's shape) on the one generation path: the body is translated into a
:class:`~localllm.server.generation.Call` and the events into Responses items and stream events (pure functions
and :class:`ResponsesEncoder` below).

* ``input`` is a string (one user turn) or items: messages (roles user, system, developer, assistant; text and
  image parts), ``function_call``/``custom_tool_call`` and their outputs, ``reasoning`` items; the items of
  hosted tools (web search, file search, computer, code interpreter, MCP, image generation, shell) are left out
  with a log line; ``instructions`` is the first system turn (not carried over to later responses, as OpenAI
  does). ``developer`` is a system turn.
* ``tools``: function, ``namespace`` (flattened) and ``custom`` tools; hosted ones are left out
  (:mod:`~localllm.server.agent_tools`). A call comes back under the name (and namespace) the client declared.
* ``include: ["reasoning.encrypted_content"]``: reasoning items carry an opaque ``encrypted_content`` that
  brings the reasoning back when the client returns the item (``store: false`` clients such as Codex).
  ``prompt_cache_key``, ``client_metadata``, ``parallel_tool_calls`` and ``service_tier`` are accepted.
* ``previous_response_id``: the conversation of an earlier response (its input and output) goes first. Kept in
  memory for the server's life in a bounded LRU (:class:`ResponseStore`); ``store: false`` keeps nothing.
* ``reasoning.effort`` sets ``think``; the reasoning comes back as a ``reasoning`` item (its text in
  ``summary``, as Ollama sends it), streamed as ``response.reasoning_summary_text.delta``.
* ``include: ["message.output_text.logprobs"]`` with ``top_logprobs`` (0-20): logprobs on the output text.
* Streams: ``response.created``, ``response.in_progress``, per item ``response.output_item.added`` … deltas …
  ``response.output_item.done``, then ``response.completed`` (``response.incomplete`` when
  ``max_output_tokens`` cut the answer, ``response.failed`` for an error after the stream began).
"""

from __future__ import annotations

import base64
import json
import logging
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from localllm.api import Done, GenerateRequest, Stats, TextChunk, TokenLogprob, ToolCalls
from localllm.server import generation as g
from localllm.server.agent_tools import CUSTOM_ARG, ToolNames, responses_tools
from localllm.server.audio import from_input_audio
from localllm.server.checks import check_format, check_tools, forced_tools
from localllm.server.errors import APIError, bad_request
from localllm.server.framing import SSE, SSE_HEADERS, call_id, logprob_item, normalize_calls, sse
from localllm.server.images import from_url
from localllm.server.openai_routes import begin, error_body
from localllm.server.options import api_options, check_top_logprobs, keep_alive_of, think_from_effort
from localllm.server.schemas import ResponsesBody
from localllm.server.translator import Translator

router = APIRouter(prefix="/v1")
log = logging.getLogger("localllm.server")
API = Translator("responses", router, error_body, prefix="/v1/responses")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
ENCRYPTED_INCLUDE = "reasoning.encrypted_content"
ENCRYPTED_PREFIX = "localllm.v1."  # our opaque reasoning values: this, then the text as URL-safe base64
# input items of hosted tools: their results cannot reach a local model's prompt, so they are left out
HOSTED_ITEMS = ("web_search_call", "file_search_call", "computer_call", "computer_call_output",
                "code_interpreter_call", "image_generation_call", "mcp_call", "mcp_list_tools",
                "mcp_approval_request", "mcp_approval_response", "local_shell_call", "local_shell_call_output",
                "shell_call", "shell_call_output", "apply_patch_call", "apply_patch_call_output", "tool_search_call",
                "tool_search_output", "compaction", "compaction_summary")
MAX_STORED = 1024  # responses kept for previous_response_id
MAX_STORED_BYTES = 64 << 20  # and their conversations' size, roughly


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


# ------------------------------------------------------------------------------------------ the store


@dataclass
class Stored:
    messages: list[dict[str, Any]]  # the conversation up to and including this response's output
    response: dict[str, Any]  # the response object (GET /v1/responses/{id})
    size: int = 0


class ResponseStore:
    """Responses by id for ``previous_response_id``: least recently used first out, bounded in count and size."""

    def __init__(self, max_entries: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, rid: str, messages: list[dict[str, Any]], response: dict[str, Any]) -> None:
        size = len(json.dumps(messages, default=str)) + len(json.dumps(response, default=str))
        with self._lock:
            old = self._items.pop(rid, None)
            if old is not None:
                self._bytes -= old.size
            self._items[rid] = Stored(messages, response, size)
            self._bytes += size
            while self._items and (len(self._items) > self.max_entries or self._bytes > self.max_bytes):
                _, gone = self._items.popitem(last=False)
                self._bytes -= gone.size

    def get(self, rid: str) -> Stored | None:
        with self._lock:
            item = self._items.get(rid)
            if item is not None:
                self._items.move_to_end(rid)
            return item

    def delete(self, rid: str) -> bool:
        with self._lock:
            item = self._items.pop(rid, None)
            if item is not None:
                self._bytes -= item.size
            return item is not None

    def __len__(self) -> int:
        return len(self._items)


def _store(http: Request) -> ResponseStore:
    return http.app.state.responses  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------------ requests (pure)


def _text_of(content: Any, where: str) -> tuple[str, list[Any]]:
    """A message's content (a string or parts) → (text, base64 images)."""
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content parts", param="input")
    texts: list[str] = []
    images: list[Any] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.content[{j}].text must be a string", param="input")
            texts.append(part["text"])
        elif kind == "input_image":
            url = part.get("image_url")
            if isinstance(url, dict):
                url = url.get("url")
            images.append(from_url(url, f"{where}.content[{j}].image_url"))
        elif kind == "input_audio":  # a clip rides with the images (told apart by its bytes)
            images.append(from_input_audio(part.get("input_audio"), f"{where}.content[{j}].input_audio", "input"))
        elif kind == "refusal":
            continue
        else:
            raise bad_request(f"{where}.content[{j}]: content type {str(kind)[:40]!r} is not supported",
                              param="input")
    return "\n".join(texts), images


def input_messages(value: Any) -> tuple[list[dict[str, Any]], bool]:
    """``input`` (a string or items) → backend messages; also whether any carries an image."""
    if value is None or value == "":
        return [], False
    if isinstance(value, str):
        return [{"role": "user", "content": value}], False
    out: list[dict[str, Any]] = []
    images = False
    names: dict[str, str] = {}  # call_id -> function name
    thinking: list[str] = []  # reasoning items waiting for the assistant turn they belong to
    last_assistant: dict[str, Any] | None = None  # the turn function calls attach to
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", param="input")
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role must be user, system, developer or assistant", param="input")
            text, imgs = _text_of(item.get("content"), where)
            msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": text}
            if imgs:
                images = True
                msg["images"] = imgs
            if role == "assistant":
                if thinking:
                    msg["thinking"] = msg["reasoning_content"] = "\n".join(thinking)
                    thinking = []
                last_assistant = msg
            else:
                last_assistant = None
            out.append(msg)
        elif kind in ("function_call", "custom_tool_call"):
            custom = kind == "custom_tool_call"
            name, cid = item.get("name"), item.get("call_id")
            args = item.get("input", "") if custom else item.get("arguments", "{}")
            if not isinstance(name, str) or not isinstance(cid, str) or not isinstance(args, str):
                raise bad_request(f"{where}: a {kind} needs call_id, name and "
                                  f"{'input (a string)' if custom else 'arguments (a JSON string)'}", param="input")
            if custom:
                parsed: Any = {CUSTOM_ARG: args}
            else:
                try:
                    parsed = json.loads(args) if args.strip() else {}
                except ValueError:
                    raise bad_request(f"{where}.arguments is not valid JSON", param="input") from None
            namespace = item.get("namespace")
            name = ToolNames().function_of(name, namespace if isinstance(namespace, str) else None)
            names[cid] = name
            call = {"type": "function", "id": cid, "function": {"name": name, "arguments": parsed}}
            if last_assistant is None:
                last_assistant = {"role": "assistant", "content": ""}
                out.append(last_assistant)
            if thinking:
                last_assistant["thinking"] = last_assistant["reasoning_content"] = "\n".join(thinking)
                thinking = []
            last_assistant.setdefault("tool_calls", []).append(call)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            cid, output = item.get("call_id"), item.get("output")
            if not isinstance(cid, str):
                raise bad_request(f"{where}.call_id must be a string", param="input")
            text, _ = _text_of(output, where) if not isinstance(output, str) else (output, [])
            msg = {"role": "tool", "content": text, "tool_call_id": cid}
            if cid in names:
                msg["name"] = msg["tool_name"] = names[cid]
            out.append(msg)
            last_assistant = None
        elif kind == "reasoning":
            text = decrypt(item.get("encrypted_content"))
            if not text:  # not ours (or none): the summary and content the client kept
                parts = [p.get("text", "") for key in ("summary", "content") if isinstance(item.get(key), list)
                         for p in item[key] if isinstance(p, dict)]
                text = "\n".join(t for t in parts if isinstance(t, str) and t)
            if text:
                thinking.append(text)
        elif kind == "item_reference":
            raise bad_request(f"{where}: item references are not supported; send previous_response_id or the "
                              "items themselves", param="input")
        elif kind in HOSTED_ITEMS:
            log.info("input item %s (a hosted tool's) left out of the prompt", kind)
        else:
            raise bad_request(f"{where}: input item type {str(kind)[:40]!r} is not supported", param="input")
    return out, images


def tools_in(tools: list[dict[str, Any]] | None, choice: Any) -> tuple[list[dict[str, Any]] | None, ToolNames]:
    """Responses' tools → the backend's ``{"type": "function", "function": {...}}`` (namespaces flattened, custom
    tools as one-string functions, hosted ones left out) and the map from function names back to the client's."""
    out, names = responses_tools(tools)
    if not out or choice == "none":
        return None, names
    return check_tools(out), names


def encrypt(text: str) -> str:
    """Reasoning as an opaque value for ``encrypted_content`` (nothing is kept on the server: it comes back with
    the item). Not a secret: the client already has the reasoning.

    >>> decrypt(encrypt("let me think"))
    'let me think'
    """
    return ENCRYPTED_PREFIX + base64.urlsafe_b64encode(text.encode()).decode()


def decrypt(value: Any) -> str:
    """The reasoning in one of our ``encrypted_content`` values; "" for anything else (another server's)."""
    if not isinstance(value, str) or not value.startswith(ENCRYPTED_PREFIX):
        return ""
    try:
        return base64.urlsafe_b64decode(value[len(ENCRYPTED_PREFIX):].encode()).decode()
    except ValueError:
        return ""


def text_format(text: dict[str, Any] | None) -> str | dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not fmt:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return "json"
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise bad_request("text.format.schema must be a JSON schema object", param="text")
        return check_format(schema, "text.format.schema")
    raise bad_request(f"text.format.type must be text, json_object or json_schema, got {str(kind)[:40]!r}",
                      param="text")


def responses_call(body: ResponsesBody,
                   history: list[dict[str, Any]]) -> tuple[g.Call, list[dict[str, Any]], ToolNames]:
    """The body (after ``history``, the previous response's conversation) → (the generation, the conversation
    to store with this response, without ``instructions``; the map from function names to the client's tools)."""
    messages, images = input_messages(body.input)
    conversation = history + messages
    if not any(m["role"] != "system" for m in conversation):
        raise bad_request("input is required", param="input")
    full = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    sampling, options = api_options(body.options, {"temperature": 1.0, "top_p": 1.0},
                                    max_tokens=body.max_output_tokens, max_field="max_output_tokens",
                                    temperature=body.temperature, top_p=body.top_p, num_ctx=body.num_ctx)
    logprobs = LOGPROBS_INCLUDE in (body.include or []) or body.top_logprobs is not None
    top = check_top_logprobs(body.top_logprobs)
    tools, names = tools_in(body.tools, body.tool_choice)
    req = GenerateRequest(messages=full, sampling=sampling, format=text_format(body.text), tools=tools,
                          think=think_from_effort(body.reasoning.effort if body.reasoning else None, "reasoning"),
                          logprobs=logprobs, top_logprobs=top if logprobs else 0)
    force = forced_tools(body.tool_choice) if req.tools else None
    return g.Call(body.model, req, options, keep_alive_of(body.keep_alive), images=images,
                  force_tools=force), conversation, names


# ------------------------------------------------------------------------------------ answers (pure)


def _logprobs(lps: list[TokenLogprob]) -> list[dict[str, Any]]:
    return [logprob_item(lp, True) for lp in lps]


def reasoning_item(iid: str, text: str, encrypted: bool = False) -> dict[str, Any]:
    item: dict[str, Any] = {"id": iid, "type": "reasoning", "summary": [{"type": "summary_text", "text": text}]}
    if encrypted:
        item["encrypted_content"] = encrypt(text)
    return item


def message_item(iid: str, text: str, lps: list[TokenLogprob], status: str = "completed") -> dict[str, Any]:
    return {"id": iid, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": _logprobs(lps)}]}


def call_items(calls: list[dict[str, Any]], names: ToolNames | None = None) -> list[dict[str, Any]]:
    """The model's calls as output items, under the names the client declared: a ``function_call`` (with its
    ``namespace`` for a namespace's member) or a ``custom_tool_call`` carrying the text."""
    out = []
    for call in normalize_calls(calls):
        fn = call["function"]
        tool = names.resolve(fn["name"]) if names is not None else None
        args = fn["arguments"]
        if tool is not None and tool.custom:
            text = args.get(CUSTOM_ARG) if isinstance(args, dict) else args
            out.append({"id": _id("ctc"), "type": "custom_tool_call", "status": "completed",
                        "call_id": call_id(call), "name": tool.name,
                        "input": text if isinstance(text, str) else json.dumps(args)})
            continue
        item = {"id": _id("fc"), "type": "function_call", "status": "completed", "call_id": call_id(call),
                "name": tool.name if tool is not None else fn["name"], "arguments": json.dumps(args)}
        if tool is not None and tool.namespace:
            item["namespace"] = tool.namespace
        out.append(item)
    return out


def usage(stats: Stats) -> dict[str, Any]:
    i, o = int(stats.prompt_eval_count), int(stats.eval_count)
    return {"input_tokens": i, "input_tokens_details": {"cached_tokens": int(stats.prompt_cached_tokens)},
            "output_tokens": o, "output_tokens_details": {"reasoning_tokens": int(stats.thinking_tokens)},
            "total_tokens": i + o}


def response_object(rid: str, body: ResponsesBody, created: int, *, status: str, output: list[dict[str, Any]],
                    done: Done | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
    incomplete = status == "incomplete"
    return {
        "id": rid, "object": "response", "created_at": created, "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": error, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": body.model,
        "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
        "store": body.store, "temperature": body.temperature if body.temperature is not None else 1.0,
        "text": body.text or {"format": {"type": "text"}}, "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [], "top_p": body.top_p if body.top_p is not None else 1.0,
        "top_logprobs": body.top_logprobs or 0, "truncation": body.truncation or "disabled",
        "usage": usage(done.stats) if done is not None else None, "user": body.user,
        "metadata": body.metadata or {}, "service_tier": "default",
    }


def status_of_done(done: Done) -> str:
    return "incomplete" if done.finish_reason == "length" else "completed"


def output_messages(thinking: str, content: str, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """This response's output as the next turn of the conversation (for ``previous_response_id``)."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking:
        msg["thinking"] = msg["reasoning_content"] = thinking
    calls = [{"type": "function", "id": it["call_id"],
              "function": {"name": ToolNames().function_of(it["name"], it.get("namespace")),
                           "arguments": json.loads(it["arguments"]) if "arguments" in it
                           else {CUSTOM_ARG: it["input"]}}}
             for it in items if it["type"] in ("function_call", "custom_tool_call")]
    if calls:
        msg["tool_calls"] = calls
    return [msg]


@dataclass
class Context:
    """One response being made: its id, the body, and where to keep it when it completes."""

    rid: str
    body: ResponsesBody
    conversation: list[dict[str, Any]]
    store: ResponseStore
    names: ToolNames = field(default_factory=ToolNames)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def encrypted(self) -> bool:
        """Whether reasoning items carry ``encrypted_content`` (the client asked for it in ``include``)."""
        return ENCRYPTED_INCLUDE in (self.body.include or [])

    def finish(self, status: str, output: list[dict[str, Any]], done: Done, thinking: str,
               content: str) -> dict[str, Any]:
        obj = response_object(self.rid, self.body, self.created, status=status, output=output, done=done)
        if self.body.store:
            self.store.put(self.rid, self.conversation + output_messages(thinking, content, output), obj)
        return obj


def collected(ctx: Context, r: g.Result) -> dict[str, Any]:
    output: list[dict[str, Any]] = []
    if r.thinking:
        output.append(reasoning_item(_id("rs"), r.thinking, ctx.encrypted))
    if r.content or not r.calls:
        output.append(message_item(_id("msg"), r.content, r.logprobs))
    output += call_items(r.calls, ctx.names)
    return ctx.finish(status_of_done(r.done), output, r.done, r.thinking, r.content)


class ResponsesEncoder:
    """Events → the Responses stream (``event: <type>`` + ``data: {..., "sequence_number"}``)."""

    media_type = SSE
    headers = SSE_HEADERS

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.open: dict[str, Any] | None = None  # the item being streamed: {"kind", "id", "text", "logprobs"}
        self.thinking: list[str] = []
        self.content: list[str] = []

    def _ev(self, kind: str, **payload: Any) -> bytes:
        frame = sse({"type": kind, "sequence_number": self.seq, **payload}, event=kind)
        self.seq += 1
        return frame

    def _progress(self, status: str) -> dict[str, Any]:
        return response_object(self.ctx.rid, self.ctx.body, self.ctx.created, status=status, output=[])

    def head(self) -> list[bytes]:
        return [self._ev("response.created", response=self._progress("in_progress")),
                self._ev("response.in_progress", response=self._progress("in_progress"))]

    def _close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        index, iid, text = len(self.output), item["id"], "".join(item["text"])
        if item["kind"] == "reasoning":
            done_item = reasoning_item(iid, text, self.ctx.encrypted)
            part = {"type": "summary_text", "text": text}
            frames = [self._ev("response.reasoning_summary_text.done", item_id=iid, output_index=index,
                               summary_index=0, text=text),
                      self._ev("response.reasoning_summary_part.done", item_id=iid, output_index=index,
                               summary_index=0, part=part)]
        else:
            done_item = message_item(iid, text, item["logprobs"])
            part = done_item["content"][0]
            frames = [self._ev("response.output_text.done", item_id=iid, output_index=index, content_index=0,
                               text=text, logprobs=part["logprobs"]),
                      self._ev("response.content_part.done", item_id=iid, output_index=index, content_index=0,
                               part=part)]
        self.output.append(done_item)
        return frames + [self._ev("response.output_item.done", output_index=index, item=done_item)]

    def _open(self, kind: str) -> list[bytes]:
        if self.open is not None and self.open["kind"] == kind:
            return []
        frames = self._close()
        index = len(self.output)
        if kind == "reasoning":
            iid = _id("rs")
            frames += [self._ev("response.output_item.added", output_index=index,
                                item={"id": iid, "type": "reasoning", "summary": []}),
                       self._ev("response.reasoning_summary_part.added", item_id=iid, output_index=index,
                                summary_index=0, part={"type": "summary_text", "text": ""})]
        else:
            iid = _id("msg")
            frames += [self._ev("response.output_item.added", output_index=index,
                                item={"id": iid, "type": "message", "status": "in_progress", "role": "assistant",
                                      "content": []}),
                       self._ev("response.content_part.added", item_id=iid, output_index=index, content_index=0,
                                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]
        self.open = {"kind": kind, "id": iid, "text": [], "logprobs": []}
        return frames

    def event(self, event: TextChunk | ToolCalls) -> list[bytes]:
        if isinstance(event, ToolCalls):
            frames = self._close()
            for item in call_items(event.calls, self.ctx.names):
                index = len(self.output)
                if item["type"] == "custom_tool_call":
                    frames += [self._ev("response.output_item.added", output_index=index,
                                        item={**item, "status": "in_progress", "input": ""}),
                               self._ev("response.custom_tool_call_input.delta", item_id=item["id"],
                                        output_index=index, delta=item["input"]),
                               self._ev("response.custom_tool_call_input.done", item_id=item["id"],
                                        output_index=index, input=item["input"])]
                else:
                    frames += [self._ev("response.output_item.added", output_index=index,
                                        item={**item, "status": "in_progress", "arguments": ""}),
                               self._ev("response.function_call_arguments.delta", item_id=item["id"],
                                        output_index=index, delta=item["arguments"]),
                               self._ev("response.function_call_arguments.done", item_id=item["id"],
                                        output_index=index, name=item["name"], arguments=item["arguments"])]
                frames.append(self._ev("response.output_item.done", output_index=index, item=item))
                self.output.append(item)
            return frames
        if not event.text:
            return []
        kind = "reasoning" if event.thinking else "message"
        frames = self._open(kind)
        assert self.open is not None
        self.open["text"].append(event.text)
        (self.thinking if event.thinking else self.content).append(event.text)
        if event.thinking:
            return frames + [self._ev("response.reasoning_summary_text.delta", item_id=self.open["id"],
                                      output_index=len(self.output), summary_index=0, delta=event.text)]
        lps = list(event.logprobs or ())
        self.open["logprobs"] += lps
        return frames + [self._ev("response.output_text.delta", item_id=self.open["id"], output_index=len(self.output),
                                  content_index=0, delta=event.text, logprobs=_logprobs(lps))]

    def done(self, done: Done) -> list[bytes]:
        frames = self._close()
        if not self.output:  # an empty answer is still one (empty) message
            frames += self._open("message") + self._close()
        status = status_of_done(done)
        obj = self.ctx.finish(status, self.output, done, "".join(self.thinking), "".join(self.content))
        return frames + [self._ev(f"response.{status}", response=obj)]

    def error(self, status: int, message: str) -> list[bytes]:
        frames = self._close()
        err = {"code": "server_error" if status >= 500 else "invalid_request", "message": message}
        obj = response_object(self.ctx.rid, self.ctx.body, self.ctx.created, status="failed", output=self.output,
                              error=err)
        return frames + [self._ev("response.failed", response=obj)]


# ------------------------------------------------------------------------------------------ routes


@router.post("/responses")
async def create(body: ResponsesBody, request: Request) -> Response:
    store = _store(request)
    history: list[dict[str, Any]] = []
    if body.previous_response_id:
        prev = store.get(body.previous_response_id)
        if prev is None:
            raise APIError(404, f"Previous response with id '{body.previous_response_id[:80]}' not found.",
                           param="previous_response_id")
        history = list(prev.messages)
    call, conversation, names = responses_call(body, history)
    ctx = Context(_id("resp"), body, conversation, store, names)
    run = await begin(request, call)
    if body.stream:
        return run.stream(ResponsesEncoder(ctx))
    return JSONResponse(collected(ctx, await run.collect()))


@router.get("/responses/{rid}")
async def retrieve(rid: str, request: Request) -> dict[str, Any]:
    item = _store(request).get(rid)
    if item is None:
        raise APIError(404, f"Response with id '{rid[:80]}' not found.")
    return item.response


@router.delete("/responses/{rid}")
async def delete(rid: str, request: Request) -> dict[str, Any]:
    if not _store(request).delete(rid):
        raise APIError(404, f"Response with id '{rid[:80]}' not found.")
    return {"id": rid, "object": "response", "deleted": True}
