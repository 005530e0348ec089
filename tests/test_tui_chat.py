"""The console's chat side driven by Textual's pilot against a real engine: a fan-out that reaches the
engine at once and closes as a group, the two first-token times labelled apart, the layout at 80x24,
automatic titles, regenerate, edit-and-resend, copy, and the jump to a tab.

As in tests/test_tui.py every wait is on a condition with a deadline (`wait_for`), never a bare sleep;
requests that must stay alive until aborted use ignore_eos and a large max_tokens. The fan-out's time
to the engine is the engine's own: its stats snapshot's clock when its `submitted` counter has them all.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from pathlib import Path

import pytest
from textual import events
from textual.geometry import Region
from textual.widget import Widget
from textual.widgets import DataTable, Label, Static

from engine.service.client import EngineClient
from engine.service.protocol import Stats
from tests.checkpoints import UNTIL_ABORTED
from tests.test_tui import (
    SIZE,
    box,
    connected_app,
    last_reply,
    long_replies,
    notes,
    run,
    running_rids,
    shown,
    status,
    type_and_send,
    wait_for,
)
from tui.app import MinichatApp
from tui.chat import ChatPane, PhraseLine, PromptInput, ReplyView
from tui.dialogs import AskScreen
from tui.help import HelpScreen
from tui.link import EngineLink
from tui.names import printable
from tui.sessions import SessionsScreen, head
from tui.store import Store
from tui.tablist import TabsScreen

FAN_OUT = 16  # four running (the engine's slots) and twelve waiting


pytestmark = pytest.mark.usefixtures("data_dir")  # conversations in a private directory (conftest.py)


def panes(app: MinichatApp) -> list[ChatPane]:
    return list(app.query(ChatPane))


def names(app: MinichatApp) -> list[str]:
    return [pane.session.name for pane in panes(app)]


def visible_text(widget: Widget) -> str:
    """What the widget draws, line by line."""
    strips = widget.render_lines(Region(0, 0, widget.size.width, widget.size.height))
    return "\n".join("".join(segment.text for segment in strip).rstrip() for strip in strips)


def stats_text(view: ReplyView) -> str:
    return shown(view.query_one(".reply-stats", Static))


async def engine_snapshot(address: str, predicate: Callable[[Stats], bool], timeout: float = 60.0) -> Stats:
    """The first stats snapshot for which `predicate` holds."""
    def watch() -> Stats:
        with EngineClient(address) as client:
            return client.wait_stats(predicate, timeout)

    return await asyncio.to_thread(watch)


async def engine_watch(address: str, condition: Callable[[Stats, Stats], bool],
                       timeout: float = 60.0) -> tuple[Stats, asyncio.Future[Stats]]:
    """Subscribe to the engine's stats in a thread; returns its first snapshot (once it has one, no later
    one is missed) and, to await, the first later one for which `condition(first, later)` holds. In a
    thread because the app's event loop may be busy drawing tabs, and a snapshot read late would be a
    later one, with a later clock than the moment it was waited for."""
    subscribed: concurrent.futures.Future[Stats] = concurrent.futures.Future()

    def watch() -> Stats:
        with EngineClient(address) as client:
            first = client.stats()
            subscribed.set_result(first)
            return client.wait_stats(lambda later: condition(first, later), timeout)

    found = asyncio.ensure_future(asyncio.to_thread(watch))
    return await asyncio.wrap_future(subscribed), found


def test_fan_out_reaches_the_engine_at_once_and_closes_as_a_group(engine: str) -> None:
    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            await connected_app(pilot)
            await long_replies(pilot)
            app.post_message(events.Paste(f"/fanout {FAN_OUT} Once more unto the breach"))
            await wait_for(pilot, lambda: box(app).text.startswith("/fanout"), "the command typed")
            _, watcher = await engine_watch(
                engine, lambda first, s: s.counters.submitted >= first.counters.submitted + FAN_OUT)
            await pilot.press("enter")
            await watcher
            # all at once: every one of them in the engine together (replies that run until aborted cannot have
            # made room for one sent later), four running in the slots and the rest waiting; how fast is the
            # benchmarks' to say, not a timed assertion's (it read 2.85 s once on a loaded CI machine)
            full = await engine_snapshot(engine, lambda s: len(s.running) == 4 and len(s.waiting) == FAN_OUT - 4)
            group = panes(app)[1:]
            assert [p.session.name for p in group] == [f"fan 1.{i}" for i in range(1, FAN_OUT + 1)]
            rids = {p.session.turns[0].reply.rid for p in group}
            assert {r.rid for r in [*full.running, *full.waiting]} == rids
            assert app.current is group[0] and all(p.session.group == "fan 1" for p in group)

            await pilot.press("ctrl+pagedown")  # any tab of the group: one key closes them all
            assert app.current is group[1]
            await pilot.press("ctrl+g")
            await wait_for(pilot, lambda: names(app) == ["chat 1"], "the group's tabs to close")
            await wait_for(pilot, lambda: not rids & running_rids(app), "their requests to stop")
            await engine_snapshot(engine, lambda s: not rids & {r.rid for r in [*s.running, *s.waiting]})
            await pilot.press("ctrl+g")  # an ordinary tab is not a group: nothing closes
            assert names(app) == ["chat 1"] and any("not part of a fan-out" in n for n in notes(app))

    run(scenario)


def test_fan_out_tabs_are_not_reopened_unless_kept(engine: str, data_dir: Path) -> None:
    async def first_run() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            await connected_app(pilot)
            await long_replies(pilot)
            await type_and_send(pilot, "/fanout 3 To be")
            assert names(app) == ["chat 1", "fan 1.1", "fan 1.2", "fan 1.3"]
            kept = app.current
            assert kept is not None and kept.session.name == "fan 1.1"
            await type_and_send(pilot, "/keep")
            assert kept.session.group is None
            await pilot.press("ctrl+pagedown", "ctrl+g")  # closes fan 1.2 and fan 1.3: fan 1.1 left the group
            await wait_for(pilot, lambda: names(app) == ["chat 1", "fan 1.1"], "the rest of the group to close")
            await type_and_send(pilot, "/tab 2")
            assert app.current is kept
            await pilot.press("escape")
            await wait_for(pilot, lambda: kept.session.live is None, "the kept tab's reply to stop")
            await pilot.press("ctrl+q")
            await wait_for(pilot, lambda: not app.is_running, "the app to quit")

    async def second_run() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.current is not None, "the reopened tabs")
            assert names(app) == ["fan 1.1"]  # chat 1 had no turns; fan 1.2 and 1.3 were scratch

    run(first_run)
    run(second_run)
    store = Store(data_dir / "conversations.sqlite3")
    assert [row.name for row in store.sessions()] == ["fan 1.1"]
    store.close()


def test_the_wait_and_the_engine_split_are_labelled_apart(engine: str) -> None:
    """The reply's line shows the person's wait (from Enter to the first token) while it streams and after,
    unchanged, and beside it once it ends the engine's own queue and prefill times (the Final's timings)."""

    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            await connected_app(pilot)
            await long_replies(pilot)
            await type_and_send(pilot, "How long did I wait?")
            reply = last_reply(app)
            view = app.query_one(ReplyView)
            await wait_for(pilot, lambda: "streaming…" in stats_text(view) and reply.ttft is not None,
                           "the streaming reply's numbers")
            assert reply.ttft is not None
            wait = f"first token in {reply.ttft:.2f} s"
            assert wait in stats_text(view) and "engine:" not in stats_text(view)
            await pilot.press("escape")
            await wait_for(pilot, lambda: reply.state == "aborted", "the reply to end")
            assert reply.queue is not None and reply.engine_ttft is not None
            prefill = reply.engine_ttft - reply.queue
            assert 0 <= reply.queue <= reply.engine_ttft <= reply.ttft  # the person waits for the engine and more
            split = f"engine: {reply.queue:.2f} s queued + {prefill:.2f} s prefill"
            await wait_for(pilot, lambda: f"{wait} ({split})" in stats_text(view), "the engine's split")

    run(scenario)


def test_an_80_column_terminal_keeps_the_live_counts_and_whole_phrases(engine: str) -> None:
    """Shrunk from 160x48 to 80x24 while six replies stream: the chat takes the width, the status line
    keeps the running / waiting / slot counts, the settings line wraps only between phrases, and the
    fan-out dialog's question wraps inside its box (at 160 columns too) instead of being cut."""

    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            await connected_app(pilot)
            await pilot.press("ctrl+f")
            await wait_for(pilot, lambda: isinstance(app.screen, AskScreen), "the fan-out dialog")
            dialog_question_is_whole(app)
            await pilot.press("escape")

            await long_replies(pilot)
            await type_and_send(pilot, "/system You are a terse assistant who answers every question in verse.")
            await type_and_send(pilot, "/fanout 6 Once more unto the breach")
            await wait_for(pilot, lambda: "running 4 · waiting 2 · slots 4/4" in status(app), "six requests")
            # a streaming reply fills its tab's context gauge as it goes (it read 0/8192 till the reply ended)
            front = app.current
            assert front is not None
            gauge = front.query_one(".chat-gauge", Static)

            def streamed() -> int:
                text = shown(gauge)
                return int(text.split("≥")[1].split("/")[0]) if "≥" in text else 0

            await wait_for(pilot, lambda: streamed() >= 16, "the gauge to count the streaming reply")
            await pilot.resize_terminal(80, 24)
            await wait_for(pilot, lambda: app.tabs.size.width == 80, "the chat to take the whole width")
            await wait_for(pilot, lambda: app.query_one("#status").size.width == 80, "the 80-column status line")
            await wait_for(pilot, lambda: "running 4 · waiting 2 · slots 4/4" in status(app)[:80],
                           f"the live counts within 80 columns (status: {status(app)!r})")
            assert status(app).startswith(" connected  running 4 · waiting 2 · slots 4/4")

            settings = app.current.query_one(".chat-settings", PhraseLine)  # type: ignore[union-attr]
            await wait_for(pilot, lambda: settings.size.height > 1, "the settings line to wrap")
            lines = visible_text(settings).splitlines()
            assert len(lines) == settings.size.height
            for phrase in (f"max {UNTIL_ABORTED} tok", "ignore EOS"):
                assert any(phrase in line for line in lines), (phrase, lines)  # each phrase on one line
            # a phrase wider than the pane (the console's defaults, named) wraps, whole and in order
            assert "llama.cpp defaults: temp 0.8, top-p 0.95, top-k 40, min-p 0.05" in \
                " ".join(line.strip() for line in lines), lines
            assert all(len(line) <= settings.content_size.width for line in lines)

            await pilot.press("ctrl+f")
            await wait_for(pilot, lambda: isinstance(app.screen, AskScreen), "the fan-out dialog at 80 columns")
            dialog_question_is_whole(app)
            await pilot.press("escape")
            await pilot.press("ctrl+g")
            await wait_for(pilot, lambda: len(panes(app)) == 1, "the fan-out closed")

    run(scenario)


def dialog_question_is_whole(app: MinichatApp) -> None:
    """The dialog's question fits its box, wrapped, to its last word."""
    question = app.screen.query(Label).first()
    box_region = question.parent.content_region  # type: ignore[union-attr]
    assert question.region.right <= box_region.right and question.size.height > 1, (question.region, box_region)
    drawn = " ".join(visible_text(question).split())
    assert drawn.endswith("not saved unless kept"), drawn


def test_titles_regenerate_edit_and_copy(engine: str) -> None:
    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            await connected_app(pilot)
            pane = app.current
            assert pane is not None
            await type_and_send(pilot, "/max_tokens 6")
            await type_and_send(pilot, "To be, or not to be: that is the question")
            first = last_reply(app)
            await wait_for(pilot, lambda: first.state == "done", "the first reply")
            # the first exchange names the tab (a session named by a person keeps its name: test_tui.py)
            await wait_for(pilot, lambda: pane.session.name == "To be, or not to be: that is…", "the title")
            assert "To be, or not to be: that is…" in str(app.tabs.get_tab(app.tabs.active).label)

            await pilot.press("ctrl+r")  # regenerate: the same message, a new reply in place of the old
            await wait_for(pilot, lambda: last_reply(app) is not first and last_reply(app).state == "done",
                           "the regenerated reply")
            assert len(pane.session.turns) == 1 and last_reply(app).rid != first.rid
            assert len(pane.query(".user")) == len(pane.query(ReplyView)) == 1
            assert pane.session.name == "To be, or not to be: that is…"  # titled once

            await type_and_send(pilot, "second thoughts")
            await wait_for(pilot, lambda: last_reply(app).state == "done" and len(pane.session.turns) == 2,
                           "the second reply")
            await pilot.press("up")  # in the empty box: the last message comes back to edit
            assert box(app).text == "second thoughts" and pane.editing == 1
            assert shown(pane.query_one(".chat-pending", Static)).startswith("editing message 2: enter sends it")
            await type_and_send(pilot, ", edited")  # typed at the end of the message
            await wait_for(pilot, lambda: pane.session.turns[-1].prompt == "second thoughts, edited"
                           and last_reply(app).state == "done", "the edited message's reply")
            assert len(pane.session.turns) == 2 and pane.editing is None
            assert [shown(u) for u in pane.query(".user").results(Static)] == [
                "To be, or not to be: that is the question", "second thoughts, edited"]

            await type_and_send(pilot, "/edit 1")  # an earlier message: the turns after it are forgotten
            assert box(app).text == "To be, or not to be: that is the question"
            assert "forgetting the 1 turn after it" in shown(pane.query_one(".chat-pending", Static))
            await pilot.press("escape")  # no reply streams: escape stops editing
            assert pane.editing is None and box(app).text == ""
            await type_and_send(pilot, "/edit 1")
            await type_and_send(pilot, " again")
            question = "To be, or not to be: that is the question again"
            await wait_for(pilot, lambda: [t.prompt for t in pane.session.turns] == [question]
                           and last_reply(app).state == "done", "the conversation resent from its first message")
            assert len(pane.query(ReplyView)) == 1

            await type_and_send(pilot, "/copy")
            assert app.clipboard == last_reply(app).text
            await type_and_send(pilot, "/copy 7")
            assert any(n.startswith("there is no reply 7 to copy") for n in notes(app))

            await pilot.press("ctrl+o")  # the list shows the title and the last exchange
            await wait_for(pilot, lambda: isinstance(app.screen, SessionsScreen), "the conversation list")
            table = app.screen.query_one(DataTable)
            row = [str(cell) for cell in table.get_row_at(0)]
            assert row[0] == "To be, or not to be: that is…"
            assert row[5] == printable(f"{head(question)} → {head(last_reply(app).text)}")

    run(scenario)


def test_tabs_are_listed_and_jumped_to_with_keys_tmux_passes(tmp_path: Path) -> None:
    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=f"ipc://{tmp_path}/nobody.sock", autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("ctrl+n", "ctrl+n")
            assert names(app) == ["chat 1", "chat 2", "chat 3"] and app.current is panes(app)[2]
            await pilot.press("ctrl+t")
            await wait_for(pilot, lambda: isinstance(app.screen, TabsScreen), "the tab list")
            table = app.screen.query_one(DataTable)
            assert [str(table.get_row_at(i)[1]) for i in range(table.row_count)] == names(app)
            await pilot.press("1")
            await wait_for(pilot, lambda: app.current is panes(app)[0], "the first tab")
            assert isinstance(app.focused, PromptInput)
            await type_and_send(pilot, "/tab 3")
            assert app.current is panes(app)[2]
            await pilot.press("ctrl+t", "up", "enter")  # the list starts on the front tab
            await wait_for(pilot, lambda: app.current is panes(app)[1], "the second tab")
            await pilot.press("ctrl+t", "9")
            await wait_for(pilot, lambda: any(n == "there is no tab 9: 3 are open" for n in notes(app)),
                           "the refusal")
            await type_and_send(pilot, "/tab x")
            assert any(n == "/tab takes a number from 1; got 'x'" for n in notes(app))

            await pilot.press("f1")  # every new key and command is in the help
            await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen), "the help screen")
            screen = app.screen
            text = " ".join(" ".join(row) for row in [*screen.keys, *screen.commands])
            for item in ("ctrl+t", "1…9", "ctrl+r", "ctrl+g", "up", "/tab N", "/tabs", "/regen", "/edit N",
                         "/copy N", "/keep", "/closegroup", "OSC 52"):
                assert item in text, item
            await pilot.press("escape")
            titles = {c.title for c in app.get_system_commands(app.screen)}  # the palette's entries
            assert {"Go to tab N", "List open tabs", "Regenerate the last reply", "Edit and resend a message",
                    "Copy a reply", "Keep this fan-out tab", "Close fan-out group"} <= titles

    run(scenario)
