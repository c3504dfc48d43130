"""The chat screen's Think field as a user meets it, through Textual's pilot: Ctrl+T opens the settings, the
Think field is typed and saved, and the next answer of a thinking model changes with it (reasoning split off
into the folded block, or not asked for at all). In-process, and as ``localllm chat --host URL`` runs it:
the app opening its own remote session to a real server whose model thinks.

The thinking model is the default GGUF with Qwen3's template and a grammar that makes it write
``<think>…</think>`` first (``tests/fixtures_thinking.py``). With thinking off, Qwen3's template closes an
empty thought in the prompt; what the grammar still makes the model write stays in the answer, unsplit (as
Ollama does), so "off" shows as an answer starting with ``<think>`` and no reasoning block.
"""

from __future__ import annotations

import pytest
from textual.widgets import OptionList

from localllm.tui.app import LocalLLMApp
from localllm.tui.widgets import PromptInput, ThinkingView
from tests.fixtures_thinking import THINK_GBNF, write_thinking_model

from .test_chat import wait_until

pytestmark = pytest.mark.asyncio

THINKER = "smollm2-think:135m"
QUESTION = "What is two plus two?"


@pytest.fixture
def in_process(tui_home, default_model_path):
    """(model, app kwargs): the thinking GGUF's path and an in-process session applying the grammar."""
    from localllm.engine import Engine
    from localllm.session import open_session
    from tests.server.derived import grammar_backend

    session = open_session(engine=Engine(keep_alive=300, backend_class=grammar_backend(THINK_GBNF)))
    yield str(write_thinking_model(default_model_path)), {"session": session}
    session.close()


@pytest.fixture(scope="module")
def think_server(default_model_path, tmp_path_factory):
    """A real server (a thread) whose one model, ``THINKER``, thinks."""
    from tests.server.derived import grammar_backend, install_derived, serve

    store = install_derived(write_thinking_model(default_model_path), THINKER, tmp_path_factory.mktemp("think"))
    srv = serve(store, grammar_backend(THINK_GBNF))
    yield srv
    srv.stop()
    srv.engine.close()


@pytest.fixture
def over_host(tui_home, think_server):
    """(model, app kwargs) for ``chat --host URL``: no session given, the app opens one to the server."""
    return THINKER, {"host": think_server.url}


async def _set_think(pilot, app, word: str) -> None:
    await pilot.press("ctrl+t")
    await wait_until(pilot, lambda: app.screen.query("#param-think"), timeout=30)
    modal = app.screen
    modal.query_one("#param-think").value = word
    modal.query_one("#param-temperature").value = "0"
    modal.query_one("#param-seed").value = "1"
    await pilot.press("ctrl+s")
    await wait_until(pilot, lambda: not app.screen.query("#param-think"), timeout=30)


async def _ask(pilot, screen, chats, conv_id: int, answers: int):
    await pilot.press(*QUESTION, "enter")

    def answered() -> bool:
        msgs = [m for m in chats.messages(conv_id) if m.role == "assistant"]
        return len(msgs) == answers and screen.answer_done.is_set() and not screen.generating

    await wait_until(pilot, answered, timeout=180)
    await pilot.pause(0.2)
    return chats.messages(conv_id)[-1], screen._last_answer()


@pytest.mark.parametrize("face", ["in_process", "over_host"])
async def test_the_think_field_turns_thinking_off_and_on(face, request, chats):
    model, kwargs = request.getfixturevalue(face)
    conv = chats.create(title="Think field", model=model)
    app = LocalLLMApp(model=model, chats=chats, **kwargs)
    async with app.run_test(size=(100, 40)) as pilot:
        screen = app.screen
        await pilot.pause()
        await _set_think(pilot, app, "Off")
        assert chats.get(conv.id).params == {"think": "off", "temperature": 0.0, "seed": 1}
        off, view = await _ask(pilot, screen, chats, conv.id, 1)
        assert not off.thinking and off.content.startswith("<think>"), off  # not asked for: nothing split off
        assert not view.query(ThinkingView) and view.markdown.source == off.content

        await _set_think(pilot, app, "on")
        assert chats.get(conv.id).params["think"] == "on"
        on, view = await _ask(pilot, screen, chats, conv.id, 2)
        assert on.thinking and on.content and "think>" not in on.content + on.thinking, on
        assert on.stats["thinking_tokens"] > 0
        block = view.query_one(ThinkingView)
        assert block.text == on.thinking and block.collapsed  # the reasoning, folded above the answer
        assert view.markdown.source == on.content
        if face == "over_host":
            assert app._session is not None and app._session.remote  # noqa: SLF001 - the app's own session
            assert f"server {app.host}" in str(screen.query_one("#status").render())


async def test_a_model_that_fails_to_load_is_one_sentence_and_the_app_goes_on(tui_home, chats, tmp_path):
    """A chat whose model llama.cpp refuses to load (a valid GGUF without its layers): the status line says so in
    one sentence, the prompt is kept, nothing is left half-loaded, and the next chat, on the default model,
    answers in the same app."""
    from tests.support import tiny_gguf

    broken = str(tiny_gguf(tmp_path / "broken.gguf", "llama", bpe_vocab=True))
    good = chats.create(title="Good", model="smollm2:135m", params={"seed": 1, "temperature": 0, "max_tokens": 4})
    bad = chats.create(title="Broken", model=broken)
    app = LocalLLMApp(model=broken, chats=chats)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = app.screen
        await pilot.pause()
        assert screen.conversation.id == bad.id
        await pilot.press(*"Hi", "enter")
        await wait_until(pilot, lambda: screen.answer_done.is_set() and not screen.generating, timeout=120)
        status = str(screen.query_one("#status").render())
        assert "broken.gguf could not be loaded" in status, status  # which model, and what happened to it
        assert "Traceback" not in status and "\n" not in status.strip(), status
        assert [m.role for m in chats.messages(bad.id)] == ["user"]  # the prompt is kept, no empty answer saved
        assert app.session.runner.ps() == []  # nothing half-loaded stays resident

        ol = screen.query_one("#conversations", OptionList)
        ol.focus()
        await pilot.press("down", "enter")  # the sidebar: most recent first, so "Good" is second
        await wait_until(pilot, lambda: screen.conversation.id == good.id, timeout=30)
        screen.answer_done.clear()
        screen.query_one(PromptInput).focus()
        await pilot.press(*"Say hi.", "enter")
        await wait_until(pilot, lambda: [m.role for m in chats.messages(good.id)] == ["user", "assistant"]
                         and screen.answer_done.is_set() and not screen.generating, timeout=180)
        assert chats.messages(good.id)[-1].content.strip()
