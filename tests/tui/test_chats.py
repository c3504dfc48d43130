"""The chats database: WAL, forward migrations from every older schema, refusal of a newer one."""

from __future__ import annotations

import sqlite3

import pytest

from localllm import chats as chats_mod
from localllm.chats import SCHEMA_VERSION, ChatStore
from localllm.errors import LocalLLMError


def test_new_database_is_wal_and_current(tmp_path):
    store = ChatStore(tmp_path / "c.sqlite3")
    assert store.version == SCHEMA_VERSION == len(chats_mod.MIGRATIONS)
    mode = store._db.execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    store.close()


def test_v1_database_is_migrated_and_keeps_its_rows(tmp_path):
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path, isolation_level=None)
    chats_mod.MIGRATIONS[0](db)  # a database written by the first release
    db.execute("PRAGMA user_version = 1")
    db.execute("INSERT INTO conversation (title, created_at, updated_at) VALUES ('old', 1, 1)")
    db.execute("INSERT INTO message (conversation_id, role, content, created_at) VALUES (1, 'user', 'hi', 1)")
    db.close()

    store = ChatStore(path)
    assert store.version == SCHEMA_VERSION
    [conv] = store.conversations()
    assert conv.title == "old"
    [msg] = store.messages(conv.id)
    assert (msg.role, msg.content, msg.stats) == ("user", "hi", None)
    store.add_message(conv.id, "assistant", "hello", {"eval_count": 3})  # the v2 column works
    assert store.messages(conv.id)[-1].stats == {"eval_count": 3}
    store.close()


def test_newer_database_is_refused_not_damaged(tmp_path):
    path = tmp_path / "new.sqlite3"
    ChatStore(path).close()
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.commit()
    db.close()
    with pytest.raises(LocalLLMError, match="newer localllm"):
        ChatStore(path)
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION + 1
    db.close()


def test_failed_migration_rolls_back(tmp_path, monkeypatch):
    path = tmp_path / "c.sqlite3"

    def broken(db):
        db.execute("CREATE TABLE half_done (x)")
        raise RuntimeError("boom")

    monkeypatch.setattr(chats_mod, "MIGRATIONS", [chats_mod.MIGRATIONS[0], broken])
    monkeypatch.setattr(chats_mod, "SCHEMA_VERSION", 2)
    with pytest.raises(RuntimeError):
        ChatStore(path)
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == 1
    assert db.execute("SELECT name FROM sqlite_master WHERE name = 'half_done'").fetchone() is None
    db.close()


def test_delete_cascades_history_and_export(tmp_path):
    store = ChatStore(tmp_path / "c.sqlite3")
    a = store.create(title="A", model="m", system="Be brief.", params={"seed": 1})
    store.add_message(a.id, "user", "one")
    store.add_message(a.id, "assistant", "1")
    b = store.create(title="B")
    store.add_message(b.id, "user", "two")
    store.add_message(b.id, "user", "one")
    assert store.prompt_history() == ["two", "one"]
    md = store.export_markdown(a.id)
    assert md.splitlines()[:4] == ["# A", "", "- model: `m`", "- seed: `1`"]
    assert "## System\n\nBe brief." in md and "## Assistant\n\n1" in md
    store.delete(a.id)
    assert store.messages(a.id) == []
    assert [c.title for c in store.conversations()] == ["B"]
    with pytest.raises(LocalLLMError):
        store.rename(b.id, "   ")
    store.close()


def test_v2_database_gains_the_thinking_column_and_keeps_its_chats(tmp_path):
    path = tmp_path / "v2.sqlite3"
    db = sqlite3.connect(path, isolation_level=None)
    chats_mod.MIGRATIONS[0](db)
    chats_mod.MIGRATIONS[1](db)  # a database written before thinking was saved
    db.execute("PRAGMA user_version = 2")
    db.execute("INSERT INTO conversation (title, created_at, updated_at) VALUES ('kept', 1, 1)")
    db.execute("INSERT INTO message (conversation_id, role, content, created_at, stats) "
               "VALUES (1, 'assistant', 'an answer', 1, '{\"eval_count\": 2}')")
    db.close()

    store = ChatStore(path)
    assert store.version == SCHEMA_VERSION >= 3
    [conv] = store.conversations()
    [old] = store.messages(conv.id)
    assert (old.content, old.stats, old.thinking) == ("an answer", {"eval_count": 2}, None)
    store.add_message(conv.id, "assistant", "Four.", {"eval_count": 9}, thinking="Two and two make four.")
    new = store.messages(conv.id)[-1]
    assert (new.content, new.thinking) == ("Four.", "Two and two make four.")
    md = store.export_markdown(conv.id)
    assert "## Assistant\n\nan answer" in md  # no empty block for an answer without reasoning
    assert "## Assistant\n\n<details><summary>Thinking</summary>\n\nTwo and two make four.\n\n</details>\n\nFour." in md
    store.close()


def test_v5_database_becomes_one_branch_and_edits_branch_from_there(tmp_path):
    """Issue 49: the web page's regenerate and edit keep the old branch; the terminal app sees the branch shown."""
    path = tmp_path / "v5.sqlite3"
    db = sqlite3.connect(path, isolation_level=None)
    for step in chats_mod.MIGRATIONS[:5]:
        step(db)
    db.execute("PRAGMA user_version = 5")
    for title in ("a", "b"):
        db.execute("INSERT INTO conversation (title, created_at, updated_at) VALUES (?, 1, 1)", (title,))
    for conv, role, content in ((1, "user", "Hi"), (2, "user", "Other"), (1, "assistant", "Hello"),
                                (1, "user", "Bye")):
        db.execute("INSERT INTO message (conversation_id, role, content, created_at) VALUES (?, ?, ?, 1)",
                   (conv, role, content))
    db.close()

    store = ChatStore(path)
    assert [m.content for m in store.messages(1)] == ["Hi", "Hello", "Bye"]  # the old order, one branch
    hi, hello, _ = store.messages(1)
    again = store.add_message(1, "assistant", "Hello again", parent_id=hi.id)  # a regenerated answer
    assert [m.content for m in store.messages(1)] == ["Hi", "Hello again"]
    assert len(store.all_messages(1)) == 4  # the first branch is kept
    store.set_head(1, hello.id)
    assert [m.content for m in store.messages(1)] == ["Hi", "Hello"]
    store.delete_message(hello.id)  # the head moves to its parent
    assert [m.content for m in store.messages(1)] == ["Hi"]
    assert [m.content for m in store.messages(2)] == ["Other"]
    with pytest.raises(LocalLLMError):
        store.add_message(1, "user", "x", parent_id=store.messages(2)[0].id)  # not this conversation's
    assert [c.title for c in store.conversations("hello AGAIN")] == ["a"]  # search: titles and messages
    assert again.parent_id == hi.id
    store.close()
