"""The tool loop of a chat, without I/O: what the REPL (:mod:`localllm.cli.interactive`) and the terminal app
(:mod:`localllm.tui.answer`) share. A face generates, asks the user and shows things; this module decides
which tools go with a request, whether a call needs asking, what goes back to the model, and when to stop.

One user turn, as both faces run it::

    chat = ToolChat(host, ["time"])                  # per conversation: enabled servers, what the user allowed
    turn = chat.turn(history, force=False)
    while True:
        tools, fmt = turn.next_request()             # tools=None once the rounds are used up
        answer = generate(turn.messages, tools, fmt) # the face's own streaming; tool calls parsed by the engine
        calls = turn.answered(answer.text, answer.tool_calls)
        if not calls:
            break                                    # a plain answer ends the turn
        for call in calls:
            show(call)                               # tool and arguments
            if call.tool and chat.needs_asking(call):
                chat.grant(call, ask(call))          # "once" | "chat" | "deny"
            turn.done(call, chat.run(call) or ...)   # the result (or the refusal, or the error) as a tool message

The model sees the result as a ``tool`` message after an assistant turn carrying the calls (the shapes the
chat templates render); a tool's error goes back the same way, as the tool's answer. ``MAX_ROUNDS`` bounds the
calls a single question can cause: the last round is generated without tools, so it must answer in words.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from localllm.mcp.host import McpHost, ToolInfo, ToolResult

MAX_ROUNDS = 5  # generations per user turn that may call tools; then one more must answer in words
Decision = Literal["once", "chat", "deny"]
DENIED = "The user did not allow this tool call."


@dataclass
class ToolCall:
    """One call the model made, and what became of it (saved with the chat, shown in the conversation)."""

    tool: str  # the public name the model used
    arguments: dict[str, Any] = field(default_factory=dict)
    server: str = ""
    result: str = ""
    is_error: bool = False
    status: str = "pending"  # pending | done | error | denied | stopped
    round: int = 0
    truncated: bool = False
    seconds: float = 0.0
    info: ToolInfo | None = field(default=None, repr=False, compare=False)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("info")
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ToolCall:
        keys = {"tool", "arguments", "server", "result", "is_error", "status", "round", "truncated", "seconds"}
        return cls(**{k: v for k, v in data.items() if k in keys})

    def summary(self) -> str:
        """``get_current_time {"timezone": "UTC"}`` for a title line."""
        import json

        args = json.dumps(self.arguments, ensure_ascii=False)
        return f"{self.tool} {args if len(args) <= 80 else args[:79] + '…'}"


def history_messages(calls: list[ToolCall], answer: str) -> list[dict[str, Any]]:
    """A saved turn's calls and final answer → the messages the model saw (assistant with its calls, then each
    result as a ``tool`` message, round by round, then the answer)."""
    out: list[dict[str, Any]] = []
    rounds = sorted({c.round for c in calls})
    for r in rounds:
        mine = [c for c in calls if c.round == r]
        out.append(assistant_with_calls("", mine))
        out += [tool_message(c) for c in mine]
    out.append({"role": "assistant", "content": answer})
    return out


def assistant_with_calls(text: str, calls: list[ToolCall]) -> dict[str, Any]:
    return {"role": "assistant", "content": text,
            "tool_calls": [{"type": "function", "function": {"name": c.tool, "arguments": c.arguments}}
                           for c in calls]}


def tool_message(call: ToolCall) -> dict[str, Any]:
    return {"role": "tool", "content": call.result, "name": call.tool, "tool_name": call.tool}


class ToolChat:
    """The tools of one conversation: its enabled servers and single tools, and what the user allowed."""

    def __init__(self, host: McpHost, servers: list[str], disabled: list[str] | None = None):
        self.host = host
        self.servers = list(dict.fromkeys(servers))
        self.disabled = list(disabled or [])
        self.allowed: set[str] = set()  # "server/tool" allowed for the rest of this chat

    def start(self) -> None:
        """Start the enabled servers in the background (returns at once)."""
        self.host.start(self.servers)

    def tools(self) -> list[ToolInfo]:
        return self.host.tools(self.servers, self.disabled)

    def find(self, public: str) -> ToolInfo | None:
        return next((t for t in self.tools() if t.public == public), None)

    def needs_asking(self, call: ToolCall) -> bool:
        return f"{call.server}/{call.info.name if call.info else call.tool}" not in self.allowed

    def grant(self, call: ToolCall, decision: Decision | str) -> bool:
        """Record the user's answer; True when the call may run."""
        if decision == "chat" and call.info is not None:
            self.allowed.add(f"{call.server}/{call.info.name}")
        return decision != "deny"

    def run(self, call: ToolCall, cancel: threading.Event | None = None) -> ToolResult:
        """Call the tool (blocking: the REPL; ``cancel`` set stops it); the app awaits :meth:`McpHost.acall`."""
        assert call.info is not None
        return self.host.call(call.info, call.arguments, cancel=cancel)

    def turn(self, messages: list[dict[str, Any]], *, force: bool = False) -> ToolTurn:
        return ToolTurn(self, messages, force=force)


class ToolTurn:
    """One user turn's rounds: the messages so far, the calls made, what the next request carries."""

    def __init__(self, chat: ToolChat, messages: list[dict[str, Any]], *, force: bool = False):
        self.chat = chat
        self.messages = list(messages)
        self.force = force
        self.round = 0
        self.calls: list[ToolCall] = []
        self._pending: list[ToolCall] = []

    def next_request(self) -> tuple[list[dict[str, Any]] | None, dict[str, Any] | None]:
        """(tools, format) for the next generation: the enabled tools, a forced call's schema on the first
        round when ``force``; (None, None) when there are none or the rounds are used up."""
        tools = [t.spec() for t in self.chat.tools()]
        if not tools or self.round >= MAX_ROUNDS:
            return None, None
        if self.force and self.round == 0:
            from localllm.toolschema import forced_call_schema

            return tools, forced_call_schema(tools, [])
        return tools, None

    def answered(self, text: str, calls: list[dict[str, Any]]) -> list[ToolCall]:
        """The model's answer: the calls to make now ([] when it answered in words: the turn is over)."""
        if not calls:
            return []
        out: list[ToolCall] = []
        for c in calls:
            args = c.get("arguments")
            call = ToolCall(tool=str(c.get("name") or ""), arguments=args if isinstance(args, dict) else {},
                            round=self.round)
            call.info = self.chat.find(call.tool)
            if call.info is None:
                call.status, call.is_error = "error", True
                names = ", ".join(t.public for t in self.chat.tools()) or "none"
                call.result = f'There is no tool "{call.tool}"; the tools are: {names}.'
            else:
                call.server = call.info.server
            out.append(call)
        self.messages.append(assistant_with_calls(text, out))
        self._pending = out
        self.calls += out
        return out

    def done(self, call: ToolCall, result: ToolResult | None, *, denied: bool = False,
             stopped: bool = False) -> None:
        """A call's outcome: its result, a refusal, or a stop; it goes back to the model as a tool message."""
        if denied:
            call.status, call.result, call.is_error = "denied", DENIED, True
        elif stopped:
            call.status, call.result, call.is_error = "stopped", "The user stopped this tool call.", True
        elif result is not None:
            call.result, call.is_error, call.truncated = result.text, result.is_error, result.truncated
            call.seconds = round(result.seconds, 3)
            call.status = "error" if result.is_error else "done"
        self.messages.append(tool_message(call))
        if all(c.status != "pending" for c in self._pending):
            self.round += 1
