"""``localllm chat --host URL``: the same screens against a real server over HTTP (Ollama API)."""

from __future__ import annotations

import pytest
from textual.widgets import DataTable

from localllm.session import open_session
from localllm.tui.app import LocalLLMApp

from .test_chat import MODEL, wait_until


@pytest.fixture
def server(tui_home):
    from localllm.engine import Engine
    from localllm.server.app import create_app
    from localllm.server.run import ServerThread

    engine = Engine(keep_alive=300)
    srv = ServerThread(create_app(engine, bound_host="127.0.0.1", api_key="", origins="")).start()
    yield srv
    srv.stop()
    engine.close()


@pytest.mark.asyncio
async def test_chat_and_models_through_a_server(server, chats):
    session = open_session(server.url)
    assert session.remote and session.advisor is None
    conv = chats.create(title="Remote", model=MODEL, params={"seed": 1, "temperature": 0, "max_tokens": 300})
    app = LocalLLMApp(model=MODEL, host=server.url, chats=chats, session=session)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = app.screen
        await pilot.press(*"Tell me a long story about a cat.", "enter")
        await wait_until(pilot, lambda: screen.generating and screen._last_answer() is not None
                         and len(screen._last_answer().markdown.source) > 10, timeout=120)
        await pilot.press("escape")  # drops the connection: the server stops generating
        await wait_until(pilot, lambda: not screen.generating, timeout=30)
        saved = chats.messages(conv.id)
        assert saved[-1].role == "assistant" and saved[-1].stats["finish_reason"] == "cancelled"

        chats.update(conv.id, params={"seed": 1, "temperature": 0, "max_tokens": 12})
        screen.conversation = chats.get(conv.id)
        await pilot.press("ctrl+g")

        def answered() -> bool:
            last = chats.messages(conv.id)[-1]
            return not screen.generating and last.role == "assistant" and last.stats["finish_reason"] != "cancelled"

        await wait_until(pilot, answered, timeout=120)
        await wait_until(pilot, lambda: "tok/s" in str(screen.query_one("#status").render()), timeout=30)
        status = str(screen.query_one("#status").render())
        assert f"server {server.url}" in status and "tok/s" in status and "TTFT" in status, status

        await pilot.press("f3")
        models = app.screen
        await wait_until(pilot, lambda: models.loaded_once.is_set(), timeout=30)
        table = models.query_one("#installed", DataTable)
        names = [str(table.get_row_at(i)[0]) for i in range(table.row_count)]
        assert MODEL in names
        row = table.get_row_at(names.index(MODEL))
        assert str(row[5]) == "yes"  # loaded on the server (/api/ps)


def test_unreachable_host_is_one_sentence(tui_home):
    from localllm.errors import LocalLLMError

    with pytest.raises(LocalLLMError, match="No server is answering"):
        open_session("127.0.0.1:9")
