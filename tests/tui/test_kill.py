"""A process killed mid-answer loses only the unfinished answer (SIGKILL, then the database reopened)."""

from __future__ import annotations

from localllm.chats import ChatStore

MODEL = "smollm2:135m"


KILL_SCRIPT = """
import asyncio, os, signal, sys
from textual.widgets import Markdown
from localllm.chats import ChatStore
from localllm.tui.app import LocalLLMApp

real_get_stream = Markdown.get_stream

def get_stream(markdown):
    # Freeze the whole process at the first streamed write past 20 characters: mid-answer for sure,
    # whatever the machine's speed. The test then SIGKILLs it.
    stream = real_get_stream(markdown)
    real_write = stream.write

    async def write(fragment):
        await real_write(fragment)
        if len(markdown.source) > 20:
            print("STREAMING", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)

    stream.write = write
    return stream

Markdown.get_stream = staticmethod(get_stream)

async def main():
    chats = ChatStore(sys.argv[1])
    conv = chats.conversations()[0]
    app = LocalLLMApp(model="smollm2:135m", chats=chats)
    async with app.run_test(size=(100, 30)) as pilot:
        app.screen.open_conversation(conv.id)
        await pilot.press(*"Write a long story about the sea.", "enter")
        # the key press returns as soon as the worker starts: only an answer that ended before 20
        # characters is "too early" (the process is frozen mid-answer otherwise, and killed)
        await asyncio.wait_for(app.screen.answer_done.wait(), 120)
        print("FINISHED-TOO-EARLY", flush=True)
        await asyncio.sleep(60)

asyncio.run(main())
"""


def test_killed_mid_answer_loses_only_the_unfinished_answer(tui_home, chats, tmp_path):
    import os
    import select
    import signal
    import subprocess
    import sys

    conv = chats.create(title="Kill", model=MODEL, params={"max_tokens": 400, "seed": 1})
    chats.add_message(conv.id, "user", "earlier question")
    chats.add_message(conv.id, "assistant", "earlier answer")
    script = tmp_path / "kill_me.py"
    script.write_text(KILL_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), chats.path], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=os.environ.copy())
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 180)  # never wait forever for the line
        assert ready, "the app printed nothing within 180 s"
        line = proc.stdout.readline()
        assert line.strip() == "STREAMING"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    reopened = ChatStore(chats.path)
    assert reopened._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert [(m.role, m.content) for m in reopened.messages(conv.id)] == [
        ("user", "earlier question"), ("assistant", "earlier answer"),
        ("user", "Write a long story about the sea."),  # committed before generating; the answer is lost
    ]
    reopened.close()
