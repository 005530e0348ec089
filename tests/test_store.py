"""The conversation store on a real SQLite file: round trip, search, schema version, and the clear
refusals for a damaged, locked or newer database (the console runs on without saving)."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import msgspec
import pytest

from engine.outputs import Delta, Final, Timings, Usage
from engine.params import SamplingParams
from tui.session import CONSOLE_DEFAULTS, EngineModel, Session
from tui.store import MIGRATIONS, REPLY_FIELDS, SCHEMA_VERSION, Store, StoreError, this_process


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


def test_a_reply_with_a_nul_lists_and_searches_whole(tmp_path: Path) -> None:
    """A small model samples a NUL now and then (the demo model did, in CI): SQLite's json_extract and substr stop
    there, and the list showed the reply cut at it; the list previews and searches the text past it, the NUL as its
    control picture, and the reply itself comes back as it was."""
    store = Store(tmp_path / "conversations.sqlite3")
    odd = conversation("odd", "To be", "to\x00 in\x14 the end")
    store.save(odd)
    (row,) = store.sessions()
    assert row.last_reply == "to\u2400 in\x14 the end"
    assert [r.name for r in store.sessions("the end")] == ["odd"]
    assert store.load(odd.uid).turns[0].reply.text == "to\x00 in\x14 the end"


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
    assert store.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 4
    old = store.load("old")
    assert old.titled and [t.reply.text for t in old.turns] == ["one", "two"]
    fresh = conversation("chat 2", "x" * 500, "y" * 500)
    store.save(fresh)
    assert not store.load(fresh.uid).titled
    rows = {row.name: row for row in store.sessions()}
    assert (rows["chat 1"].last_prompt, rows["chat 1"].last_reply) == ("second", "two")
    assert len(rows["chat 2"].last_prompt) == len(rows["chat 2"].last_reply) == 200  # only the start is read
    store.close()


def test_sessions_keep_the_settings_chosen_and_their_model_and_a_schema_3_file_is_migrated(tmp_path: Path) -> None:
    """Schema 3 stored every sampling field of a session; from 4 a session keeps only those a person chose
    (the rest follow the model of the engine it talks to), and the model its replies came from with that
    model's context, which the list shows."""
    path = tmp_path / "v3.sqlite3"
    with sqlite3.connect(path) as db:
        db.executescript(V1_SCHEMA.replace("PRAGMA user_version = 1;", "") + str(MIGRATIONS[1]) + str(MIGRATIONS[2])
                         + "PRAGMA user_version = 3;")
        old = msgspec.json.encode(SamplingParams(max_tokens=256, temperature=0.3, top_p=0.95, top_k=-1)).decode()
        db.execute("INSERT INTO sessions VALUES ('old', 'old', '', ?, 0, 1.0, 2.0, 0, 1, NULL)", (old,))
    db.close()
    store = Store(path)
    migrated = store.load("old")
    assert migrated.chosen == {"temperature": 0.3} and migrated.model is None  # top_p 0.95 was the console's
    assert migrated.params == msgspec.structs.replace(CONSOLE_DEFAULTS, temperature=0.3)
    migrated.follow(EngineModel("tiny-instruct", 512, {"temperature": 0.2, "top_p": 0.9}))
    assert (migrated.params.temperature, migrated.params.top_p) == (0.3, 0.9)  # chosen over the model's

    session = conversation("with a model", "hi", "hello")
    session.follow(EngineModel("tiny-instruct", 512, {"top_k": 20}))
    session.answered_by_engine()
    store.save(session)
    store.close()
    store = Store(path)
    back = store.load(session.uid)
    assert (back.model, back.context, back.chosen, back.engine) == ("tiny-instruct", 512, {"temperature": 0.3}, None)
    assert back.params.top_k == CONSOLE_DEFAULTS.top_k  # the model's default is not kept: its engine tells it
    assert {row.name: row.model for row in store.sessions()} == {"with a model": "tiny-instruct", "old": None}
    back.follow(EngineModel("llama", 16384))
    assert back.other_model() == ("this conversation was with tiny-instruct (context 512); the engine now runs llama "
                                  "(context 16384), which gives the replies from here on")
    store.close()


def finished(session: Session, prompt: str, answer: str) -> None:
    reply = session.start_turn(prompt).reply
    reply.add(Final(rid=reply.rid, text=answer, token_ids=[2], finish_reason="stop",
                    usage=Usage(prompt_tokens=3, completion_tokens=1, cached_tokens=0),
                    timings=Timings(queue=0.0, ttft=0.1, total=0.2)))


def test_two_consoles_on_one_directory_keep_each_others_turns(tmp_path: Path) -> None:
    """The second console neither reopens nor overwrites a session the first (alive) has open; once the
    first is gone (a writer whose process no longer runs), its sessions pass on."""
    path = tmp_path / "conversations.sqlite3"
    first = Store(path)  # this process: alive
    shared = conversation("shared", "hi", "hello")
    first.save(shared)
    host = this_process().split(":")[0]
    second = Store(path, writer=f"{host}:{os.getpid()}:another console")
    assert second.open_uids() == [] and not second.claim(shared.uid)
    for i in range(10):  # the first keeps writing; the second writes to a copy of its own
        finished(shared, f"a{i}", "ok")
        first.save(shared)
    with pytest.raises(StoreError, match="open in another console"):
        second.save(shared)
    assert len(Store(path).load(shared.uid).turns) == 11
    dead = Store(path, writer=f"{host}:{2**22 + 7}:0")  # a console that crashed with the session open
    dead.db.execute("UPDATE sessions SET writer = ?", (dead.writer,))
    assert second.open_uids() == [shared.uid]  # passed on


def test_damaged_values_are_skipped_and_the_rest_stays_reachable(tmp_path: Path) -> None:
    path = tmp_path / "conversations.sqlite3"
    store = Store(path)
    good, bad = conversation("good", "hi", "hello"), conversation("bad", "hi", "hello")
    finished(bad, "second", "turn")
    store.save(good)
    store.save(bad)
    db = store.db
    db.execute("UPDATE turns SET reply = substr(reply, 2) WHERE session_uid = ? AND position = 0", (bad.uid,))
    db.execute("UPDATE turns SET reply = json_set(reply, '$.from_a_newer_version', 1) WHERE position = 1")
    db.execute("UPDATE sessions SET params = json_set(params, '$.future_knob', 3) WHERE uid = ?", (good.uid,))
    db.execute("UPDATE sessions SET context_start = 'x' WHERE uid = ?", (good.uid,))  # a whole session unreadable
    store.close()

    store = Store(path)
    loaded = store.load(bad.uid)
    assert loaded.turns[0].reply.state == "error" and loaded.turns[1].reply.text == "turn"
    with pytest.raises(StoreError, match="damaged"):
        store.load(good.uid)
    assert good.uid not in store.open_uids()  # never reopened, so never crashes a start again
    assert any("damaged repl" in p for p in store.problems) and any("future_knob" in p for p in store.problems)
    assert [r.name for r in store.sessions()] == ["bad", "good"] or len(store.sessions()) == 2


def test_a_long_session_saves_only_what_changed(tmp_path: Path) -> None:
    store = Store(tmp_path / "conversations.sqlite3")
    long = Session("long")
    for i in range(3000):
        finished(long, f"q{i}", f"a{i}")
    store.save(long)
    before = store.db.total_changes
    reply = long.start_turn("one more").reply
    store.save(long)  # queued
    reply.add(Delta(rid=reply.rid, text="str", token_ids=[1]))
    store.save(long)  # streaming
    assert store.db.total_changes - before <= 3 * 2  # the session row and the one turn, each time
    assert len(Store(tmp_path / "conversations.sqlite3").load(long.uid).turns) == 3001


def test_text_no_encoding_can_carry_is_replaced_visibly_and_later_saves_go_on(tmp_path: Path) -> None:
    """A lone UTF-16 surrogate (which SQLite cannot store) used to fail this save and every later one of the
    session: now it is U+FFFD where it stood, a pair of halves is joined, and the session keeps saving."""
    path = tmp_path / "conversations.sqlite3"
    store = Store(path)
    session = conversation("odd \ud800 name", "lone \udc00 half, a pair \ud83d\ude00", "fine")
    session.system_prompt = "sys \udfff"
    store.save(session)
    session.start_turn("and \ud800 again")
    store.save(session)
    back = Store(path).load(session.uid)
    assert (back.name, back.system_prompt) == ("odd \ufffd name", "sys \ufffd")
    assert [t.prompt for t in back.turns] == ["lone \ufffd half, a pair \U0001f600", "and \ufffd again"]
    assert back.turns[0].reply.text == "fine"
