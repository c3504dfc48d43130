"""The chat screen, driven with Textual's pilot against the real default model."""

from __future__ import annotations

import time

import pytest
from textual.widgets import OptionList

from localllm.chats import ChatStore
from localllm.tui.app import LocalLLMApp
from localllm.tui.chat import ChatScreen
from localllm.tui.widgets import MessageView, PromptInput

MODEL = "smollm2:135m"
pytestmark = pytest.mark.asyncio


async def wait_until(pilot, condition, timeout: float = 120.0, step: float = 0.05) -> None:
    """Poll ``condition`` between pilot pauses (one pause is not enough for worker-driven updates)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {condition}")
        await pilot.pause(step)


async def wait_for_screen(pilot, app, cls: type, ready: str, timeout: float = 60.0):
    """Wait until ``app.screen`` is a ``cls`` whose widget ``ready`` is mounted, and return it.

    A pushed screen becomes ``app.screen`` before its widgets are composed: querying it at once races.
    """
    await wait_until(pilot, lambda: isinstance(app.screen, cls) and bool(app.screen.query(ready)), timeout=timeout)
    return app.screen


def short_chat(chats: ChatStore, max_tokens: int, title: str = "Test") -> int:
    conv = chats.create(title=title, model=MODEL, params={"seed": 1, "temperature": 0, "max_tokens": max_tokens})
    return conv.id


async def test_send_prompt_streams_answer_with_stats_and_survives_restart(tui_home, chats, monkeypatch):
    short_chat(chats, max_tokens=24)
    app = LocalLLMApp(model=MODEL, chats=chats)
    partial_seen: list[int] = []
    rows_at_first_token: list[list[tuple[str, str]]] = []
    from textual.widgets import Markdown

    real_get_stream = Markdown.get_stream

    def recording_get_stream(markdown):
        """Record what is on screen at each streamed write (a fast machine finishes 24 tokens before the
        pilot's key press returns, so polling from the test cannot see the stream)."""
        stream = real_get_stream(markdown)
        real_write = stream.write

        async def write(fragment: str) -> None:
            if not rows_at_first_token:  # what a process killed now would keep
                other = ChatStore(chats.path)
                rows_at_first_token.append([(m.role, m.content) for m in other.messages(screen.conversation.id)])
                other.close()
            await real_write(fragment)
            if screen.generating:
                partial_seen.append(len(markdown.source))

        stream.write = write
        return stream

    monkeypatch.setattr(Markdown, "get_stream", staticmethod(recording_get_stream))
    async with app.run_test(size=(100, 30)) as pilot:
        screen = app.screen
        assert isinstance(screen, ChatScreen)
        assert isinstance(app.focused, PromptInput)
        await pilot.press(*"Name three colours.")
        await pilot.press("enter")

        def streaming_text() -> bool:
            return not screen.generating and screen._last_answer() is not None

        await wait_until(pilot, streaming_text)
        await pilot.pause(0.2)
        answer = screen._last_answer()
        assert answer is not None and answer.content.strip()
        assert answer.markdown.source == answer.content  # the whole answer is on screen
        status = str(screen.query_one("#status").render())
        assert MODEL in status and "tok/s" in status and "TTFT" in status and "ctx " in status, status
        assert "llamacpp" in status, status
        # the screen keeps up with the stream: the last token shows soon after the generation ends (a quiet
        # 2-core machine needs ~0.1 s; 5 s leaves a loaded one room and still fails a screen that lags behind)
        assert screen.render_lag_s is not None and screen.render_lag_s < 5.0
        conv_id = screen.conversation.id
    assert partial_seen, "no text was on screen before the answer ended"
    # Committed before generation: a process killed mid-answer keeps the prompt (and only loses the answer).
    assert rows_at_first_token == [[("user", "Name three colours.")]]

    # Restart: the conversation and the answer come back from SQLite.
    saved = chats.messages(conv_id)
    assert [m.role for m in saved] == ["user", "assistant"]
    assert saved[1].stats["eval_count"] > 0 and saved[1].stats["finish_reason"] in ("stop", "length")
    app2 = LocalLLMApp(model=MODEL, chats=ChatStore(chats.path))
    async with app2.run_test(size=(100, 30)) as pilot:
        screen = app2.screen
        await pilot.pause()
        assert screen.conversation.id == conv_id
        views = list(screen.query(MessageView))
        assert [v.role for v in views] == ["user", "assistant"]
        assert views[1].content == saved[1].content
        titles = [str(o.prompt) for o in screen.query_one("#conversations", OptionList).options]
        assert titles[0] == "Test"
        status = str(screen.query_one("#status").render())
        assert "tok/s" in status and "llamacpp" in status, status  # the last answer's saved stats


async def test_escape_stops_answer_midway(tui_home, chats):
    conv_id = short_chat(chats, max_tokens=400)
    app = LocalLLMApp(model=MODEL, chats=chats)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = app.screen
        await pilot.press(*"Write a long story.")  # short to type: the pilot takes ~40 ms a key
        await pilot.press("enter")
        await wait_until(pilot, lambda: screen._last_answer() is not None
                         and len(screen._last_answer().markdown.source) > 20)
        await pilot.press("escape")
        await wait_until(pilot, lambda: not screen.generating, timeout=10)
        await pilot.pause(0.1)
        answer = screen._last_answer()
        assert answer.stopped
        assert "stopped" in str(answer.query_one(".role").render())
        saved = chats.messages(conv_id)[-1]
        assert saved.role == "assistant" and saved.stats["finish_reason"] == "cancelled"
        assert 0 < saved.stats["eval_count"] < 400
        assert "stopped" in str(screen.query_one("#status").render())

        # The model is free again: regenerate answers at once (a short one).
        chats.update(conv_id, params={"seed": 1, "temperature": 0, "max_tokens": 8})
        screen.conversation = chats.get(conv_id)
        await pilot.press("ctrl+g")

        def regenerated() -> bool:
            last = chats.messages(conv_id)[-1]
            return not screen.generating and last.role == "assistant" and last.stats["finish_reason"] != "cancelled"

        await wait_until(pilot, regenerated, timeout=60)
        roles = [m.role for m in chats.messages(conv_id)]
        assert roles == ["user", "assistant"]  # the stopped answer was replaced
        assert chats.messages(conv_id)[-1].stats["finish_reason"] in ("stop", "length")
        assert len(list(screen.query(MessageView))) == 2


async def test_switch_rename_delete_conversations_and_restart(tui_home, chats):
    a = chats.create(title="Alpha", model=MODEL)
    chats.add_message(a.id, "user", "first question")
    chats.add_message(a.id, "assistant", "first answer")
    b = chats.create(title="Beta", model=MODEL)
    chats.add_message(b.id, "user", "second question")
    chats.add_message(b.id, "assistant", "second answer")
    app = LocalLLMApp(model=MODEL, chats=chats)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = app.screen
        await pilot.pause()
        assert screen.conversation.id == b.id  # most recent first
        ol = screen.query_one("#conversations", OptionList)
        assert [str(o.prompt) for o in ol.options] == ["Beta", "Alpha"]

        ol.focus()
        await pilot.press("down", "enter")
        await pilot.pause()
        assert screen.conversation.id == a.id
        assert [v.content for v in screen.query(MessageView)] == ["first question", "first answer"]

        await pilot.press("ctrl+r")
        await pilot.pause()
        await pilot.press(*"Renamed", "enter")
        await pilot.pause()
        assert chats.get(a.id).title == "Renamed"
        assert "Renamed" in [str(o.prompt) for o in ol.options]

        await pilot.press("f8")
        await pilot.pause()
        await pilot.press("y")
        await pilot.pause()
        assert [c.id for c in chats.conversations()] == [b.id]
        assert chats.messages(a.id) == []  # messages went with it (ON DELETE CASCADE)
        assert [str(o.prompt) for o in ol.options] == ["Beta"]
        assert screen.conversation.id == b.id

        await pilot.press("ctrl+n")
        await pilot.pause()
        assert screen.conversation is None and not list(screen.query(MessageView))

    app2 = LocalLLMApp(model=MODEL, chats=ChatStore(chats.path))
    async with app2.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        ol = app2.screen.query_one("#conversations", OptionList)
        assert [str(o.prompt) for o in ol.options] == ["Beta"]
        assert [v.content for v in app2.screen.query(MessageView)] == ["second question", "second answer"]


async def test_copy_message_and_code_block_and_export(tui_home, chats):
    conv = chats.create(title="Code", model=MODEL)
    chats.add_message(conv.id, "user", "Show me hello world")
    answer = "Here it is:\n\n```python\nprint('hello')\n```\n\nand in shell:\n\n```sh\necho hello\n```\n"
    chats.add_message(conv.id, "assistant", answer)
    app = LocalLLMApp(model=MODEL, chats=chats)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        await pilot.press("ctrl+o")
        assert app.clipboard == answer
        await pilot.press("ctrl+f")
        assert app.clipboard.strip() == "print('hello')"
        await pilot.press("ctrl+f")
        assert app.clipboard.strip() == "echo hello"

        from textual.widgets._markdown import MarkdownFence

        fence = app.screen.query(MarkdownFence).first()
        app.copy_to_clipboard("")
        await pilot.click(fence)
        assert app.clipboard.strip() == "print('hello')"

        await pilot.press("ctrl+s")
        await pilot.pause()
        exported = list((tui_home / "data" / "exports").glob("*.md"))
        assert len(exported) == 1
        text = exported[0].read_text()
        assert text.startswith("# Code") and "## Assistant" in text and "print('hello')" in text


async def test_prompt_keys_newline_and_history():
    from textual.app import App, ComposeResult

    sent: list[str] = []

    class PromptApp(App):
        def compose(self) -> ComposeResult:
            yield PromptInput()

        def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
            sent.append(event.text)

    app = PromptApp()
    async with app.run_test() as pilot:
        prompt = app.query_one(PromptInput)
        prompt.prompts = ["older prompt"]
        prompt.focus()
        await pilot.press(*"line one", "ctrl+j", *"line two", "enter")
        await pilot.pause()
        assert sent == ["line one\nline two"]
        assert prompt.text == ""
        await pilot.press("up")
        assert prompt.text == "line one\nline two"
        await pilot.press("up")  # the cursor sits on the last line: moves up first
        await pilot.press("up")
        assert prompt.text == "older prompt"
        await pilot.press("down")
        assert prompt.text == "line one\nline two"
        await pilot.press("down", "down")
        assert prompt.text == ""


async def test_settings_modal_validates_and_saves(tui_home, chats):
    conv = chats.create(title="S", model=MODEL)
    chats.add_message(conv.id, "user", "q")
    app = LocalLLMApp(model=MODEL, chats=chats)
    async with app.run_test(size=(100, 40)) as pilot:
        await pilot.pause()
        await pilot.press("ctrl+t")
        await pilot.pause()
        modal = app.screen
        modal.query_one("#param-temperature").value = "hot"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert "Temperature must be" in str(modal.query_one("#settings-error").render())
        modal.query_one("#param-temperature").value = "0.2"
        modal.query_one("#param-seed").value = "42"
        modal.query_one("#param-draft").value = "ngram"
        modal.query_one("#system").load_text("You are terse.")
        await pilot.press("ctrl+s")
        await pilot.pause()
    saved = chats.get(conv.id)
    assert saved.params == {"temperature": 0.2, "seed": 42, "draft": "ngram"}
    assert saved.system == "You are terse."


async def test_keymap_remaps_help_lists_and_palette_runs(tui_home, chats):
    from localllm.config import paths

    cfg = paths().config_file
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text('[keymap]\n"chat.new" = "f10"\n"app.hardware" = "f9"\n"no.such" = "f12"\n')
    conv = chats.create(title="K", model=MODEL)
    chats.add_message(conv.id, "user", "q")
    app = LocalLLMApp(model=MODEL, chats=chats)
    assert app.unknown_keymap_ids == ["no.such"]
    async with app.run_test(size=(100, 30)) as pilot:
        screen = app.screen
        await pilot.pause()
        assert screen.conversation is not None
        await pilot.press("ctrl+n")  # no longer bound
        await pilot.pause()
        assert screen.conversation is not None
        await pilot.press("f10")
        await pilot.pause()
        assert screen.conversation is None

        rows = {r[3]: r for r in app.help_rows()}
        assert rows["chat.new"][1] == "f10" and rows["app.hardware"][1] == "f9"
        await pilot.press("f1")
        await pilot.pause()
        from localllm.tui.modals import HelpScreen

        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")

        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"Hardware")
        await pilot.pause(0.5)
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.current_mode == "hardware", timeout=10)


async def test_view_follows_the_stream_only_while_at_the_bottom(tui_home, chats):
    from textual.containers import VerticalScroll

    short_chat(chats, max_tokens=300)
    app = LocalLLMApp(model=MODEL, chats=chats)
    async with app.run_test(size=(80, 13)) as pilot:
        screen = app.screen
        box = screen.query_one("#messages", VerticalScroll)
        await pilot.press(*"Write a long story.", "enter")
        await wait_until(pilot, lambda: box.max_scroll_y > 5 or not screen.generating)
        assert screen.generating, "the answer ended before it filled the view"
        assert box.scroll_y == box.max_scroll_y  # following
        for _ in range(5):  # the user scrolls up (as the mouse wheel does)
            box._scroll_up_for_pointer(animate=False)
        await pilot.pause()
        held = box.scroll_y
        assert held < box.max_scroll_y
        grown = box.max_scroll_y
        await wait_until(pilot, lambda: box.max_scroll_y > grown + 1 or not screen.generating)
        assert box.scroll_y == held  # not dragged back down while reading
        box.scroll_end(animate=False, immediate=True)  # back at the bottom: following again
        await pilot.pause()
        at = box.max_scroll_y
        await wait_until(pilot, lambda: box.max_scroll_y > at + 1 or not screen.generating)
        await pilot.pause()
        assert box.scroll_y == box.max_scroll_y
        await pilot.press("escape")
        await wait_until(pilot, lambda: not screen.generating, timeout=30)



async def test_opening_another_chat_mid_answer_stops_and_saves_it(tui_home, chats):
    first = short_chat(chats, max_tokens=300, title="First")
    other = chats.create(title="Other", model=MODEL)
    chats.add_message(other.id, "user", "old")
    app = LocalLLMApp(model=MODEL, chats=chats)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = app.screen
        screen.open_conversation(first)
        await pilot.press(*"Write a long story.", "enter")
        await wait_until(pilot, lambda: screen.generating and screen._last_answer() is not None
                         and len(screen._last_answer().markdown.source) > 10)
        screen.open_conversation(other.id)  # same loop step as the check: still streaming
        await wait_until(pilot, lambda: not screen.generating, timeout=30)
        await pilot.pause()
        assert [v.content for v in screen.query(MessageView)] == ["old"]
        saved = chats.messages(first)
        assert [m.role for m in saved] == ["user", "assistant"]
        assert saved[1].stats["finish_reason"] == "cancelled" and saved[1].content


async def test_missing_model_says_how_to_get_it(tui_home, chats):
    app = LocalLLMApp(model="qwen2.5:0.5b", chats=chats)  # in the catalog, not installed in the test home
    async with app.run_test(size=(100, 30)) as pilot:
        screen = app.screen
        await pilot.press(*"Hi", "enter")
        await wait_until(pilot, lambda: screen.answer_done.is_set(), timeout=30)
        status = str(screen.query_one("#status").render())
        assert "not installed" in status and "F3" in status, status
        conv = screen.conversation
        assert [m.role for m in chats.messages(conv.id)] == ["user"]  # the prompt is kept for Ctrl+G
        assert not list(screen.query(MessageView).filter(".assistant"))


async def test_quit_mid_answer_is_clean(tui_home, chats):
    conv_id = short_chat(chats, max_tokens=300)
    app = LocalLLMApp(model=MODEL, chats=chats)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = app.screen
        await pilot.press(*"Write a long story about the sea.", "enter")
        await wait_until(pilot, lambda: screen.generating and screen._last_answer() is not None
                         and len(screen._last_answer().markdown.source) > 10)
        t0 = time.monotonic()
        await pilot.press("ctrl+q")
    assert time.monotonic() - t0 < 10  # the generation stopped; the model was freed
    assert [m.role for m in chats.messages(conv_id)][0] == "user"
