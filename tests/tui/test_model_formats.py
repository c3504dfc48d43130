"""The model manager says which weight formats each installed model has (GGUF, and MLX where pulled or
converted), on the real default model in a models directory of this test's own."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from textual.widgets import DataTable

from localllm.tui.app import LocalLLMApp

from .test_chat import wait_until

pytestmark = pytest.mark.asyncio


@pytest.fixture
def own_models(tui_home, default_model, tmp_path, monkeypatch) -> Path:
    """A models directory holding only the default model (its blob hard-linked, no MLX build)."""
    src = Path(default_model.path).parents[1]
    models = tmp_path / "models"
    manifest = next((src / "manifests").rglob("135m.json"))
    dst = models / manifest.relative_to(src)
    dst.parent.mkdir(parents=True)
    data = json.loads(manifest.read_text())
    data["mlx_path"], data["mlx"], data["weights"] = None, None, {}
    dst.write_text(json.dumps(data))
    (models / "blobs").mkdir()
    os.link(default_model.path, models / "blobs" / Path(default_model.path).name)
    monkeypatch.setenv("LOCALLLM_MODELS", str(models))
    return models


async def test_installed_models_show_their_formats(own_models, chats, default_model):
    app = LocalLLMApp(model="smollm2:135m", chats=chats)
    async with app.run_test(size=(140, 36)) as pilot:
        await pilot.press("f3")
        screen = app.screen
        await wait_until(pilot, lambda: screen.loaded_once.is_set(), timeout=60)
        table = screen.query_one("#installed", DataTable)
        assert [str(c.label) for c in table.columns.values()][-1] == "Formats"
        assert [str(table.get_row_at(i)[7]) for i in range(table.row_count)] == ["GGUF"]

        mlx = own_models / "mlx" / default_model.weights_digest.removeprefix("sha256:")  # a converted build
        mlx.mkdir(parents=True)
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (mlx / name).write_text("{}")
        screen.loaded_once.clear()
        await pilot.press("r")
        await wait_until(pilot, lambda: screen.loaded_once.is_set(), timeout=60)
        assert str(table.get_row_at(0)[7]) == "GGUF+MLX"

        shutil.rmtree(mlx)
        screen.loaded_once.clear()
        await pilot.press("r")
        await wait_until(pilot, lambda: screen.loaded_once.is_set(), timeout=60)
        assert str(table.get_row_at(0)[7]) == "GGUF"
