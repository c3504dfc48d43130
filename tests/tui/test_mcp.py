"""MCP tools in the terminal app, in Textual's pilot: the decision to call comes from a scripted token source
(the fake, under the real decode loop and stream); the MCP server is a real process (tests/mcp_server.py), the
confirmation is answered in the modal, the arguments arrive at the server, the result is in the model's next
rendered prompt (the fake answers with it), the calls are saved with the answer and come back when the chat
is reopened. Faults: Esc during a running tool, a server killed mid-call, a server that does not start; after
each the app answers the next message; no server process is left once the app has exited."""

from __future__ import annotations

import json

import psutil
import pytest

from localllm.tui.app import LocalLLMApp
from localllm.tui.modals import SettingsModal, ToolConfirmModal
from localllm.tui.widgets import ToolCallView
from tests.cli.test_mcp_repl import TOOL_MODEL, tool_store  # noqa: F401 - the fixture
from tests.test_mcp_host import recorder

from .test_chat import wait_for_screen, wait_until

pytestmark = pytest.mark.asyncio


def make_app(store, chats, tmp_path, calls, servers, **knobs):
    from localllm.engine import Engine
    from localllm.mcp.config import parse_config
    from localllm.mcp.host import McpHost
    from localllm.session import open_session
    from tests.fakes import FakeSource

    class Calling(FakeSource):
        def __init__(self, spec):
            super().__init__(spec, tool_calls=calls, answer_tool_results=True, **knobs)

    host = McpHost(parse_config(json.dumps({"mcpServers": servers}), "mcp.json"), log_dir=tmp_path / "logs")
    session = open_session(engine=Engine(store=store, keep_alive=300, backend_class=lambda name: Calling))
    return LocalLLMApp(model=TOOL_MODEL, chats=chats, session=session, mcp=host), session, host


def notes(monkeypatch) -> list[str]:
    """Every notification the chat screen shows, from the start (a server may fail while the app mounts)."""
    from localllm.tui.chat import ChatScreen

    said: list[str] = []
    shown = ChatScreen.notify

    def notify(self, message, **kw):
        said.append(str(message))
        return shown(self, message, **kw)

    monkeypatch.setattr(ChatScreen, "notify", notify)
    return said


async def send(pilot, text: str) -> None:
    screen = pilot.app.screen
    screen.answer_done.clear()
    await pilot.press(*text, "enter")


async def test_a_call_is_confirmed_runs_is_saved_and_reopens(tui_home, chats, tool_store, tmp_path):  # noqa: F811
    record = tmp_path / "calls.jsonl"
    calls = [{"name": "record", "arguments": {"text": "hello"}}, {"name": "pid", "arguments": {}}]
    app, session, host = make_app(tool_store, chats, tmp_path, calls,
                                  {"rec": {**recorder(record, "48613"), "default": True}})
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            screen = app.screen
            await send(pilot, "Record hello")
            await wait_for_screen(pilot, app, ToolConfirmModal, "#tool-arguments")
            modal = app.screen
            assert modal.call.tool == "record" and '"text": "hello"' in str(modal.query_one("#tool-arguments").content)
            await pilot.press("a")  # allow for this chat
            await wait_for_screen(pilot, app, ToolConfirmModal, "#tool-arguments")
            assert app.screen.call.tool == "pid"
            await pilot.press("o")  # allow once
            await wait_until(pilot, lambda: screen.answer_done.is_set(), timeout=60)
            conv = screen.conversation
            saved = chats.messages(conv.id)[-1]
            assert saved.role == "assistant" and saved.content.startswith("The tool said: ")
            record_call, pid_call = saved.tool_calls
            assert record_call["arguments"] == {"text": "hello"} and record_call["result"] == "recorded: hello 48613"
            assert record_call["status"] == "done" and record_call["server"] == "rec"
            pid = int(pid_call["result"])
            assert psutil.pid_exists(pid)
            assert [json.loads(x)["arguments"] for x in record.read_text().splitlines()] == [{"text": "hello"}]
            view = screen._last_answer()
            blocks = list(view.query(ToolCallView))
            assert len(blocks) == 2 and all(b.collapsed for b in blocks) and "record" in str(blocks[0].title)
            # the model's next prompt held the results: the history it is sent expands the saved calls
            roles = [m["role"] for m in screen.history()]
            assert roles == ["user", "assistant", "tool", "tool", "assistant"]

            # the next turn: "record" is allowed for this chat, "pid" was allowed once and is asked again
            await send(pilot, "Record hello again")
            await wait_for_screen(pilot, app, ToolConfirmModal, "#tool-arguments")
            assert app.screen.call.tool == "pid"
            await pilot.press("d")
            await wait_until(pilot, lambda: screen.answer_done.is_set(), timeout=60)
            last = chats.messages(conv.id)[-1]
            assert [c["status"] for c in last.tool_calls] == ["done", "denied"]
            assert len(record.read_text().splitlines()) == 2

            # reopened: the calls come back, folded, with their results
            screen.open_conversation(None)
            await pilot.pause()
            screen.open_conversation(conv.id)
            await pilot.pause(0.2)
            blocks = list(screen.query(ToolCallView))
            assert len(blocks) == 4 and all(b.collapsed for b in blocks)
            assert "recorded: hello 48613" in str(blocks[0]._body.content)
            await pilot.press("ctrl+s")
            await pilot.pause()
        exported = next((tui_home / "data" / "exports").glob("*.md")).read_text()
        assert "Tool call: record (done)" in exported and "recorded: hello 48613" in exported
    finally:
        session.close()
    # the app closed its MCP host on exit: the server process is gone
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


async def test_esc_stops_a_running_tool_and_the_app_answers_the_next_message(tui_home, chats, tool_store,  # noqa: F811
                                                                            tmp_path):
    app, session, host = make_app(tool_store, chats, tmp_path, [{"name": "nap", "arguments": {"seconds": 60}}],
                                  {"rec": {**recorder(), "default": True}}, tool_calls_if="please")
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            screen = app.screen
            await send(pilot, "Nap please")
            await wait_for_screen(pilot, app, ToolConfirmModal, "#tool-arguments")
            await pilot.press("o")
            await wait_until(pilot, lambda: screen.query(ToolCallView) and "running" in str(
                screen.query_one(ToolCallView).title), timeout=30)
            await pilot.press("escape")
            await wait_until(pilot, lambda: screen.answer_done.is_set(), timeout=10)  # not the tool's 60 s
            conv = screen.conversation
            saved = chats.messages(conv.id)[-1]
            assert saved.tool_calls[0]["status"] == "stopped" and saved.stats["finish_reason"] == "cancelled"
            await send(pilot, "Hello")
            await wait_until(pilot, lambda: screen.answer_done.is_set(), timeout=60)
            assert chats.messages(conv.id)[-1].content == "Hello"
    finally:
        session.close()


async def test_a_server_killed_mid_call_and_one_that_does_not_start(tui_home, chats, tool_store,  # noqa: F811
                                                                   tmp_path, monkeypatch):
    said = notes(monkeypatch)
    app, session, host = make_app(tool_store, chats, tmp_path, [{"name": "die", "arguments": {}}],
                                  {"rec": recorder(), "missing": {"command": "no-such-mcp-server-xyz"},
                                   "broken": {"args": ["no command"]}},
                                  tool_calls_if="please")
    chats.create(title="Faults", model=TOOL_MODEL, params={"mcp": ["rec", "missing", "broken"]})  # reopened first
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            screen = app.screen
            await send(pilot, "Die please")
            await wait_for_screen(pilot, app, ToolConfirmModal, "#tool-arguments")
            await pilot.press("o")
            await wait_until(pilot, lambda: screen.answer_done.is_set(), timeout=60)
            conv = screen.conversation
            saved = chats.messages(conv.id)[-1]
            assert saved.content == 'The tool said: The MCP server "rec" exited during the call.'
            assert host.status("rec").state == "failed"
            assert sum("MCP missing: failed: its command" in m for m in said) == 1
            assert sum('MCP broken: failed: MCP server "broken" in mcp.json needs a "command"' in m for m in said) == 1
            assert sum("MCP rec: failed: it exited during a call to die" in m for m in said) == 1
            await send(pilot, "Hello")
            await wait_until(pilot, lambda: screen.answer_done.is_set(), timeout=60)
            assert chats.messages(conv.id)[-1].content == "Hello"

            # the settings list each server with its state, and enable or disable it for this chat
            await pilot.press("ctrl+t")
            modal = await wait_for_screen(pilot, app, SettingsModal, "#mcp-tools", timeout=10)
            states = [str(s.content) for s in modal.query(".mcp-state")]
            assert states[0].startswith("failed: it exited during a call to die")
            assert states[1] == ('failed: its command "no-such-mcp-server-xyz" was not found '
                                 "(is it installed and on PATH?)")
            modal.query_one("#mcp-1").value = False
            await pilot.pause()
            modal.action_save()
            await pilot.pause()
            assert chats.get(conv.id).params["mcp"] == ["rec", "broken"]
            assert screen.enabled_servers() == ["rec", "broken"]
    finally:
        session.close()


async def test_servers_start_when_a_chat_needs_them_and_the_settings_show_their_tools(tui_home, chats,
                                                                                     tool_store, tmp_path):  # noqa: F811
    app, session, host = make_app(tool_store, chats, tmp_path, [], {"rec": recorder(), "other": recorder()})
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            assert [s.state for s in host.statuses()] == ["off", "off"]  # no chat uses them yet
            await pilot.press("ctrl+t")
            modal = await wait_for_screen(pilot, app, SettingsModal, "#mcp-tools", timeout=10)
            modal.query_one("#mcp-0").value = True  # enable "rec" for this chat: it starts in the background
            await wait_until(pilot, lambda: "ready, 7 tools" in str(modal.query_one("#mcp-state-0").content), 60)
            assert host.status("other").state == "off"
            tools = modal.query_one("#mcp-tools")
            assert tools.option_count == 7
            tools.toggle("rec/boom")  # one tool off
            await pilot.pause()
            modal.action_save()
            await pilot.pause()
            conv = app.screen.conversation
            assert conv.params["mcp"] == ["rec"] and conv.params["mcp_off"] == ["rec/boom"]
            chat = app.screen.tool_chat(conv.id, conv.params)
            assert "boom" not in {t.public for t in chat.tools()} and "record" in {t.public for t in chat.tools()}
    finally:
        session.close()


async def test_a_model_without_tool_support_is_told_once_and_answers(tui_home, chats, tmp_path, monkeypatch):
    """The default model's own template renders no tools: one line says so, and it answers without them."""
    said = notes(monkeypatch)
    from localllm.engine import Engine
    from localllm.mcp.config import parse_config
    from localllm.mcp.host import McpHost
    from localllm.session import open_session
    from tests.fakes import FakeSource

    host = McpHost(parse_config(json.dumps({"mcpServers": {"rec": {**recorder(), "default": True}}}), "mcp.json"),
                   log_dir=tmp_path / "logs")
    session = open_session(engine=Engine(keep_alive=300, backend_class=lambda name: FakeSource))
    app = LocalLLMApp(model="smollm2:135m", chats=chats, session=session, mcp=host)
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            screen = app.screen
            for text in ("Hello", "Hello again"):
                await send(pilot, text)
                await wait_until(pilot, lambda: screen.answer_done.is_set(), timeout=60)
                assert chats.messages(screen.conversation.id)[-1].content == text
            assert said.count("The chat template of smollm2:135m does not support tools: the MCP tools are not "
                              "given to it.") == 1
    finally:
        session.close()

