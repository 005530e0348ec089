"""The conversation store on a real SQLite file: round trip, search, schema version, and the clear
refusals for a damaged, locked or newer database (the console runs on without saving)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from engine.outputs import Delta, Final, Timings, Usage
from tui.session import Session
from tui.store import REPLY_FIELDS, SCHEMA_VERSION, Store, StoreError


def conversation(name: str, prompt: str, answer: str) -> Session:
    session = Session(name, system_prompt="Be brief.")
    session.set("temperature", "0.3")
    reply = session.start_turn(prompt).reply
    reply.add(Delta(rid=reply.rid, text=answer[:3], token_ids=[1]))
    reply.add(Final(rid=reply.rid, text=answer[3:], token_ids=[2], finish_reason="stop",
                    usage=Usage(prompt_tokens=7, completion_tokens=2, cached_tokens=0),
                    timings=Timings(queue=0.0, ttft=0.1, total=0.2)))
    return session


def test_sessions_round_trip_and_search(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "conversations.sqlite3"
    store = Store(path)
    poems, chat = conversation("poems", "a sonnet please", "Shall I compare"), conversation("chat", "hi", "hello")
    chat.updated += 10
    live = chat.start_turn("still going")  # saved while it streams: comes back interrupted
    store.save(poems)
    store.save(chat, is_open=False)
    store.close()

    store = Store(path)
    assert store.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert [r.name for r in store.sessions()] == ["chat", "poems"]  # newest first
    assert [(r.name, r.turns) for r in store.sessions("COMPARE")] == [("poems", 1)]  # replies, any case
    assert [r.name for r in store.sessions("sonnet")] == ["poems"] and store.sessions("state") == []
    assert store.open_uids() == [poems.uid]
    back = store.load(poems.uid)
    assert (back.name, back.system_prompt, back.params, back.created) == ("poems", "Be brief.", poems.params,
                                                                          poems.created)
    saved, loaded = poems.turns[0].reply, back.turns[0].reply
    assert back.turns[0].prompt == "a sonnet please"
    assert [getattr(loaded, f) for f in REPLY_FIELDS] == [getattr(saved, f) for f in REPLY_FIELDS]
    assert loaded.text == "Shall I compare" and loaded.summary() == saved.summary()
    again = store.load(chat.uid)
    assert again.turns[-1].reply.state == "interrupted" and again.turns[-1].reply.rid == live.reply.rid
    store.delete(chat.uid)
    assert [r.name for r in store.sessions()] == ["poems"]


def test_a_damaged_locked_or_newer_database_is_refused_clearly(tmp_path: Path) -> None:
    damaged = tmp_path / "damaged.sqlite3"
    damaged.write_bytes(b"not sqlite at all " * 64)
    with pytest.raises(StoreError, match=r"damaged or not a minichat database.*move it aside"):
        Store(damaged)

    newer = tmp_path / "newer.sqlite3"
    with sqlite3.connect(newer) as db:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(StoreError, match="written by a newer minichat"):
        Store(newer)

    locked = tmp_path / "locked.sqlite3"
    Store(locked).close()
    holder = sqlite3.connect(locked, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StoreError, match="is locked by another program"):
            Store(locked, timeout=0.1)
    finally:
        holder.execute("ROLLBACK")
        holder.close()


V1_SCHEMA = """
CREATE TABLE sessions (uid TEXT PRIMARY KEY, name TEXT NOT NULL, system_prompt TEXT NOT NULL, params TEXT NOT NULL,
                       context_start INTEGER NOT NULL, created REAL NOT NULL, updated REAL NOT NULL,
                       open INTEGER NOT NULL);
CREATE TABLE turns (session_uid TEXT NOT NULL REFERENCES sessions(uid) ON DELETE CASCADE, position INTEGER NOT NULL,
                    prompt TEXT NOT NULL, reply TEXT NOT NULL, PRIMARY KEY (session_uid, position));
PRAGMA user_version = 1;
"""


def test_an_older_file_is_migrated_and_the_list_previews_the_last_exchange(tmp_path: Path) -> None:
    """A file written before titles (schema 1) opens, its sessions count as titled (never renamed by the
    console), and the list carries each session's last prompt and reply; a new session keeps `titled`."""
    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as db:
        db.executescript(V1_SCHEMA)
        db.execute("INSERT INTO sessions VALUES ('old', 'chat 1', '', '{}', 0, 1.0, 2.0, 1)")
        db.execute("INSERT INTO turns VALUES ('old', 0, 'first', ?)", ('{"rid": "r0", "text": "one"}',))
        db.execute("INSERT INTO turns VALUES ('old', 1, 'second', ?)", ('{"rid": "r1", "text": "two"}',))
    db.close()
    store = Store(path)
    assert store.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 2
    old = store.load("old")
    assert old.titled and [t.reply.text for t in old.turns] == ["one", "two"]
    fresh = conversation("chat 2", "x" * 500, "y" * 500)
    store.save(fresh)
    assert not store.load(fresh.uid).titled
    rows = {row.name: row for row in store.sessions()}
    assert (rows["chat 1"].last_prompt, rows["chat 1"].last_reply) == ("second", "two")
    assert len(rows["chat 2"].last_prompt) == len(rows["chat 2"].last_reply) == 200  # only the start is read
    store.close()
