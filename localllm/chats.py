"""Conversations and messages of the terminal app, in SQLite (``paths().chats_db``).

The database runs in WAL mode; every write commits at once, so a process killed mid-answer loses
only the answer it was generating (the TUI commits the user's message before it generates and the
answer when it is done). The schema is versioned with ``PRAGMA user_version`` and upgraded by the
forward migrations in :data:`MIGRATIONS`, applied in order on open; a database written by a newer
localllm is refused rather than damaged.

    >>> store = ChatStore(":memory:")
    >>> conv = store.create(title="Sky", model="smollm2:135m")
    >>> _ = store.add_message(conv.id, "user", "Why is the sky blue?")
    >>> [m.role for m in store.messages(conv.id)]
    ['user']
    >>> print(store.export_markdown(conv.id).splitlines()[0])
    # Sky
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from localllm.errors import LocalLLMError

DEFAULT_TITLE = "New chat"


def _script(db: sqlite3.Connection, sql: str) -> None:
    """Run ``;``-separated statements inside the caller's transaction (``executescript`` would commit)."""
    for statement in sql.split(";"):
        if statement.strip():
            db.execute(statement)


def _v1(db: sqlite3.Connection) -> None:
    _script(
        db,
        """
        CREATE TABLE conversation (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            title TEXT NOT NULL,
            model TEXT,
            system TEXT NOT NULL DEFAULT '',
            params TEXT NOT NULL DEFAULT '{}',
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL
        );
        CREATE TABLE message (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            conversation_id INTEGER NOT NULL REFERENCES conversation(id) ON DELETE CASCADE,
            role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
            content TEXT NOT NULL,
            created_at REAL NOT NULL
        );
        CREATE INDEX message_conversation ON message(conversation_id, id);
        """
    )


def _v2(db: sqlite3.Connection) -> None:
    """Answers keep the stats they were generated with (model, tokens/s, TTFT, draft acceptance)."""
    db.execute("ALTER TABLE message ADD COLUMN stats TEXT")
    db.execute("CREATE INDEX conversation_updated ON conversation(updated_at)")


def _v3(db: sqlite3.Connection) -> None:
    """Answers of thinking models keep their reasoning apart from the answer (NULL for every older row)."""
    db.execute("ALTER TABLE message ADD COLUMN thinking TEXT")


def _v4(db: sqlite3.Connection) -> None:
    """Answers keep the MCP tool calls made on the way to them (JSON list: tool, arguments, result, status,
    round; NULL for every older row and every answer without calls)."""
    db.execute("ALTER TABLE message ADD COLUMN tool_calls TEXT")


def _v5(db: sqlite3.Connection) -> None:
    """User turns keep the images sent with them: a JSON list of :class:`ImageRef` records (the bytes live in the
    images directory by content hash, so the chat stays whole when the original file moves)."""
    db.execute("ALTER TABLE message ADD COLUMN images TEXT")


def _v6(db: sqlite3.Connection) -> None:
    """Branches: every message names the one it follows (``parent_id``; NULL for a conversation's first) and a
    conversation the last message of the branch it shows (``head_id``). An earlier message edited, or an answer
    regenerated, starts a sibling; the old branch stays. Older rows become one branch, in their order."""
    db.execute("ALTER TABLE message ADD COLUMN parent_id INTEGER")
    db.execute("ALTER TABLE conversation ADD COLUMN head_id INTEGER")
    db.execute("UPDATE message SET parent_id = (SELECT MAX(m.id) FROM message m WHERE "
               "m.conversation_id = message.conversation_id AND m.id < message.id)")
    db.execute("UPDATE conversation SET head_id = (SELECT MAX(m.id) FROM message m WHERE m.conversation_id = "
               "conversation.id)")


# Index i upgrades a database from user_version i to i + 1. Append only; never edit a released step.
MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = [_v1, _v2, _v3, _v4, _v5, _v6]
SCHEMA_VERSION = len(MIGRATIONS)


@dataclass
class Conversation:
    id: int
    title: str
    model: str | None = None
    system: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0
    updated_at: float = 0.0
    head_id: int | None = None  # the last message of the branch shown (None: no message yet)


@dataclass
class ImageRef:
    """An image or an audio clip attached to a message: its bytes are ``<images dir>/<sha256>``."""

    sha256: str
    name: str  # the file name it was attached as
    width: int = 0
    height: int = 0
    format: str = ""  # "PNG", ...; "WAV", "MP3", "FLAC" for a clip
    seconds: float = 0.0  # a clip's length as its header declares it

    @property
    def audio(self) -> bool:
        return self.format in ("WAV", "MP3", "FLAC")

    @property
    def chip(self) -> str:
        """How a message shows it: ``🖼 photo.png 640×480``, ``🔊 memo.wav 1.5 s``."""
        if self.audio:
            s = self.seconds
            return f"🔊 {self.name} " + (f"{s:.1f} s" if s < 60 else f"{int(s // 60)}:{int(s % 60):02d}")
        return f"🖼 {self.name} {self.width}×{self.height}" if self.width else f"🖼 {self.name}"


@dataclass
class Message:
    id: int
    conversation_id: int
    role: str
    content: str
    created_at: float = 0.0
    stats: dict[str, Any] | None = None
    thinking: str | None = None  # a thinking model's reasoning, apart from its answer
    tool_calls: list[dict[str, Any]] | None = None  # MCP calls made for this answer (localllm.mcp.loop.ToolCall)
    images: list[ImageRef] = field(default_factory=list)  # attached to a user turn
    parent_id: int | None = None  # the message it follows (None: the first of its conversation)


class ChatStore:
    """Thread-safe access to the chats database (one connection, one lock; writes commit at once)."""

    def __init__(self, path: str | Path | None = None, images_dir: str | Path | None = None):
        if path is None:
            from localllm.config import paths

            path = paths().chats_db
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = str(path)
        if images_dir is None:
            import tempfile

            images_dir = (Path(path).parent / "chat-images" if str(path) != ":memory:"
                          else Path(tempfile.gettempdir()) / "localllm-chat-images")
        self.images_dir = Path(images_dir)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._migrate()

    # ------------------------------------------------------------------ schema

    @property
    def version(self) -> int:
        return self._db.execute("PRAGMA user_version").fetchone()[0]

    def _migrate(self) -> None:
        with self._lock:
            current = self.version
            if current > SCHEMA_VERSION:
                raise LocalLLMError(
                    f"The chats database {self.path} was written by a newer localllm "
                    f"(schema {current}, this one knows {SCHEMA_VERSION}); upgrade localllm to open it."
                )
            for version in range(current, SCHEMA_VERSION):
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    MIGRATIONS[version](self._db)
                    self._db.execute(f"PRAGMA user_version = {version + 1}")
                    self._db.execute("COMMIT")
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise

    # ------------------------------------------------------------------ conversations

    @staticmethod
    def _conv(row: sqlite3.Row) -> Conversation:
        return Conversation(
            id=row["id"], title=row["title"], model=row["model"], system=row["system"],
            params=json.loads(row["params"] or "{}"), created_at=row["created_at"], updated_at=row["updated_at"],
            head_id=row["head_id"],
        )

    def create(self, title: str = DEFAULT_TITLE, model: str | None = None, system: str = "",
               params: dict[str, Any] | None = None) -> Conversation:
        now = time.time()
        with self._lock:
            cur = self._db.execute(
                "INSERT INTO conversation (title, model, system, params, created_at, updated_at) VALUES (?,?,?,?,?,?)",
                (title, model, system, json.dumps(params or {}), now, now),
            )
            return self.get(cur.lastrowid)  # type: ignore[arg-type]

    def get(self, conversation_id: int) -> Conversation:
        with self._lock:
            row = self._db.execute("SELECT * FROM conversation WHERE id = ?", (conversation_id,)).fetchone()
        if row is None:
            raise LocalLLMError(f"There is no conversation {conversation_id}.")
        return self._conv(row)

    def conversations(self, query: str = "") -> list[Conversation]:
        """Every conversation, most recently used first; with ``query``, those whose title or a message (of any
        branch) holds it, ignoring case."""
        where = ""
        args: tuple[str, ...] = ()
        if query.strip():
            like = "%" + query.strip().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            where = ("WHERE title LIKE ? ESCAPE '\\' OR id IN (SELECT conversation_id FROM message "
                     "WHERE content LIKE ? ESCAPE '\\') ")
            args = (like, like)
        with self._lock:
            rows = self._db.execute(f"SELECT * FROM conversation {where}ORDER BY updated_at DESC, id DESC",
                                    args).fetchall()
        return [self._conv(r) for r in rows]

    def rename(self, conversation_id: int, title: str) -> None:
        title = " ".join(title.split())
        if not title:
            raise LocalLLMError("A conversation needs a title that is not empty.")
        with self._lock:
            self._db.execute("UPDATE conversation SET title = ? WHERE id = ?", (title[:200], conversation_id))

    def update(self, conversation_id: int, *, model: str | None = None, system: str | None = None,
               params: dict[str, Any] | None = None) -> Conversation:
        """Change the model, system prompt or parameters (``None`` leaves a field as it is)."""
        sets, args = [], []
        for column, value in (("model", model), ("system", system)):
            if value is not None:
                sets.append(f"{column} = ?")
                args.append(value)
        if params is not None:
            sets.append("params = ?")
            args.append(json.dumps(params))
        if sets:
            with self._lock:
                self._db.execute(f"UPDATE conversation SET {', '.join(sets)} WHERE id = ?", (*args, conversation_id))
        return self.get(conversation_id)

    def delete(self, conversation_id: int) -> None:
        with self._lock:
            self._db.execute("DELETE FROM conversation WHERE id = ?", (conversation_id,))

    # ------------------------------------------------------------------ messages

    @staticmethod
    def _msg(row: sqlite3.Row) -> Message:
        stats, images, calls = row["stats"], row["images"], row["tool_calls"]
        return Message(id=row["id"], conversation_id=row["conversation_id"], role=row["role"],
                       content=row["content"], created_at=row["created_at"],
                       stats=json.loads(stats) if stats else None, thinking=row["thinking"],
                       tool_calls=json.loads(calls) if calls else None,
                       images=[ImageRef(**i) for i in json.loads(images)] if images else [],
                       parent_id=row["parent_id"])

    def save_image(self, data: bytes, name: str) -> ImageRef:
        """Keep an image's (or an audio clip's) bytes by content hash (once) and return its record."""
        import hashlib
        import os

        from localllm.images import image_size

        sha = hashlib.sha256(data).hexdigest()
        self.images_dir.mkdir(parents=True, exist_ok=True)
        dest = self.images_dir / sha
        if not dest.is_file():
            tmp = dest.with_name(f".{sha}.{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, dest)
        from localllm.audio import clip_info

        clip = clip_info(data)
        if clip is not None:
            return ImageRef(sha, name, format=clip.format, seconds=max(0.0, clip.seconds))
        fmt, w, h = image_size(data) or ("", 0, 0)
        return ImageRef(sha, name, w, h, fmt)

    def image_bytes(self, ref: ImageRef) -> bytes:
        """The bytes of an attached image (:class:`LocalLLMError` when they are gone)."""
        try:
            return (self.images_dir / ref.sha256).read_bytes()
        except OSError:
            raise LocalLLMError(f"The image {ref.name} of this chat is missing from {self.images_dir}.") from None

    def add_message(self, conversation_id: int, role: str, content: str,
                    stats: dict[str, Any] | None = None, thinking: str | None = None,
                    images: list[ImageRef] | None = None,
                    tool_calls: list[dict[str, Any]] | None = None,
                    parent_id: int | None | Literal["head"] = "head") -> Message:
        """Append a message and commit it (the conversation moves to the top of the list). ``thinking``: the
        reasoning that came before an answer; ``images``: those attached to it (:meth:`save_image`);
        ``tool_calls``: the tool calls made on the way to it. ``parent_id``: the message it follows, by default
        the end of the branch shown; another one (None: the first message) starts a new branch there. Either
        way the new message becomes the branch shown."""
        from dataclasses import asdict

        now = time.time()
        pics = json.dumps([asdict(i) for i in images]) if images else None
        with self._lock:
            if parent_id == "head":
                parent_id = self.get(conversation_id).head_id
            elif parent_id is not None:
                row = self._db.execute("SELECT conversation_id FROM message WHERE id = ?", (parent_id,)).fetchone()
                if row is None or row[0] != conversation_id:
                    raise LocalLLMError(f"There is no message {parent_id} in conversation {conversation_id}.")
            cur = self._db.execute(
                "INSERT INTO message (conversation_id, role, content, created_at, stats, thinking, images, "
                "tool_calls, parent_id) VALUES (?,?,?,?,?,?,?,?,?)",
                (conversation_id, role, content, now, json.dumps(stats) if stats else None, thinking or None, pics,
                 json.dumps(tool_calls) if tool_calls else None, parent_id),
            )
            self._db.execute("UPDATE conversation SET updated_at = ?, head_id = ? WHERE id = ?",
                             (now, cur.lastrowid, conversation_id))
            row = self._db.execute("SELECT * FROM message WHERE id = ?", (cur.lastrowid,)).fetchone()
        return self._msg(row)

    def messages(self, conversation_id: int) -> list[Message]:
        """The branch shown: from the first message to the conversation's head, in order."""
        with self._lock:
            rows = self._db.execute(
                "WITH RECURSIVE path(id) AS (SELECT head_id FROM conversation WHERE id = ? AND head_id IS NOT NULL "
                "UNION ALL SELECT m.parent_id FROM message m JOIN path ON m.id = path.id "
                "WHERE m.parent_id IS NOT NULL) "
                "SELECT message.* FROM message JOIN path ON message.id = path.id ORDER BY message.id",
                (conversation_id,),
            ).fetchall()
        return [self._msg(r) for r in rows]

    def all_messages(self, conversation_id: int) -> list[Message]:
        """Every message of every branch, oldest first (``parent_id`` links them)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM message WHERE conversation_id = ? ORDER BY id", (conversation_id,)
            ).fetchall()
        return [self._msg(r) for r in rows]

    def set_head(self, conversation_id: int, message_id: int) -> Conversation:
        """Show the branch that ends at ``message_id`` (one of this conversation's messages)."""
        with self._lock:
            row = self._db.execute("SELECT conversation_id FROM message WHERE id = ?", (message_id,)).fetchone()
            if row is None or row[0] != conversation_id:
                raise LocalLLMError(f"There is no message {message_id} in conversation {conversation_id}.")
            self._db.execute("UPDATE conversation SET head_id = ? WHERE id = ?", (message_id, conversation_id))
        return self.get(conversation_id)

    def delete_message(self, message_id: int) -> None:
        """Remove one message; those that followed it follow its parent, and a head on it moves to its parent."""
        with self._lock:
            row = self._db.execute("SELECT conversation_id, parent_id FROM message WHERE id = ?",
                                   (message_id,)).fetchone()
            if row is None:
                return
            conv, parent = row
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("UPDATE message SET parent_id = ? WHERE parent_id = ?", (parent, message_id))
                self._db.execute("UPDATE conversation SET head_id = ? WHERE id = ? AND head_id = ?",
                                 (parent, conv, message_id))
                self._db.execute("DELETE FROM message WHERE id = ?", (message_id,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def prompt_history(self, limit: int = 200) -> list[str]:
        """The user's earlier prompts across conversations, oldest first, without repeats."""
        with self._lock:
            rows = self._db.execute(
                "SELECT content FROM message WHERE role = 'user' ORDER BY id DESC LIMIT ?", (limit * 2,)
            ).fetchall()
        seen: set[str] = set()
        out: list[str] = []
        for (content,) in rows:
            if content not in seen:
                seen.add(content)
                out.append(content)
        return list(reversed(out[:limit]))

    # ------------------------------------------------------------------ export

    def export_markdown(self, conversation_id: int) -> str:
        """The conversation as a Markdown document (title, settings, then one section per message; an answer's
        reasoning in a ``<details>`` block before it, folded where Markdown renders HTML)."""
        conv = self.get(conversation_id)
        lines = [f"# {conv.title}", ""]
        if conv.model:
            lines.append(f"- model: `{conv.model}`")
        for key, value in sorted(conv.params.items()):
            lines.append(f"- {key}: `{value}`")
        if conv.system:
            lines += ["", "## System", "", conv.system]
        for msg in self.messages(conversation_id):
            lines += ["", f"## {msg.role.capitalize()}", ""]
            if msg.thinking:
                lines += ["<details><summary>Thinking</summary>", "", msg.thinking.strip(), "", "</details>", ""]
            for img in msg.images:  # the file by content hash, so the export points at bytes that stay
                lines.append(f"![{img.name}]({(self.images_dir / img.sha256).as_uri()})")
            for call in msg.tool_calls or []:
                args = json.dumps(call.get("arguments") or {}, ensure_ascii=False)
                lines += [f"<details><summary>Tool call: {call.get('tool')} ({call.get('status')})</summary>", "",
                          "```json", args, "```", "", "```", str(call.get("result") or ""), "```", "",
                          "</details>", ""]
            lines.append(msg.content)
        return "\n".join(lines).rstrip() + "\n"

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> ChatStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
