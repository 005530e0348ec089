"""Conversations kept across restarts, in one SQLite file under the user's data directory.

A save writes the session's row and only the turns that changed since this store last wrote them
(a reply streaming in, a turn edited), in one transaction, so a 3,000-turn conversation costs what its
last turn costs. Each session has one writer: the console that has it open (`writer`, its process).
A second console on the same data directory does not reopen a session another live console holds, and
opening one explicitly gives a copy to write to; a writer that died leaves its sessions to whoever
comes next. A session keeps the sampling settings a person chose (the others follow the model it talks to,
tui/session.py) and the model its replies came from. Reading is lenient: a damaged reply, a setting this
version does not know or a session that cannot be decoded at all is skipped with a sentence, and the rest
of the history stays reachable. The schema version is SQLite's `user_version`, and an older file is migrated
in place; a file from a newer minichat, a file that is not a database or one another program holds locked becomes
a StoreError with a sentence a person can act on, and the console runs on without saving.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from engine.params import SamplingParams
from tui.session import SETTINGS, Reply, Session, Turn, encodable

SCHEMA_VERSION = 4
SCHEMA = """
CREATE TABLE sessions (
    uid TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    system_prompt TEXT NOT NULL,
    params TEXT NOT NULL,          -- the sampling settings a person chose, as JSON (the rest follow the model)
    context_start INTEGER NOT NULL, -- turns before this one are no longer sent (trimmed or /clear)
    created REAL NOT NULL,         -- seconds since the epoch
    updated REAL NOT NULL,
    open INTEGER NOT NULL,         -- shown in a tab when the console last ran: reopened at start
    titled INTEGER NOT NULL DEFAULT 1, -- named by a person or by its first exchange (not `chat N`)
    writer TEXT,                   -- the console that has it open (host:pid:start), else NULL
    model TEXT,                    -- the model its replies came from (its id), and that model's context
    context INTEGER
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
                "total", "max_tokens", "queue", "engine_ttft", "engine_total", "cached_tokens", "reasoning_tokens",
                "draft_tokens", "accepted_tokens")
V3_DEFAULTS = msgspec.structs.asdict(SamplingParams(max_tokens=256, temperature=0.8, top_p=0.95, top_k=-1))
"""The console's settings before sessions followed their model (schema 3 stored every field of them)."""


def _settings_chosen(db: sqlite3.Connection) -> None:
    """Schema 3 -> 4: a session's params were all of them; now only those a person chose, which (as nothing
    recorded the choice) are those that differ from the console's settings of the time."""
    db.execute("ALTER TABLE sessions ADD COLUMN model TEXT")
    db.execute("ALTER TABLE sessions ADD COLUMN context INTEGER")
    for uid, params in db.execute("SELECT uid, params FROM sessions").fetchall():
        try:
            fields = json.loads(params)
        except ValueError:
            continue  # damaged: reading says so, and gives the defaults
        if isinstance(fields, dict):
            chosen = {k: v for k, v in fields.items() if k in SETTINGS and v != V3_DEFAULTS.get(k)}
            db.execute("UPDATE sessions SET params = ? WHERE uid = ?", (json.dumps(chosen), uid))


MIGRATIONS: dict[int, str | Callable[[sqlite3.Connection], None]] = {  # from version N to N + 1
    1: "ALTER TABLE sessions ADD COLUMN titled INTEGER NOT NULL DEFAULT 1;",
    2: "ALTER TABLE sessions ADD COLUMN writer TEXT;",
    3: _settings_chosen,
}
PREVIEW_CHARS = 200  # of the last prompt and reply, for the list's preview



def reply_text(reply: str | None) -> str:
    """A stored reply's text, for the list's SQL: SQLite's json_extract, substr and LIKE stop at a NUL (a small model
    samples one now and then), so a NUL comes back as its control picture, as the list would show it anyway."""
    try:
        text = json.loads(reply or "{}").get("text", "")
    except (ValueError, AttributeError):  # a damaged reply lists as none (`load` says what it skipped)
        return ""
    return text.replace("\0", "\u2400") if isinstance(text, str) else ""


class StoreError(Exception):
    """The conversation database cannot be used; the message says why and what to do."""


def this_process() -> str:
    """This console as a session's writer: host, pid and the pid's start time (a reused pid is not us)."""
    return f"{socket.gethostname()}:{os.getpid()}:{_start_time(os.getpid())}"


def _start_time(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[19]  # field 22, after the command's parentheses
    except (OSError, IndexError):
        return ""


def writer_alive(writer: str) -> bool:
    """Whether the console `writer` still runs (one on another host is taken to, as it cannot be checked)."""
    host, _, rest = writer.partition(":")
    pid, _, started = rest.partition(":")
    if host != socket.gethostname():
        return True
    return pid.isdigit() and _start_time(int(pid)) == started != ""


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
    model: str | None = None


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

    def __init__(self, path: Path, timeout: float = 2.0, writer: str | None = None) -> None:
        self.path = path
        self.writer = writer or this_process()
        self.problems: list[str] = []  # what reading skipped, for the console to say once
        self._stored: dict[str, list[tuple[int, str]]] = {}  # per session: (id of the Reply, its JSON) written
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(path, timeout=timeout, isolation_level=None)
            self.db.create_function("reply_text", 1, reply_text, deterministic=True)
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
                step = MIGRATIONS[old]
                if isinstance(step, str):  # a script runs its own BEGIN (executescript commits what is pending)
                    self.db.executescript(f"BEGIN; {step} PRAGMA user_version = {old + 1};")
                else:
                    self.db.execute("BEGIN")
                    step(self.db)
                    self.db.execute(f"PRAGMA user_version = {old + 1}")

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
        except UnicodeError as e:  # not expected (save cleans its text), but never anything but a StoreError
            raise StoreError(f"conversations are not saved: {e}") from e

    def close(self) -> None:
        self.db.close()

    # -- writing ------------------------------------------------------------------------------------
    def save(self, session: Session, is_open: bool = True) -> None:
        """Write the session's row and the turns that changed since this store wrote them (`updated` is the
        session's own: when its conversation or settings last changed, not when it was last written). An
        open session is this console's to write; a session another live console holds is not written
        (StoreError: the console opened it as a copy, see `claim`)."""
        writer = self.writer if is_open else None
        # text that reached the session another way than the prompt box (which cleans it) is cleaned here too
        row = (session.uid, encodable(session.name), encodable(session.system_prompt), json.dumps(session.chosen),
               session.context_start, session.created, session.updated, int(is_open), int(session.titled), writer,
               session.model, session.context)
        stored = self._stored.get(session.uid, [])
        changed, kept = [], []
        for i, turn in enumerate(session.turns):
            before = stored[i] if i < len(stored) else None
            if before is not None and before[0] == id(turn.reply) and not turn.reply.live and before[1]:
                kept.append(before)  # a finished reply this store already wrote: unchanged
                continue
            text = json.dumps({k: getattr(turn.reply, k) for k in REPLY_FIELDS})
            kept.append((id(turn.reply), "" if turn.reply.live else text))
            if before is None or before[1] != text:
                changed.append((session.uid, i, encodable(turn.prompt), text))
        with self._errors(), self._transaction():
            self.db.execute("BEGIN IMMEDIATE")
            holder = self.db.execute("SELECT writer FROM sessions WHERE uid = ?", (session.uid,)).fetchone()
            if holder is not None and holder[0] not in (None, self.writer) and writer_alive(holder[0]):
                raise StoreError(f"conversation {session.name!r} is open in another console ({holder[0]}); "
                                 "not saved over it")
            # an upsert, not INSERT OR REPLACE: replacing the row would cascade to every stored turn
            self.db.execute("INSERT INTO sessions VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(uid) DO "
                            "UPDATE SET name = excluded.name, system_prompt = excluded.system_prompt, params = "
                            "excluded.params, context_start = excluded.context_start, updated = excluded.updated, "
                            "open = excluded.open, titled = excluded.titled, writer = excluded.writer, "
                            "model = excluded.model, context = excluded.context", row)
            if session.uid not in self._stored:  # first write from this store: whatever was there is replaced
                self.db.execute("DELETE FROM turns WHERE session_uid = ?", (session.uid,))
            else:
                self.db.execute("DELETE FROM turns WHERE session_uid = ? AND position >= ?",
                                (session.uid, len(session.turns)))
            self.db.executemany("INSERT OR REPLACE INTO turns VALUES (?, ?, ?, ?)", changed)
        self._stored[session.uid] = kept

    def claim(self, uid: str) -> bool:
        """Make this console the session's writer, unless another live console is; False then."""
        with self._errors(), self._transaction():
            self.db.execute("BEGIN IMMEDIATE")
            holder = self.db.execute("SELECT writer FROM sessions WHERE uid = ?", (uid,)).fetchone()
            if holder is not None and holder[0] not in (None, self.writer) and writer_alive(holder[0]):
                return False
            self.db.execute("UPDATE sessions SET writer = ? WHERE uid = ?", (self.writer, uid))
        return True

    def set_open(self, uid: str, is_open: bool) -> None:
        with self._errors():
            self.db.execute("UPDATE sessions SET open = ?, writer = CASE WHEN ? THEN writer END WHERE uid = ? AND "
                            "(writer IS NULL OR writer = ?)", (int(is_open), int(is_open), uid, self.writer))

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
                f"coalesce((SELECT substr(reply_text(t.reply), 1, ?2) {last}), ''), s.model "
                "FROM sessions s WHERE s.name LIKE ?1 OR EXISTS (SELECT 1 FROM turns t WHERE "
                "t.session_uid = s.uid AND (t.prompt LIKE ?1 OR reply_text(t.reply) LIKE ?1)) "
                "ORDER BY s.updated DESC", (pattern, PREVIEW_CHARS)).fetchall()
        return [SessionRow(*row) for row in rows]

    def open_uids(self) -> list[str]:
        """The sessions that were in tabs when the console last ran, oldest first, that this console now
        holds (one another live console has open stays with it)."""
        with self._errors():
            uids = [uid for (uid,) in self.db.execute("SELECT uid FROM sessions WHERE open ORDER BY created")]
        return [uid for uid in uids if self.claim(uid)]

    def load(self, uid: str) -> Session:
        """A saved session. What cannot be decoded is skipped and said in `problems`: a damaged reply
        becomes an error reply, unknown or invalid params fall back to the defaults; a session whose own
        row cannot be read is a StoreError (and is no longer reopened at start)."""
        with self._errors():
            row = self.db.execute("SELECT name, system_prompt, params, context_start, created, updated, titled, "
                                  "model, context FROM sessions WHERE uid = ?", (uid,)).fetchone()
            if row is None:
                raise StoreError(f"no saved session {uid}")
            turns = self.db.execute("SELECT prompt, reply FROM turns WHERE session_uid = ? ORDER BY position",
                                    (uid,)).fetchall()
        name, system_prompt, params, context_start, created, updated, titled, model, context = row
        try:
            session = Session(str(name), str(system_prompt), self._chosen(str(name), params), uid=uid,
                              created=float(created), updated=float(updated), context_start=int(context_start),
                              titled=bool(titled), model=None if model is None else str(model),
                              context=None if context is None else int(context))
        except (TypeError, ValueError) as e:
            self.set_open(uid, False)
            raise StoreError(f"conversation {uid} is damaged ({e}) and was skipped") from None
        damaged = 0
        for prompt, reply_json in turns:
            try:
                fields = json.loads(reply_json)
                reply = Reply(**{k: v for k, v in fields.items() if k in REPLY_FIELDS})
            except (TypeError, ValueError, AttributeError):
                damaged += 1
                reply = Reply(rid="", state="error", error="this reply was damaged in the store")
            if reply.live:  # the console closed while it streamed
                reply.state, reply.error = "interrupted", "the console closed"
            session.turns.append(Turn(str(prompt), reply))
        if damaged:
            self.problems.append(f"{name}: {damaged} damaged repl{'ies' if damaged > 1 else 'y'} skipped")
        return session

    def _chosen(self, name: str, text: str) -> dict[str, Any]:
        """The settings a person chose, leniently: names this version does not know are dropped, and values it
        refuses (or text that is not JSON) are forgotten, said in `problems`."""
        try:
            fields = json.loads(text)
            if not isinstance(fields, dict):
                raise ValueError(f"not an object: {text[:40]!r}")
        except ValueError as e:
            self.problems.append(f"{name}: damaged settings replaced by the defaults ({e})")
            return {}
        unknown = sorted(set(fields) - set(SETTINGS))
        if unknown:
            self.problems.append(f"{name}: settings this version does not know were dropped ({', '.join(unknown)})")
        chosen = {}
        for key, value in fields.items():
            if key in SETTINGS:
                try:
                    SamplingParams(**{key: value})
                except (TypeError, ValueError) as e:
                    self.problems.append(f"{name}: its {key} was damaged and is back to the default ({e})")
                    continue
                chosen[key] = value
        return chosen
