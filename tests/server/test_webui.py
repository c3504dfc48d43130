"""The web page (``/ui/``) in a real browser: Debian's Chromium driven by Playwright, against a real
``localllm serve`` subprocess with the default model (one per module, over a private home whose chats are the
terminal app's store). Screenshots of each view go to ``$LOCALLLM_TEST_CACHE/webui-screenshots`` (not committed).
"""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.support import TEST_CACHE, TEST_HOME, MirrorServer, Route, install_copy, mirror_toml

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
SHOTS = TEST_CACHE / "webui-screenshots"
MODEL = "smollm2:135m"
# a 1x1 PNG
PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5Erk"
                       "Jggg==")


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Served:
    """``localllm serve`` in a subprocess over ``home``."""

    def __init__(self, home: Path, **env: str):
        self.home = home
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        full = {**os.environ, "LOCALLLM_HOME": str(home), "LOCALLLM_KEEP_ALIVE": "5m", **env}
        full.pop("LOCALLLM_MODELS", None)
        full["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + full.get("PYTHONPATH", "")
        self.log = open(home / "serve.log", "w+b")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "localllm", "serve", "--host", f"127.0.0.1:{self.port}"],
                                     env=full, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/", timeout=1).status_code in (200, 401):
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("localllm serve did not start: " + self.output())
            time.sleep(0.1)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _home(root: Path, mirror_url: str, wheel: bytes) -> Path:
    """A private home: the default model installed (hard links to the test home's), and a catalog whose
    ``smollm2:135m`` comes from the local mirror (so a pull after a delete downloads it again, offline)."""
    install_copy(root / "data" / "models", TEST_HOME / "data" / "models")
    (root / "config").mkdir(parents=True, exist_ok=True)
    (root / "config" / "models.toml").write_text(mirror_toml(mirror_url, wheel))
    return root


@pytest.fixture(scope="module")
def mirror(smollm2_wheel):
    s = MirrorServer()
    s.routes["/smollm2.whl"] = Route(smollm2_wheel, rate=40e6)  # ~2.5 s: the progress bar is seen moving
    yield s
    s.close()


@pytest.fixture(scope="module")
def served(installed_default_model, smollm2_wheel, mirror, tmp_path_factory):
    home = _home(tmp_path_factory.mktemp("webui-home"), mirror.url + "/smollm2.whl", smollm2_wheel)
    srv = Served(home)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser():
    playwright = pytest.importorskip("playwright.sync_api")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no {CHROMIUM}: apt-get install chromium (.ci/run does)")
    SHOTS.mkdir(parents=True, exist_ok=True)
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, served):
    ctx = browser.new_context(viewport={"width": 1200, "height": 800})
    pg = ctx.new_page()
    pg.errors = []  # type: ignore[attr-defined]
    pg.on("console", lambda m: m.type == "error" and pg.errors.append(m.text))
    pg.on("pageerror", lambda e: pg.errors.append(str(e)))
    pg.answer = None  # type: ignore[attr-defined]  # what a prompt() gets (None: its default)
    pg.on("dialog", lambda d: d.accept(pg.answer) if pg.answer is not None else d.accept())
    pg.goto(served.url + "/ui/")
    pg.wait_for_selector("body[data-ready]")
    yield pg
    ctx.close()


def _chats_db(served: Served):
    from localllm.chats import ChatStore

    return ChatStore(served.home / "data" / "chats.sqlite3")


def _ask(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def _wait_answer(page, n: int = 1, timeout: float = 60_000) -> None:
    """Until the n-th saved answer of the branch shown is on screen."""
    page.wait_for_function(f"() => document.querySelectorAll('.msg.assistant:not(.live)').length >= {n}",
                           timeout=timeout)


def test_root_answers_ollama_clients_and_sends_browsers_to_the_page(served):
    r = httpx.get(served.url + "/")  # what Ollama's clients and `curl` send
    assert (r.status_code, r.text) == (200, "Ollama is running")
    r = httpx.get(served.url + "/", headers={"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"})
    assert r.status_code == 302 and r.headers["location"] == "/ui/"
    page = httpx.get(served.url + "/ui/", headers={"Accept-Encoding": "gzip"})
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert page.headers["content-encoding"] == "gzip" and "<title>localllm</title>" in page.text
    assert "Web UI: http://127.0.0.1:" in served.output()  # `localllm serve` says where the page is


def test_page_loads_without_console_errors(page, served):
    assert MODEL in page.eval_on_selector_all("#model option", "os => os.map(o => o.value)")
    assert page.errors == []
    page.screenshot(path=str(SHOTS / "empty.png"))


def test_a_prompt_gets_a_streamed_answer_saved_in_the_terminal_apps_store(page, served):
    page.click("#settings summary")
    page.fill("#temperature", "0")
    # counts the repaints of the answer while it streams
    page.evaluate("""() => { window.paints = 0; new MutationObserver(() => {
        if (document.querySelector('.msg.live')) window.paints++; })
        .observe(document.querySelector('#messages'), {childList: true, subtree: true, characterData: true}); }""")
    _ask(page, "Write a Python function that adds two numbers.")
    page.wait_for_selector(".msg.live")
    _wait_answer(page)
    answer = page.inner_text(".msg.assistant .content")
    assert answer.strip()
    assert page.evaluate("window.paints") >= 3  # several repaints: it streamed, not all at the end
    figures = page.inner_text(".msg.assistant .figures")
    assert "tok/s" in figures and "first token" in figures and "cached" in figures
    assert page.errors == []
    page.click("#settings summary")  # folded again for the picture
    page.screenshot(path=str(SHOTS / "chat.png"))
    # the same conversation, read by the terminal app's store
    with _chats_db(served) as store:
        conv = next(c for c in store.conversations() if c.title.startswith("Write a Python function"))
        msgs = store.messages(conv.id)
        assert [m.role for m in msgs] == ["user", "assistant"]
        assert "def add" in msgs[1].content and msgs[1].stats["eval_count"] > 0
        assert conv.params.get("temperature") == 0
    assert "def add" in page.inner_text(".msg.assistant .code pre")  # its code block, rendered


def test_stop_cancels_the_generation_and_frees_the_slot(page, served):
    page.click("#settings summary")
    page.fill("#temperature", "0")  # the same long answer every time
    _ask(page, "Write a long story about a lighthouse keeper.")  # 590 tokens at temperature 0
    page.wait_for_function("() => (document.querySelector('.msg.live .content')?.textContent || '').length > 20",
                           timeout=60_000)
    page.keyboard.press("Escape")
    _wait_answer(page)
    assert "stopped" in page.inner_text(".msg.assistant .figures")
    deadline = time.monotonic() + 5
    while True:
        busy = [m.get("slots_busy", 0) for m in httpx.get(served.url + "/api/ps").json()["models"]]
        if not any(busy):
            break
        assert time.monotonic() < deadline, f"slots still busy after stop: {busy}"
        time.sleep(0.05)


def test_regenerate_and_edit_keep_branches(page, served):
    _ask(page, "Say hello.")
    _wait_answer(page)
    page.click(".msg.assistant .regen")
    page.wait_for_function("() => document.querySelector('.msg.assistant .branch')?.textContent === '2/2'",
                           timeout=60_000)
    # edit the question: a second branch from the start, the first one kept
    page.click(".msg.user .edit-btn")
    page.fill(".msg.user textarea.edit", "Say goodbye.")
    page.click(".msg.user .save-edit")
    page.wait_for_function("() => document.querySelector('.msg.user .branch')?.textContent === '2/2'", timeout=60_000)
    _wait_answer(page)
    assert page.inner_text(".msg.user .content") == "Say goodbye."
    page.screenshot(path=str(SHOTS / "branches.png"))
    page.click(".msg.user .branch-prev")
    page.wait_for_function("() => document.querySelector('.msg.user .content')?.textContent === 'Say hello.'")
    assert page.inner_text(".msg.assistant .branch") == "2/2"  # its two answers are still there
    with _chats_db(served) as store:
        conv = next(c for c in store.conversations() if c.title == "Say hello.")
        assert sorted(m.role for m in store.all_messages(conv.id)) == ["assistant"] * 3 + ["user"] * 2
        assert [m.content for m in store.messages(conv.id)][0] == "Say hello."  # the branch shown, for the TUI too


def test_a_text_only_model_refuses_an_image_before_sending(page, tmp_path):
    img = tmp_path / "dot.png"
    img.write_bytes(PNG)
    page.set_input_files("#file", str(img))
    page.wait_for_selector("#notice:not([hidden])")
    assert "cannot take images" in page.inner_text("#notice")
    assert page.inner_text("#attachments") == ""


def test_an_image_on_a_model_with_a_projector_is_counted_in_the_prompt(browser, tmp_path, installed_default_model,
                                                                      test_projector):
    from localllm.store import Store
    from tests.support import private_paths
    from tests.support_vision import IMAGE_TOKENS, png

    home = tmp_path / "home"
    install_copy(home / "data" / "models", TEST_HOME / "data" / "models")
    Store(paths=private_paths(home)).set_projector(MODEL, test_projector)
    srv = Served(home)
    try:
        ctx = browser.new_context()
        pg = ctx.new_page()
        pg.goto(srv.url + "/ui/")
        pg.wait_for_selector("body[data-ready]")
        img = tmp_path / "picture.png"
        img.write_bytes(png(64, 64))
        pg.set_input_files("#file", str(img))
        pg.wait_for_selector("#attachments .chip")
        _ask(pg, "What is in this picture?")
        _wait_answer(pg)
        assert "image: picture.png" in pg.inner_text(".msg.user")
        text_only = httpx.post(srv.url + "/api/chat", json={
            "model": MODEL, "stream": False, "options": {"num_predict": 1},
            "messages": [{"role": "user", "content": "What is in this picture?"}]}).json()["prompt_eval_count"]
        with _chats_db(srv) as store:
            conv = store.conversations()[0]
            user, answer = store.messages(conv.id)
            assert [i.name for i in user.images] == ["picture.png"] and user.images[0].width == 64
            # the image's 16 positions (and its markers) beside the same prompt without it
            assert answer.stats["prompt_eval_count"] >= text_only + IMAGE_TOKENS
        pg.screenshot(path=str(SHOTS / "image.png"))
        ctx.close()
    finally:
        srv.stop()


def test_search_rename_export_delete_a_conversation(page, served):
    _ask(page, "Name a colour.")
    _wait_answer(page)
    page.fill("#search", "a colour")
    page.wait_for_function("() => [...document.querySelectorAll('#chats li')].length === 1")
    page.answer = "Colours"
    page.click("#rename")
    page.wait_for_function("() => document.querySelector('#chat-title').textContent === 'Colours'")
    with page.expect_download() as dl:
        page.click("#export-md")
    text = Path(dl.value.path()).read_text()
    assert text.startswith("# Colours") and "## Assistant" in text
    page.click("#delete-chat")
    page.wait_for_function("() => document.querySelector('#chat-title').textContent === 'New chat'")
    with _chats_db(served) as store:
        assert not [c for c in store.conversations() if c.title == "Colours"]


def test_models_delete_then_pull_with_progress(page, served):
    page.click("#tab-models")
    page.wait_for_selector(f"#installed tr[data-model='{MODEL}']")
    page.screenshot(path=str(SHOTS / "models.png"), full_page=True)
    page.click(f"#installed tr[data-model='{MODEL}'] button.danger")  # the confirm() is accepted
    page.wait_for_selector(f"#installed tr[data-model='{MODEL}']", state="detached")
    assert MODEL not in [m["name"] for m in httpx.get(served.url + "/api/tags").json()["models"]]
    page.fill("#pull-name", MODEL)
    page.click("#pull")
    # the bar moves: seen part way
    page.wait_for_function("() => (p => p.value > 0 && p.value < p.max)(document.querySelector('#pull-progress'))",
                           timeout=60_000)
    page.screenshot(path=str(SHOTS / "pull.png"))
    page.click("#pull-cancel")  # the download stops; pulling again resumes it
    page.wait_for_function("() => document.querySelector('#pull-text').textContent.startsWith('cancelled')")
    assert MODEL not in [m["name"] for m in httpx.get(served.url + "/api/tags").json()["models"]]
    page.click("#pull")
    page.wait_for_selector(f"#installed tr[data-model='{MODEL}']", timeout=120_000)
    assert "installed" in page.inner_text("#notice")
    assert MODEL in [m["name"] for m in httpx.get(served.url + "/api/tags").json()["models"]]


def test_a_token_protected_server_asks_for_the_token_once_per_tab(browser, tmp_path, installed_default_model):
    home = tmp_path / "home"
    install_copy(home / "data" / "models", TEST_HOME / "data" / "models")
    srv = Served(home, LOCALLLM_API_KEY="s3cret-token")
    try:
        assert httpx.get(srv.url + "/api/tags").status_code == 401
        ctx = browser.new_context()
        pg = ctx.new_page()
        pg.goto(srv.url + "/ui/")
        pg.wait_for_selector("#token-dialog[open]")
        pg.screenshot(path=str(SHOTS / "token.png"))
        pg.fill("#token", "s3cret-token")
        pg.press("#token", "Enter")
        pg.wait_for_selector("body[data-ready]")
        assert MODEL in pg.eval_on_selector_all("#model option", "os => os.map(o => o.value)")
        pg.reload()  # kept for the tab
        pg.wait_for_selector("body[data-ready]")
        assert not pg.is_visible("#token-dialog")
        ctx.close()
    finally:
        srv.stop()


def test_a_page_of_another_origin_cannot_drive_it(browser, served):
    evil = "127.0.0.2"

    class Page(BaseHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            body = b"<!doctype html><title>elsewhere</title>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    other = ThreadingHTTPServer((evil, 0), Page)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    ctx = browser.new_context()
    try:
        pg = ctx.new_page()
        pg.goto(f"http://{evil}:{other.server_address[1]}/")
        results = pg.evaluate("""async (url) => {
            const out = {};
            try { out.read = await (await fetch(url + '/api/chats')).text(); } catch (e) { out.read = 'blocked'; }
            try { const r = await fetch(url + '/api/chats', {method: 'POST', body: '{"title": "planted"}'});
                  out.write = r.status; } catch (e) { out.write = 'blocked'; }
            return out; }""", served.url)
        assert results["read"] == "blocked"  # CORS: the API answers only its own origin (and loopback ones)
        assert results["write"] == "blocked"
        titles = [c["title"] for c in httpx.get(served.url + "/api/chats").json()["chats"]]
        assert "planted" not in titles  # the simple POST reached the server and was refused (403)
    finally:
        ctx.close()
        other.shutdown()
        other.server_close()


def test_narrow_and_dark(page, served):
    page.set_viewport_size({"width": 390, "height": 800})
    page.click("#theme")
    bg = page.evaluate("getComputedStyle(document.body).backgroundColor")
    page.screenshot(path=str(SHOTS / "narrow-dark.png"))
    page.click("#theme")
    assert bg != page.evaluate("getComputedStyle(document.body).backgroundColor")  # the toggle switches
    wide = page.evaluate("""() => [...document.querySelectorAll('body *')]
        .filter(e => e.getBoundingClientRect().right > 391 && e.offsetParent !== null)
        .map(e => e.id || e.className || e.tagName)""")
    assert page.evaluate("document.documentElement.scrollWidth <= 390"), wide  # nothing wider than the phone
    assert page.is_visible("#prompt") and page.is_visible("#send") and not page.is_visible("#sidebar")
    page.click("#menu")
    assert page.is_visible("#sidebar")
    page.screenshot(path=str(SHOTS / "narrow.png"))


def test_the_answer_on_screen_keeps_up_with_the_stream(browser, served):
    """Issue 49's "Fast": the first answer text in the DOM soon after the API's first line reaches the page, and a
    long answer (num_predict 600: the 590-token story ends first; no ignore_eos in the API) all on screen soon
    after the stream's end: the page's repaints never fall behind.
    Timed inside the page (benchmarks/webui.py's probe: the stream tapped
    between fetch and the page's reader, the DOM watched). Bounds generous for a loaded 2-core machine."""
    from benchmarks.webui import PROBE, lags

    ctx = browser.new_context(viewport={"width": 1200, "height": 800})
    try:
        page = ctx.new_page()
        page.add_init_script(PROBE)
        page.goto(served.url + "/ui/")
        page.wait_for_selector("body[data-ready]")
        page.click("#settings summary")
        page.fill("#temperature", "0")
        page.evaluate("window.__numPredict = 600")
        _ask(page, "Write a long story about a lighthouse keeper.")  # 590 tokens at temperature 0
        _wait_answer(page, timeout=120_000)
        x = lags(page.evaluate("window.__probe"))
        assert x["lines"] > 400  # it streamed the long answer, line by line
        assert x["first_gap_ms"] <= 250, x
        assert x["end_lag_ms"] <= 1000, x
        assert x["worst_lag_ms"] <= 1500, x
    finally:
        ctx.close()
