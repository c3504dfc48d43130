"""A thinking model in the chat screen, on a real GGUF: the default model with Qwen3's chat template and a
grammar that makes it write ``<think>…</think>`` before its answer (``tests/fixtures_thinking.py``). The
reasoning streams into a dimmed, collapsible block above the answer, is saved with the message apart from
it, comes back (folded) when the chat is reopened, and goes into the Markdown export."""

from __future__ import annotations

import pytest
from textual.widgets._collapsible import CollapsibleTitle

from localllm.chats import ChatStore
from localllm.tui.answer import request_from
from localllm.tui.app import LocalLLMApp
from localllm.tui.widgets import MessageView, ThinkingView
from tests.fixtures_thinking import THINK_GBNF, write_thinking_model

from .test_chat import wait_until

pytestmark = pytest.mark.asyncio


@pytest.fixture
def thinker(default_model_path):
    """(model name: the thinking GGUF's path, a session whose engine applies the thinking grammar)."""
    from localllm.engine import Engine
    from localllm.session import open_session
    from tests.server.derived import grammar_backend

    path = write_thinking_model(default_model_path)
    session = open_session(engine=Engine(keep_alive=300, backend_class=grammar_backend(THINK_GBNF)))
    yield str(path), session
    session.close()


async def test_thinking_streams_folds_saves_reopens_and_exports(tui_home, chats, thinker, monkeypatch):
    model, session = thinker
    conv = chats.create(title="Think", model=model, params={"seed": 1, "temperature": 0, "max_tokens": 120})
    seen_open: list[tuple[bool, str]] = []  # (folded?, title) of the block while the reasoning streamed
    real_show = ThinkingView.show

    def show(self, text):
        real_show(self, text)
        seen_open.append((self.collapsed, self.title))

    monkeypatch.setattr(ThinkingView, "show", show)
    app = LocalLLMApp(model=model, chats=chats, session=session)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = app.screen
        await pilot.press(*"What is two plus two?", "enter")
        await wait_until(pilot, lambda: screen.answer_done.is_set(), timeout=120)
        await pilot.pause(0.2)
        saved = chats.messages(conv.id)[-1]
        assert saved.role == "assistant" and saved.thinking and saved.content, saved
        for text in (saved.thinking, saved.content):
            assert "<think>" not in text and "</think>" not in text and "think>" not in text
        assert saved.content.endswith(".")  # the grammar's answer, whole
        assert saved.stats["thinking_tokens"] > 0 and saved.stats["eval_count"] > saved.stats["thinking_tokens"]
        assert seen_open and all(not folded and title == "Thinking…" for folded, title in seen_open)
        view = screen._last_answer()
        block = view.query_one(ThinkingView)
        assert block.collapsed and block.title == "Thinking"  # folded once the answer came
        assert block.text == saved.thinking and view.content == saved.content
        assert view.markdown.source == saved.content  # the answer's Markdown holds the answer only
        assert block.region.y < view.markdown.region.y  # above it

        title = block.query_one(CollapsibleTitle)
        app.copy_to_clipboard("")
        await pilot.click(title)  # unfolds, copies nothing
        await pilot.pause()
        assert not block.collapsed and app.clipboard == ""
        assert block.query_one(".thinking-text").region.height > 0
        await pilot.click(title)
        await pilot.pause()
        assert block.collapsed

        await pilot.press("ctrl+s")
        await pilot.pause()
    exported = next((tui_home / "data" / "exports").glob("*.md")).read_text()
    assert f"<details><summary>Thinking</summary>\n\n{saved.thinking.strip()}\n\n</details>\n\n{saved.content}" \
        in exported

    app2 = LocalLLMApp(model=model, chats=ChatStore(chats.path), session=session)
    async with app2.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        views = list(app2.screen.query(MessageView))
        assert [v.role for v in views] == ["user", "assistant"]
        block = views[1].query_one(ThinkingView)
        assert block.collapsed and block.text == saved.thinking and views[1].content == saved.content
        assert not views[0].query(ThinkingView)  # the question has none


async def test_conversation_think_setting_goes_to_the_request():
    req, _ = request_from([{"role": "user", "content": "q"}], {"think": "off"})
    assert req.think is False
    assert request_from([], {"think": "high"})[0].think == "high"
    assert request_from([], {})[0].think is None
