"""Conversations kept across restarts, in one SQLite file under the user's data directory.

A session is saved whole (its row and all its turns) whenever it changes: conversations are short,
and a whole-session write in one transaction can never leave half a turn behind. The schema
version is SQLite's `user_version`, and an older file is migrated in place; a file from a newer
minichat, a file that is not a database or one another program holds locked becomes a StoreError
with a sentence a person can act on, and the console runs on without saving.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import msgspec

from engine.params import SamplingParams
from tui.session import Reply, Session, Turn

SCHEMA_VERSION = 2
SCHEMA = """
CREATE TABLE sessions (
    uid TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    system_prompt TEXT NOT NULL,
    params TEXT NOT NULL,          -- the SamplingParams as JSON
    context_start INTEGER NOT NULL, -- turns before this one are no longer sent (trimmed or /clear)
    created REAL NOT NULL,         -- seconds since the epoch
    updated REAL NOT NULL,
    open INTEGER NOT NULL,         -- shown in a tab when the console last ran: reopened at start
    titled INTEGER NOT NULL DEFAULT 1  -- named by a person or by its first exchange (not `chat N`)
);
CREATE TABLE turns (
    session_uid TEXT NOT NULL REFERENCES sessions(uid) ON DELETE CASCADE,
    position INTEGER NOT NULL,
    prompt TEXT NOT NULL,
    reply TEXT NOT NULL,           -- the Reply's fields as JSON
    PRIMARY KEY (session_uid, position)
);
"""
DB_NAME = "conversations.sqlite3"
REPLY_FIELDS = ("rid", "text", "state", "finish_reason", "error", "prompt_tokens", "completion_tokens", "ttft",
                "total", "max_tokens", "queue", "engine_ttft")
MIGRATIONS = {1: "ALTER TABLE sessions ADD COLUMN titled INTEGER NOT NULL DEFAULT 1;"}  # from version N to N + 1
PREVIEW_CHARS = 200  # of the last prompt and reply, for the list's preview


class StoreError(Exception):
    """The conversation database cannot be used; the message says why and what to do."""


def data_dir() -> Path:
    """$MINICHAT_DATA_DIR, else $XDG_DATA_HOME/minichat, else ~/.local/share/minichat."""
    if explicit := os.environ.get("MINICHAT_DATA_DIR"):
        return Path(explicit)
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "minichat"


@dataclass(frozen=True)
class SessionRow:
    """One line of the session list; `last_prompt` and `last_reply` begin its last exchange."""

    uid: str
    name: str
    turns: int
    created: float
    updated: float
    last_prompt: str = ""
    last_reply: str = ""


def _explain(path: Path, e: sqlite3.Error) -> StoreError:
    text = str(e)
    if "locked" in text or "busy" in text:
        why = f"{path} is locked by another program ({text}); close it, or start minichat with another " \
              f"MINICHAT_DATA_DIR"
    elif isinstance(e, sqlite3.DatabaseError) and ("not a database" in text or "malformed" in text):
        why = f"{path} is damaged or not a minichat database ({text}); move it aside and minichat starts a new one"
    else:
        why = f"{path}: {text}"
    return StoreError(f"conversations are not saved: {why}")


class Store:
    """The conversation database at `path` (created with its folder if missing)."""

    def __init__(self, path: Path, timeout: float = 2.0) -> None:
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(path, timeout=timeout, isolation_level=None)
        except (OSError, sqlite3.Error) as e:
            raise StoreError(f"conversations are not saved: cannot open {path} ({e})") from e
        try:
            self.db.execute("PRAGMA foreign_keys = ON")
            self._migrate()
        except sqlite3.Error as e:
            self.db.close()
            raise _explain(path, e) from e

    def _migrate(self) -> None:
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StoreError(f"conversations are not saved: {self.path} was written by a newer minichat "
                             f"(schema {version}, this one reads {SCHEMA_VERSION})")
        if version == 0:
            with self._transaction():
                self.db.executescript(f"BEGIN; {SCHEMA} PRAGMA user_version = {SCHEMA_VERSION};")
            return
        for old in range(version, SCHEMA_VERSION):  # an older minichat's file, brought up to date in place
            with self._transaction():
                self.db.executescript(f"BEGIN; {MIGRATIONS[old]} PRAGMA user_version = {old + 1};")

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        try:
            yield
            if self.db.in_transaction:
                self.db.execute("COMMIT")
        except BaseException:
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            raise

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as e:
            raise _explain(self.path, e) from e

    def close(self) -> None:
        self.db.close()

    # -- writing ------------------------------------------------------------------------------------
    def save(self, session: Session, is_open: bool = True) -> None:
        """Write the session and all its turns, replacing what was stored (`updated` is the session's
        own: when its conversation or settings last changed, not when it was last written)."""
        row = (session.uid, session.name, session.system_prompt, msgspec.json.encode(session.params).decode(),
               session.context_start, session.created, session.updated, int(is_open), int(session.titled))
        turns = [(session.uid, i, turn.prompt, json.dumps({k: asdict(turn.reply)[k] for k in REPLY_FIELDS}))
                 for i, turn in enumerate(session.turns)]
        with self._errors(), self._transaction():
            self.db.execute("BEGIN IMMEDIATE")
            self.db.execute("INSERT OR REPLACE INTO sessions VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
            self.db.execute("DELETE FROM turns WHERE session_uid = ?", (session.uid,))
            self.db.executemany("INSERT INTO turns VALUES (?, ?, ?, ?)", turns)

    def set_open(self, uid: str, is_open: bool) -> None:
        with self._errors():
            self.db.execute("UPDATE sessions SET open = ? WHERE uid = ?", (int(is_open), uid))

    def rename(self, uid: str, name: str) -> None:
        with self._errors():
            self.db.execute("UPDATE sessions SET name = ? WHERE uid = ?", (name, uid))

    def delete(self, uid: str) -> None:
        with self._errors():
            self.db.execute("DELETE FROM sessions WHERE uid = ?", (uid,))

    # -- reading ------------------------------------------------------------------------------------
    def sessions(self, search: str = "") -> list[SessionRow]:
        """Saved sessions, newest first; `search` matches the name or any prompt or reply, any case."""
        pattern = f"%{search.strip()}%"
        last = "FROM turns t WHERE t.session_uid = s.uid ORDER BY t.position DESC LIMIT 1"
        with self._errors():
            rows = self.db.execute(
                "SELECT s.uid, s.name, (SELECT count(*) FROM turns t WHERE t.session_uid = s.uid), s.created, "
                f"s.updated, coalesce((SELECT substr(t.prompt, 1, ?2) {last}), ''), "
                f"coalesce((SELECT substr(json_extract(t.reply, '$.text'), 1, ?2) {last}), '') "
                "FROM sessions s WHERE s.name LIKE ?1 OR EXISTS (SELECT 1 FROM turns t WHERE "
                "t.session_uid = s.uid AND (t.prompt LIKE ?1 OR json_extract(t.reply, '$.text') LIKE ?1)) "
                "ORDER BY s.updated DESC", (pattern, PREVIEW_CHARS)).fetchall()
        return [SessionRow(*row) for row in rows]

    def open_uids(self) -> list[str]:
        """The sessions that were in tabs when the console last ran, oldest first."""
        with self._errors():
            return [uid for (uid,) in self.db.execute("SELECT uid FROM sessions WHERE open ORDER BY created")]

    def load(self, uid: str) -> Session:
        with self._errors():
            row = self.db.execute("SELECT name, system_prompt, params, context_start, created, updated, titled "
                                  "FROM sessions WHERE uid = ?", (uid,)).fetchone()
            if row is None:
                raise StoreError(f"no saved session {uid}")
            turns = self.db.execute("SELECT prompt, reply FROM turns WHERE session_uid = ? ORDER BY position",
                                    (uid,)).fetchall()
        name, system_prompt, params, context_start, created, updated, titled = row
        session = Session(name, system_prompt, msgspec.json.decode(params, type=SamplingParams), uid=uid,
                          created=created, updated=updated, context_start=context_start, titled=bool(titled))
        for prompt, reply_json in turns:
            reply = Reply(**json.loads(reply_json))
            if reply.live:  # the console closed while it streamed
                reply.state, reply.error = "interrupted", "the console closed"
            session.turns.append(Turn(prompt, reply))
        return session
