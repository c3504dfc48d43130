"""The model manager and hardware screens, driven with the pilot: a real pull (through the store's
mirror path, from a local HTTP server), cancel and resume, delete, default model."""

from __future__ import annotations

import threading
import time

import pytest
from textual.widgets import DataTable, Markdown, ProgressBar

from localllm.session import Session, open_session
from localllm.tui.app import LocalLLMApp
from localllm.tui.models import HardwareScreen, ModelsScreen

from .test_chat import wait_for_screen, wait_until

pytestmark = pytest.mark.asyncio


def local_session(catalog) -> Session:
    from localllm.config import paths
    from localllm.engine import Engine
    from localllm.store import Store

    return open_session(engine=Engine(store=Store(paths(), catalog=catalog)))


def column(table: DataTable, index: int) -> list[str]:
    return [str(table.get_row_at(i)[index]) for i in range(table.row_count)]


async def test_pull_shows_progress_cancels_resumes_and_installs_then_delete(tui_home, mirror, chats, monkeypatch):
    catalog, handler = mirror
    monkeypatch.delenv("LOCALLLM_MODELS")  # a fresh, empty models dir under the tmp home
    handler.delay_per_chunk = 0.02  # ~12 MB/s: slow enough to cancel mid-way
    session = local_session(catalog)
    app = LocalLLMApp(model="tuitest:135m", chats=chats, session=session)
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.press("f3")
        screen = app.screen
        assert isinstance(screen, ModelsScreen)
        await wait_until(pilot, lambda: screen.loaded_once.is_set(), timeout=30)
        installed = screen.query_one("#installed", DataTable)
        catalog_table = screen.query_one("#catalog", DataTable)
        assert installed.row_count == 0
        assert column(catalog_table, 0) == ["tuitest:135m"]
        assert column(catalog_table, 2)[0] not in ("", "-", "?")  # a fit verdict for this machine

        catalog_table.focus()
        await pilot.press("p")
        bar = screen.query_one("#pull-progress", ProgressBar)
        await wait_until(pilot, lambda: (bar.total or 0) > 0 and bar.progress > 5_000_000, timeout=60)
        assert "MB" in str(screen.query_one("#pull-status").render())
        await pilot.press("x")
        await wait_until(pilot, lambda: screen.pulling is None, timeout=30)
        assert "cancelled" in str(screen.query_one("#pull-status").render())
        assert session.models.list() == []
        stopped_at = bar.progress

        handler.delay_per_chunk = 0.0
        handler.requests.clear()
        await pilot.press("p")
        await wait_until(pilot, lambda: screen.pulling is None, timeout=120)
        assert "installed" in str(screen.query_one("#pull-status").render()), screen.query_one("#pull-status").render()
        ranges = [r for _, r in handler.requests if r]
        assert ranges and int(ranges[0].split("=")[1].split("-")[0]) > 0, handler.requests  # resumed
        assert stopped_at > 0
        await wait_until(pilot, lambda: installed.row_count == 1, timeout=30)
        assert column(installed, 0) == ["tuitest:135m"]
        assert column(installed, 2) == ["Q4_1"]
        assert column(installed, 4)[0] in ("CPU", "fits on GPU") or "partial" in column(installed, 4)[0]
        assert [m.name for m in session.models.list()] == ["tuitest:135m"]

        # set it as the default model (written to the config file)
        installed.focus()
        await pilot.press("s")
        from localllm.tui import settings

        assert settings.default_model() == "tuitest:135m"
        assert column(installed, 6) == ["*"]

        # delete, with confirmation
        await pilot.press("d")
        await pilot.pause()
        await pilot.press("n")  # first: no
        await pilot.pause()
        assert [m.name for m in session.models.list()] == ["tuitest:135m"]
        await pilot.press("d")
        await pilot.pause()
        await pilot.press("y")
        await wait_until(pilot, lambda: installed.row_count == 0, timeout=30)
        assert session.models.list() == []


async def test_hardware_view_shows_probe_and_plan(tui_home, chats):
    app = LocalLLMApp(model="smollm2:135m", chats=chats)
    async with app.run_test(size=(100, 40)) as pilot:
        await pilot.press("f4")
        screen = app.screen
        assert isinstance(screen, HardwareScreen)
        md = screen.query_one("#hardware", Markdown)
        await wait_until(pilot, lambda: "planner" in md.source, timeout=60)
        from localllm.hardware import probe

        hw = probe()
        assert hw.cpu_model in md.source
        assert "Backend llamacpp" in md.source
        assert "| llama.cpp CPU | cpu, " in md.source  # llama.cpp's own device list
        assert "For **smollm2:135m**: backend **llamacpp**" in md.source
        assert "- " in md.source.split("planner's pick")[1]  # the planner's reasons, one per line


async def test_models_screen_lists_installed_default_model_with_verdict(tui_home, chats):
    app = LocalLLMApp(model="smollm2:135m", chats=chats)
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.press("f3")
        screen = app.screen
        await wait_until(pilot, lambda: screen.loaded_once.is_set(), timeout=60)
        installed = screen.query_one("#installed", DataTable)
        names = column(installed, 0)
        assert "smollm2:135m" in names
        row = installed.get_row_at(names.index("smollm2:135m"))
        assert row[2] == "Q4_1" and row[3] == "llamacpp" and row[4] in ("CPU", "fits on GPU")
        catalog = screen.query_one("#catalog", DataTable)
        assert catalog.row_count >= 5
        verdicts = column(catalog, 2)
        assert all(v not in ("", "-") for v in verdicts), verdicts


async def test_make_a_variant_of_an_installed_model_and_see_its_base(tui_home, chats, tmp_path, monkeypatch):
    """``v`` on an installed model: a name, a system prompt and a temperature make a variant (``create``), which
    the installed list shows with its base; a bad value is one sentence in the form. A listing that started
    before the variant existed and ends after it (the refresh when the form closes, on a busy machine) never
    overwrites the newer list: the variant once vanished from it for good, in a full CI run."""
    import localllm.tui.models as tui_models
    from localllm.store import Store
    from localllm.tui.modals import VariantModal
    from tests.support import DEFAULT_MODEL, TEST_HOME, install_copy

    models = tmp_path / "models"  # a private store: the variant is not written into the shared test home
    install_copy(models, TEST_HOME / "data" / "models")
    monkeypatch.setenv("LOCALLLM_MODELS", str(models))
    submitted = threading.Event()
    in_flight = [0]
    real_rows = tui_models.model_rows

    def slow_when_stale(session):
        in_flight[0] += 1
        try:
            rows = real_rows(session)
            if submitted.is_set() and all(r.name != "pirate" for r in rows):
                time.sleep(2.0)  # a slow listing of the store as it was before the variant
            return rows
        finally:
            in_flight[0] -= 1

    monkeypatch.setattr(tui_models, "model_rows", slow_when_stale)
    session = local_session(None)
    real_create = session.models.create

    def slow_create(*args, **kwargs):
        time.sleep(1.0)  # the refresh of the closing form lists the store before the variant is in it
        return real_create(*args, **kwargs)

    monkeypatch.setattr(session.models, "create", slow_create)
    app = LocalLLMApp(model=DEFAULT_MODEL, chats=chats, session=session)
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.press("f3")
        screen = app.screen
        assert isinstance(screen, ModelsScreen)
        await wait_until(pilot, lambda: screen.loaded_once.is_set(), timeout=30)
        installed = screen.query_one("#installed", DataTable)
        installed.focus()
        await pilot.press("v")
        modal = await wait_for_screen(pilot, app, VariantModal, "#ok", timeout=10)
        modal.query_one("#variant-name").value = "pirate"
        modal.query_one("#variant-system").text = "You are a pirate."
        modal.query_one("#variant-temperature").value = "hot"
        await pilot.click("#ok")
        await pilot.pause()
        assert isinstance(app.screen, VariantModal)
        assert "Temperature must be a number from 0 to 5, got 'hot'." in str(modal.query_one("#variant-error").render())
        modal.query_one("#variant-temperature").value = "0"
        submitted.set()
        modal.query_one("#ok").press()
        await wait_until(pilot, lambda: "pirate (from smollm2:135m)" in column(installed, 0), timeout=30)
        await wait_until(pilot, lambda: in_flight[0] == 0, timeout=30)  # the stale listing has ended...
        await pilot.pause(0.2)
        assert "pirate (from smollm2:135m)" in column(installed, 0)  # ...and was dropped, not shown
    made = Store().get("pirate")
    assert made.base == DEFAULT_MODEL and made.derived is not None
    assert (made.derived.system, made.derived.parameters) == ("You are a pirate.", {"temperature": 0.0})
