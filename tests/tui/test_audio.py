"""Audio in the terminal app, through the pilot: a clip's path typed in the prompt is attached (a chip with its name
and duration), kept by content hash with the chat and evaluated as audio tokens."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from textual.widgets import Label

from localllm.tui.app import LocalLLMApp
from localllm.tui.chat import ChatScreen
from tests.support_audio import AUDIO_TOKENS, wav
from tests.tui.test_chat import wait_until


@pytest.fixture
def alm_path(tmp_path, default_model_path, audio_projector) -> Path:
    d = tmp_path / "alm"
    d.mkdir()
    try:
        os.link(default_model_path, d / "model.gguf")
    except OSError:
        shutil.copyfile(default_model_path, d / "model.gguf")
    shutil.copyfile(audio_projector, d / "mmproj-ultravox-f16.gguf")
    return d / "model.gguf"


@pytest.mark.asyncio
async def test_a_clip_path_in_the_prompt_is_a_chip_with_its_duration(tui_home, chats, alm_path, tmp_path,
                                                                     monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.wav").write_bytes(wav(seed=5))
    conv = chats.create(title="Memo", model=str(alm_path), params={"seed": 1, "temperature": 0, "max_tokens": 3})
    app = LocalLLMApp(model=str(alm_path), chats=chats)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = app.screen
        assert isinstance(screen, ChatScreen)
        await pilot.press(*"Hear ./m.wav")
        await pilot.press("enter")
        await wait_until(pilot, lambda: not screen.generating and screen._last_answer() is not None)
        assert screen.last_info is not None and screen.last_info.stats.audio_tokens == AUDIO_TOKENS
        user = chats.messages(conv.id)[0]
        assert user.content == "Hear"
        assert [(i.name, i.format, i.seconds) for i in user.images] == [("m.wav", "WAV", 1.5)]
        chip = screen.query(".images").first(Label)
        assert "🔊 m.wav 1.5 s" in str(chip.render())
