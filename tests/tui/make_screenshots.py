"""Regenerate the README screenshots in ``assets/`` (SVG, plus PNG when cairosvg is importable).

    python tests/tui/make_screenshots.py

Real answers from the default model (installed in the test home), real model manager and hardware
view of this machine, at 80x24 and 200x60.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[2] / "assets"
MODELS = Path(os.environ.get("LOCALLLM_TEST_CACHE", "~/.cache/localllm-tests")).expanduser() / "home/data/models"


async def shoot() -> list[Path]:
    os.environ["LOCALLLM_HOME"] = tempfile.mkdtemp()
    os.environ["LOCALLLM_MODELS"] = str(MODELS)
    from localllm.chats import ChatStore
    from localllm.tui.app import LocalLLMApp

    chats = ChatStore(Path(os.environ["LOCALLLM_HOME"]) / "chats.sqlite3")
    for title in ("Rust borrow checker", "Plan a weekend in Lisbon"):
        c = chats.create(title=title, model="smollm2:135m")
        chats.add_message(c.id, "user", title)
    conv = chats.create(title="New chat", model="smollm2:135m", params={"temperature": 0, "seed": 1, "max_tokens": 160})
    out: list[Path] = []
    for size, name in (((200, 60), "200x60"), ((80, 24), "80x24")):
        app = LocalLLMApp(model="smollm2:135m", chats=chats)
        async with app.run_test(size=size) as pilot:
            screen = app.screen
            screen.open_conversation(conv.id)
            await pilot.pause()
            if not chats.messages(conv.id):
                await pilot.press(*"Write a Python function that reverses a string, with an example.", "enter")
                await pilot.pause(0.2)
                await screen.answer_done.wait()
            else:  # second size: same conversation, regenerate for live stats
                await pilot.press("ctrl+g")
                await pilot.pause(0.2)
                await screen.answer_done.wait()
            await pilot.pause(0.5)
            out.append(Path(app.save_screenshot(f"tui-chat-{name}.svg", str(ASSETS))))
            if name == "200x60":
                await pilot.press("f3")
                await pilot.pause(3)
                out.append(Path(app.save_screenshot(f"tui-models-{name}.svg", str(ASSETS))))
                await pilot.press("f4")
                await pilot.pause(3)
                out.append(Path(app.save_screenshot(f"tui-hardware-{name}.svg", str(ASSETS))))
    chats.close()
    return out


def main() -> None:
    paths = asyncio.run(shoot())
    try:
        import cairosvg
    except ImportError:
        cairosvg = None
    for p in paths:
        print(p)
        if cairosvg is not None:
            png = p.with_suffix(".png")
            cairosvg.svg2png(url=str(p), write_to=str(png), output_width=1600)
            print(png)


if __name__ == "__main__":
    main()
