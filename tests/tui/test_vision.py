"""Images in the terminal app, through the pilot: a path typed in the prompt and F5 attach, chips in the message,
the image kept by content hash with the chat (whole after the file moves), re-sent on regenerate, exported."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from textual.widgets import Label

from localllm.tui.app import LocalLLMApp
from localllm.tui.chat import ChatScreen
from tests.support_vision import IMAGE_TOKENS, png
from tests.tui.test_chat import wait_until


@pytest.fixture
def vlm_path(tmp_path, default_model_path, test_projector) -> Path:
    d = tmp_path / "vlm"
    d.mkdir()
    try:
        os.link(default_model_path, d / "model.gguf")
    except OSError:
        shutil.copyfile(default_model_path, d / "model.gguf")
    shutil.copyfile(test_projector, d / "mmproj-test-f16.gguf")
    return d / "model.gguf"


@pytest.mark.asyncio
async def test_a_path_in_the_prompt_is_attached_kept_and_resent(tui_home, chats, vlm_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a path typed relative to where the app runs (each key the pilot types takes ~40 ms)
    photo = tmp_path / "photo.png"
    photo.write_bytes(png(seed=5))
    conv = chats.create(title="Pic", model=str(vlm_path), params={"seed": 1, "temperature": 0, "max_tokens": 4})
    app = LocalLLMApp(model=str(vlm_path), chats=chats)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = app.screen
        assert isinstance(screen, ChatScreen)
        await pilot.press(*"What is in ./photo.png?")
        await pilot.press("enter")
        await wait_until(pilot, lambda: not screen.generating and screen._last_answer() is not None)
        assert screen.last_info is not None and screen.last_info.stats.image_tokens == IMAGE_TOKENS
        user = chats.messages(conv.id)[0]
        assert user.content == "What is in ?" and [i.name for i in user.images] == ["photo.png"]
        assert (user.images[0].width, user.images[0].height) == (64, 64)
        chip = screen.query(".images").first(Label)
        assert "photo.png 64×64" in str(chip.render())
        photo.unlink()  # the chat keeps its own copy, by content hash
        await pilot.press("ctrl+g")  # regenerate: the image is sent again from that copy
        await pilot.pause(0.1)
        await wait_until(pilot, lambda: not screen.generating and screen._last_answer() is not None)
        assert screen.last_info.stats.image_tokens == IMAGE_TOKENS
    assert "chat-images" in chats.export_markdown(conv.id) or str(chats.images_dir) in chats.export_markdown(conv.id)


@pytest.mark.asyncio
async def test_f5_attaches_and_a_bad_file_is_one_notice(tui_home, chats, vlm_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the file names typed relative to where the app runs
    good, bad = tmp_path / "a.png", tmp_path / "b.png"
    good.write_bytes(png(seed=6))
    bad.write_text("not an image")
    chats.create(title="Pic", model=str(vlm_path), params={"seed": 1, "temperature": 0, "max_tokens": 2})
    app = LocalLLMApp(model=str(vlm_path), chats=chats)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = app.screen
        assert isinstance(screen, ChatScreen)
        await pilot.press("f5")
        await pilot.pause(0.2)
        await pilot.press(*bad.name, "enter")
        await pilot.pause(0.2)
        assert screen.pending_images == []
        await pilot.press("f5")
        await pilot.pause(0.2)
        await pilot.press(*good.name, "enter")
        await pilot.pause(0.2)
        assert [i.name for i in screen.pending_images] == ["a.png"]
        assert "a.png" in str(screen.query_one("#attachments", Label).render())


def test_the_model_manager_lists_the_projector(home, installed_default_model, test_projector):
    from localllm.config import paths
    from localllm.engine import Engine
    from localllm.local import LocalAdvisor, LocalModels, LocalRunner
    from localllm.session import Session
    from localllm.store import Store
    from localllm.tui.models import model_rows
    from tests.support import TEST_HOME, install_copy

    install_copy(paths().models, TEST_HOME / "data" / "models")
    store = Store()
    store.copy("smollm2:135m", "plain:latest")
    store.set_projector("smollm2:135m", test_projector)
    engine = Engine(store=store)
    try:
        rows = {r.name: r for r in model_rows(Session(LocalModels(store), LocalRunner(engine), LocalAdvisor(engine)))}
    finally:
        engine.close()
    assert rows["smollm2:135m"].formats == "GGUF+mmproj" and rows["plain:latest"].formats == "GGUF"


def test_the_remote_client_sends_images_as_base64():
    import base64

    from localllm.api import GenerateRequest
    from localllm.client import request_body

    pic = png(seed=1)
    path, body = request_body("m", GenerateRequest(messages=[{"role": "user", "content": "hi", "images": [pic]}]),
                              None, None)
    assert path == "/api/chat" and body["messages"][0]["images"] == [base64.b64encode(pic).decode()]
    path, body = request_body("m", GenerateRequest(prompt="<__media__> hi", images=[pic]), None, None)
    assert path == "/api/generate" and body["images"] == [base64.b64encode(pic).decode()]
