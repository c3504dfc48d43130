"""One answer of the chat screen, streamed: the runner's events into a message view, the tool loop's rounds, and
what the status line says about it.

:class:`AnswerStreamer` runs on the screen's worker. It iterates the runner's async stream (``Runner.agenerate``:
the events of an in-process model's decode loop, or of a server's NDJSON stream, arrive on the event loop without
a thread of ours) and writes the text through ``Markdown.get_stream`` (which merges fragments when the screen
cannot keep up). A thinking model's reasoning streams first into a :class:`~localllm.tui.widgets.ThinkingView`,
which folds when the answer starts. With tools, each round's calls are shown, asked, run (Esc stops a running
tool) and their results sent back until the model answers in words. It returns an :class:`Answer`; saving it and
the final full render are the screen's.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from textual.widgets import Markdown

from .widgets import MessageView, ThinkingView, ToolCallView

if TYPE_CHECKING:
    from textual.notifications import SeverityLevel
    from textual.widgets.markdown import MarkdownStream

    from localllm.api import Done, GenerateRequest, Stats, ThinkValue
    from localllm.loader import LoadOptions
    from localllm.mcp.host import ServerStatus
    from localllm.mcp.loop import ToolCall, ToolChat, ToolTurn
    from localllm.session import Session

    from .host import AppHost


@dataclass
class AnswerInfo:
    """What the status line says about the last answer (filled in while it streams)."""

    model: str = ""
    where: str = ""  # where it ran: "llamacpp CPU", "server http://… 100% CPU"
    ttft_s: float | None = None
    stats: Stats | None = None  # of the Done event
    finish_reason: str = ""
    load_s: float | None = None  # the model load this answer waited for


@dataclass
class Answer:
    """What one answer produced: the last round's text, the reasoning, the closing event, the tool turn (its calls
    are saved with the answer), or the error to show."""

    text: str = ""
    thought: str = ""
    done: Done | None = None
    error: str | None = None
    turn: ToolTurn | None = None
    thinking_view: ThinkingView | None = None
    t_end: float = field(default_factory=time.perf_counter)  # the last event's arrival

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return [c.as_dict() for c in self.turn.calls] if self.turn is not None else []


class AnswerHost(Protocol):
    """What the streamer needs of the chat screen (:class:`~localllm.tui.chat.ChatScreen` implements it)."""

    tools_said: set[str]  # models already told they have no tool support

    @property
    def lapp(self) -> AppHost: ...

    def update_status(self, text: str | None = None) -> None: ...

    def notify(self, message: str, *, title: str = "", severity: SeverityLevel = "information",
               timeout: float | None = None, markup: bool = True) -> None: ...

    def tool_chat(self, conversation_id: int, params: dict[str, Any]) -> ToolChat | None: ...

    def say_failed(self, status: ServerStatus) -> None: ...

    def ask_tool(self, call: ToolCall) -> Awaitable[str]: ...  # the user's decision: "once", "chat" or "deny"


# the settings modal's words → the request's think
THINK: dict[str, ThinkValue] = {"on": True, "off": False, "low": "low", "medium": "medium", "high": "high"}


def request_from(messages: list[dict[str, Any]], params: dict[str, Any]) -> tuple[GenerateRequest, LoadOptions]:
    """A conversation's messages and parameters (the settings modal's) → the runner's request and load options."""
    from localllm.api import GenerateRequest, Sampling
    from localllm.loader import LoadOptions

    sampling = Sampling(given=frozenset())  # what the settings modal sets wins over a created model's PARAMETERs
    for key in ("temperature", "top_p", "top_k", "seed", "max_tokens"):
        if params.get(key) not in (None, ""):
            sampling.choose(**{key: params[key]})
    load = LoadOptions(num_ctx=int(params["num_ctx"]) if params.get("num_ctx") else None,
                       draft=str(params["draft"]) if params.get("draft") else "auto")
    think = THINK.get(str(params.get("think")))  # unset: the model's default
    return GenerateRequest(messages=messages, sampling=sampling, think=think), load


def describe_loaded(session: Session, model: str) -> str:
    """Where ``model`` runs, for the status line: ``llamacpp CPU``, ``llamacpp GPU 20/30``, ``server URL 100% CPU``."""
    try:
        running = next((r for r in session.runner.ps() if r.name == model), None)
    except Exception:  # noqa: BLE001 - an Ollama without /api/ps still chats
        running = None
    if session.remote:
        return f"{session.label} {running.processor}" if running is not None else session.label
    if running is None:
        return ""
    where = f"GPU {running.n_gpu_layers}/{running.n_layers}" if running.n_gpu_layers else "CPU"
    return f"{running.backend} {where}"


class AnswerStreamer:
    """Streams one answer into ``view`` (see the module's docstring); :meth:`run` returns what it produced."""

    def __init__(self, host: AnswerHost, view: MessageView, model: str, cancel: threading.Event, info: AnswerInfo):
        self.host, self.view, self.model, self.cancel, self.info = host, view, model, cancel, info
        self.answer = Answer()

    async def run(self, conversation_id: int, messages: list[dict[str, Any]], params: dict[str, Any]) -> Answer:
        """One generation, or with tools the rounds of the tool loop until the model answers in words."""
        try:
            session = await asyncio.to_thread(lambda: self.host.lapp.session)  # made on first use: may be slow
            turn = self.answer.turn = await self._tool_turn(session, conversation_id, messages, params)
            while True:
                tools, fmt = turn.next_request() if turn is not None else (None, None)
                request, options = request_from(turn.messages if turn is not None else messages, params)
                request.tools = tools
                if fmt is not None:
                    request.format = fmt
                calls = await self._round(session, request, options)
                if turn is None or self.cancel.is_set():
                    break
                pending = turn.answered(self.answer.text, calls)
                if not pending:
                    break
                for call in pending:
                    await self._run_call(turn, call)
                if self.cancel.is_set():
                    break
                if self.view.markdown.is_attached:
                    await self.view.markdown.update("")  # the next round's text replaces this one's
        except Exception as e:  # noqa: BLE001 - shown to the user as one sentence
            self.answer.error = error_text(e, self.model)
        return self.answer

    async def _tool_turn(self, session: Session, conversation_id: int, messages: list[dict[str, Any]],
                         params: dict[str, Any]) -> ToolTurn | None:
        """The tool loop's turn when this chat has MCP servers and the model's template renders tools."""
        host = self.host
        chat = host.tool_chat(conversation_id, params)
        if chat is None:
            return None
        chat.start()
        await self._await_servers(chat)
        for name in chat.servers:  # a failure (a bad mcp.json entry too) is said once
            if chat.host.status(name).state == "failed":
                host.say_failed(chat.host.status(name))
        if not await asyncio.to_thread(_supports_tools, session, self.model):
            if self.model not in host.tools_said:
                host.tools_said.add(self.model)
                host.notify(f"The chat template of {self.model} does not support tools: the MCP tools are not "
                            "given to it.", severity="warning", timeout=8)
            return None
        return chat.turn(messages)

    async def _await_servers(self, chat: ToolChat) -> None:
        """Wait (without blocking the app) for this chat's servers that are still starting."""
        mcp = chat.host
        while any(mcp.status(n).state == "starting" for n in chat.servers) and not self.cancel.is_set():
            starting = [n for n in chat.servers if mcp.status(n).state == "starting"]
            self.host.update_status(f"{self.model}: starting MCP server {', '.join(starting)}… (Esc stops)")
            await asyncio.sleep(0.1)

    async def _round(self, session: Session, request: GenerateRequest, options: LoadOptions) -> list[dict[str, Any]]:
        """One generation streamed into the view; the tool calls it asked for."""
        from localllm.api import Done, TextChunk, ToolCalls

        answer, info, view = self.answer, self.info, self.view
        parts: list[str] = []
        calls: list[dict[str, Any]] = []
        stream: MarkdownStream | None = Markdown.get_stream(view.markdown)
        t0 = time.perf_counter()
        try:
            async with aclosing(session.runner.agenerate(self.model, request, options, cancel=self.cancel)) as events:
                async for event in events:
                    answer.t_end = time.perf_counter()
                    if isinstance(event, TextChunk):
                        if info.ttft_s is None:
                            info.ttft_s = answer.t_end - t0
                        if event.thinking:
                            await self._thinking(event.text)
                            continue
                        if not parts and view.is_attached:
                            self.host.update_status(f"{self.model}: answering… (Esc stops)")
                            if answer.thinking_view is not None:
                                answer.thinking_view.finish()
                        parts.append(event.text)
                        answer.text = "".join(parts)
                        if stream is not None and view.markdown.is_attached:
                            await stream.write(event.text)
                        elif stream is not None:  # the user opened another conversation: keep the text only
                            await stream.stop()
                            stream = None
                    elif isinstance(event, ToolCalls):
                        calls.extend(event.calls)
                    elif isinstance(event, Done):
                        answer.done = event
                        info.stats, info.finish_reason = event.stats, event.finish_reason
                        if event.stats.load_duration:  # TTFT is the answer's: the model load is shown apart
                            info.load_s = event.stats.load_duration / 1e9
                            if info.ttft_s is not None:
                                info.ttft_s = max(0.0, info.ttft_s - info.load_s)
                        info.where = await asyncio.to_thread(describe_loaded, session, self.model)
        finally:
            answer.text = "".join(parts)
            if stream is not None:
                await stream.stop()
        return calls

    async def _thinking(self, text: str) -> None:
        """More reasoning: into its block above the answer (made on the first piece)."""
        answer = self.answer
        answer.thought += text
        if answer.thinking_view is not None:
            answer.thinking_view.show(answer.thought)
        elif self.view.is_attached:
            self.host.update_status(f"{self.model}: thinking… (Esc stops)")
            answer.thinking_view = ThinkingView(answer.thought, streaming=True)
            await self.view.mount(answer.thinking_view, before=self.view.markdown)

    async def _run_call(self, turn: ToolTurn, call: ToolCall) -> None:
        """Show one call, ask the first time, run it (Esc stops it), show its result."""
        host, chat = self.host, turn.chat
        block = ToolCallView(call)
        self.view.tool_calls.append(call)
        if self.view.is_attached:
            await self.view.mount(block, before=self.view.markdown)
        if call.info is None:  # no such tool: the model hears which there are
            turn.done(call, None)
            block.finish()
            return
        if chat.needs_asking(call):
            host.update_status(f"{self.model}: asks to call {call.tool}")
            decision = await host.ask_tool(call)
            if not chat.grant(call, decision):
                turn.done(call, None, denied=True)
                block.finish()
                return
        host.update_status(f"{self.model}: running {call.tool}… (Esc stops it)")
        task = asyncio.ensure_future(chat.host.acall(call.info, call.arguments))
        while not task.done() and not self.cancel.is_set():
            await asyncio.wait({task}, timeout=0.05)
        if not task.done():
            task.cancel()
            turn.done(call, None, stopped=True)
        else:
            turn.done(call, task.result())
        block.finish()


def _supports_tools(session: Session, model: str) -> bool:
    try:
        return "tools" in session.models.show(model).capabilities
    except Exception:  # noqa: BLE001 - unknown here: the generation will say what is wrong
        return True


def status_text(model: str, where: str, info: AnswerInfo | None) -> str:
    """The status line: model, where it runs, tokens/s, TTFT, context used, draft acceptance of the last answer.

    >>> status_text("smollm2:135m", "in-process", None)
    'smollm2:135m · in-process · no answer yet'
    """
    parts = [model, (info.where if info and info.where else where)]
    if info is None or info.stats is None:
        parts.append("no answer yet" if info is None or info.ttft_s is None else "stopped")
        return " · ".join(parts)
    stats = info.stats
    if info.finish_reason == "cancelled":
        parts.append("stopped")
    parts.append(f"{stats.eval_rate:.1f} tok/s")
    if info.ttft_s is not None:
        parts.append(f"TTFT {_duration(info.ttft_s)}")
    if stats.n_ctx:
        parts.append(f"ctx {stats.context_used}/{stats.n_ctx}")
    acceptance = stats.draft_acceptance
    parts.append(f"draft {acceptance:.0%}" if acceptance is not None else "no draft")
    if info.load_s:
        parts.append(f"load {_duration(info.load_s)}")
    return " · ".join(parts)


def _duration(seconds: float) -> str:
    """Milliseconds under a second, else seconds.

    >>> _duration(0.0421), _duration(4.407)
    ('42 ms', '4.41 s')
    """
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def error_text(e: Exception, model: str) -> str:
    """One sentence for the status line, with the way out where there is one."""
    from localllm.errors import ModelNotFoundError

    if isinstance(e, ModelNotFoundError):
        return f"{model} is not installed: F3 opens the model manager to pull it, then Ctrl+G answers."
    return str(e) or type(e).__name__


def stats_dict(answer: Answer, info: AnswerInfo, model: str, stopped: bool) -> dict[str, Any]:
    """What is saved with an answer for the status line of a reopened chat (:func:`info_from_saved` reads it)."""
    done = answer.done
    out: dict[str, Any] = {"model": model, "finish_reason": "cancelled" if stopped else
                           (done.finish_reason if done is not None else "stop")}
    if info.ttft_s is not None:
        out["ttft_ms"] = round(info.ttft_s * 1000, 1)
    if info.where:
        out["backend"] = info.where  # the key older chats have
    if done is not None and done.stats is not None:
        s = done.stats
        out.update(eval_count=s.eval_count, tokens_per_s=round(s.eval_rate, 2), context_used=s.context_used,
                   n_ctx=s.n_ctx, draft_proposed=s.draft_proposed, draft_accepted=s.draft_accepted)
        if s.thinking_tokens:
            out["thinking_tokens"] = s.thinking_tokens
    return out


def info_from_saved(stats: dict[str, Any] | None) -> AnswerInfo | None:
    """The status line's data for an answer saved earlier (so a reopened chat shows its last stats).

    >>> info = info_from_saved({"model": "m", "eval_count": 50, "tokens_per_s": 100.0, "ttft_ms": 40.0,
    ...                         "n_ctx": 4096, "context_used": 120, "backend": "llamacpp CPU"})
    >>> status_text("m", "in-process", info)
    'm · llamacpp CPU · 100.0 tok/s · TTFT 40 ms · ctx 120/4096 · no draft'
    """
    if not stats or not stats.get("eval_count"):
        return None
    from localllm.api import Stats

    tps = float(stats.get("tokens_per_s") or 0)
    count = int(stats["eval_count"])
    s = Stats(eval_count=count, eval_duration=int(count / tps * 1e9) if tps else 0,
              n_ctx=int(stats.get("n_ctx") or 0), context_used=int(stats.get("context_used") or 0),
              draft_proposed=int(stats.get("draft_proposed") or 0),
              draft_accepted=int(stats.get("draft_accepted") or 0))
    ttft = stats.get("ttft_ms")
    return AnswerInfo(model=str(stats.get("model") or ""), where=str(stats.get("backend") or ""),
                      ttft_s=float(ttft) / 1000 if ttft is not None else None, stats=s,
                      finish_reason=str(stats.get("finish_reason") or ""))
