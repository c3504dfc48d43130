"""Snapshots of the main screens (``pytest --snapshot-update`` after checking the SVGs by eye).

Deterministic on purpose: fixed conversations, and a static session (``static_session``) for the model
manager and the hardware view (a real probe differs from machine to machine); no timings are shown.
"""

from __future__ import annotations

import pytest

from localllm.chats import ChatStore
from localllm.tui.app import LocalLLMApp

from .conftest import static_session
from .test_chat import wait_until

ANSWER = """The sky looks blue because of **Rayleigh scattering**:

1. Sunlight holds every colour.
2. Air molecules scatter short (blue) wavelengths far more than long (red) ones.

```python
def scattering(wavelength_nm: float) -> float:
    return 1 / wavelength_nm**4
```
"""


@pytest.fixture(autouse=True)
def steady_cursor(monkeypatch):
    """The cursors stay lit: a blink every 0.5 s would make a screenshot depend on how loaded the machine is
    (a shot taken after 0.6 s shows the prompt without its cursor). textual is pinned in the test extras."""
    from textual.widgets import Input, TextArea

    monkeypatch.setattr(Input, "_toggle_cursor", lambda self: None)
    monkeypatch.setattr(TextArea, "_toggle_cursor_blink_visible", lambda self: None)


@pytest.fixture
def snap_app(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_HOME", "/nonexistent/localllm-home")  # shown in the help text: fixed
    chats = ChatStore(tmp_path / "chats.sqlite3")
    old = chats.create(title="Rust borrow checker", model="smollm2:135m")
    chats.add_message(old.id, "user", "Explain the borrow checker in one line.")
    chats.add_message(old.id, "assistant", "It lets one writer or many readers hold a value, never both.")
    conv = chats.create(title="Why is the sky blue?", model="smollm2:135m")
    chats.add_message(conv.id, "user", "Why is the sky blue?")
    chats.add_message(conv.id, "assistant", ANSWER)
    yield LocalLLMApp(model="smollm2:135m", chats=chats, session=static_session())
    chats.close()


def test_chat_screen(snap_compare, snap_app):
    assert snap_compare(snap_app, terminal_size=(100, 30))


def test_chat_screen_small_terminal(snap_compare, snap_app):
    assert snap_compare(snap_app, terminal_size=(80, 24))


def test_models_screen(snap_compare, snap_app):
    async def run_before(pilot):
        await pilot.press("f3")
        await wait_until(pilot, lambda: pilot.app.screen.loaded_once.is_set(), timeout=10)
        await pilot.pause()

    assert snap_compare(snap_app, terminal_size=(120, 30), run_before=run_before)


def test_hardware_screen(snap_compare, snap_app):
    async def run_before(pilot):
        await pilot.press("f4")
        await wait_until(pilot, lambda: "planner" in pilot.app.screen.query_one("#hardware").source, timeout=10)
        await pilot.pause()

    assert snap_compare(snap_app, terminal_size=(100, 36), run_before=run_before)


def test_settings_modal(snap_compare, snap_app):
    assert snap_compare(snap_app, terminal_size=(100, 40), press=["ctrl+t"])


def test_help_screen(snap_compare, snap_app):
    assert snap_compare(snap_app, terminal_size=(110, 40), press=["f1"])


def test_chat_screen_with_thinking(snap_compare, tmp_path, monkeypatch):
    """A thinking model's answers: the reasoning dimmed above each answer, the first unfolded, the last folded."""
    monkeypatch.setenv("LOCALLLM_HOME", "/nonexistent/localllm-home")
    chats = ChatStore(tmp_path / "chats.sqlite3")
    conv = chats.create(title="Two plus two", model="qwen3:0.6b")
    chats.add_message(conv.id, "user", "What is two plus two?")
    chats.add_message(conv.id, "assistant", "Two plus two is **4**.",
                      thinking="The user asks for a sum. Two and two make four; no trick in the question.")
    chats.add_message(conv.id, "user", "And three plus three?")
    chats.add_message(conv.id, "assistant", "Six.", thinking="Three plus three: six.")
    app = LocalLLMApp(model="qwen3:0.6b", chats=chats, session=static_session())

    async def run_before(pilot):
        from textual.widgets._collapsible import CollapsibleTitle

        from localllm.tui.widgets import ThinkingView

        await pilot.pause()
        await pilot.click(pilot.app.screen.query(ThinkingView).first().query_one(CollapsibleTitle))
        await pilot.pause()
        pilot.app.screen.query_one("#prompt").focus()
        await pilot.pause()

    try:
        assert snap_compare(app, terminal_size=(100, 30), run_before=run_before)
    finally:
        chats.close()
