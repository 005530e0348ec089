"""The Textual app driven by its pilot against a real engine process with a tiny checkpoint.

Every wait is on a condition with a deadline (`wait_for`), never a bare sleep. Requests that must
stay alive until aborted use ignore_eos and a large max_tokens. Conversations are saved in a
temporary data directory per test (MINICHAT_DATA_DIR).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import traceback
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
from textual import events
from textual.command import CommandPalette
from textual.pilot import Pilot
from textual.screen import Screen
from textual.timer import Timer
from textual.widget import Widget
from textual.widgets import DataTable, Input, Label, Markdown, Static

from engine.outputs import Delta, Final, Timings, Usage
from engine.service.client import AsyncEngineClient
from engine.service.launcher import EngineHandle, start
from engine.service.protocol import Stats
from tests.checkpoints import UNTIL_ABORTED
from tui.app import MinichatApp
from tui.chat import ChatPane, PromptInput, ReplyView
from tui.commands import COMMANDS
from tui.dialogs import AskScreen, ConfirmScreen
from tui.help import HelpScreen
from tui.link import EngineLink
from tui.names import printable
from tui.panels import OpsPanels, RequestTable
from tui.panels.throughput import HISTORY, ThroughputPanel
from tui.session import Reply, Session, Turn
from tui.sessions import SessionsScreen
from tui.store import Store

SIZE = (160, 48)  # wide enough that the ops panels open beside the chat
ENGINE_OPTIONS = {"max_running_requests": 4, "max_prefill_tokens": 256}


def start_engine(model: Path, address: str, **options: object) -> EngineHandle:
    return start(address, model=str(model), timeout=120, **{**ENGINE_OPTIONS, **options})


pytestmark = pytest.mark.usefixtures("data_dir")  # conversations in a private directory (conftest.py)


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())


async def wait_for(pilot: Pilot, predicate: Callable[[], object], what: str, timeout: float = 60.0) -> None:
    """Let the app run until `predicate()` holds; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await pilot.pause(0.05)


def running_rids(app: MinichatApp) -> set[str]:
    return {r.rid for r in app.last_stats.running} if app.last_stats is not None else set()


def table_rids(app: MinichatApp, table_id: str) -> set[str]:
    return {key.value for key in app.query_one(f"#{table_id}", RequestTable).rows}


def status(app: MinichatApp) -> str:
    return str(app.query_one("#status", Static).render())


async def connected_app(pilot: Pilot) -> MinichatApp:
    app = pilot.app
    assert isinstance(app, MinichatApp)
    await wait_for(pilot, lambda: app.link.state.kind == "connected" and app.last_stats is not None, "connection")
    return app


async def type_and_send(pilot: Pilot, text: str) -> None:
    """Paste `text` into the focused prompt box (faster than a key per character) and press Enter."""
    assert isinstance(pilot.app.focused, PromptInput)
    pilot.app.post_message(events.Paste(text))
    await pilot.pause()
    await pilot.press("enter")


async def long_replies(pilot: Pilot) -> None:
    """Make the current session's replies run until aborted."""
    await type_and_send(pilot, "/ignore_eos on")
    await type_and_send(pilot, f"/max_tokens {UNTIL_ABORTED}")


def last_reply(app: MinichatApp) -> Reply:
    assert app.current is not None
    return app.current.session.turns[-1].reply


async def streaming_reply(pilot: Pilot, text: str) -> Reply:
    """Send `text` in a session whose replies run until aborted; return the reply once it streams."""
    await long_replies(pilot)
    await type_and_send(pilot, text)
    reply = last_reply(pilot.app)
    await wait_for(pilot, lambda: reply.text, "a streaming reply")
    return reply


def test_send_message_streams_a_markdown_reply(engine: str) -> None:
    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            await connected_app(pilot)
            # what the model is (family; experts and window where it has them) and its weights; its name apart,
            # so that a narrow status line keeps it
            assert app.link.state.model == "llama", app.link.state
            assert app.link.state.detail.startswith("Llama · float32, "), app.link.state.detail
            await type_and_send(pilot, "/max_tokens 12")
            await type_and_send(pilot, "/ignore_eos on")
            # a pasted multi-line prompt keeps its lines; ctrl+j adds one; Enter sends
            app.post_message(events.Paste("To be,\nor not"))
            await pilot.pause()
            await pilot.press("ctrl+j", "t", "o", " ", "b", "e", "enter")
            assert app.current.session.turns[0].prompt == "To be,\nor not\nto be"  # type: ignore[union-attr]
            reply = last_reply(app)
            view = app.query_one(ReplyView)
            await wait_for(pilot, lambda: reply.text and view.query_one(Markdown).source, "streamed text")
            await wait_for(pilot, lambda: reply.state == "done", "the reply to finish")
            assert reply.completion_tokens == 12 and reply.prompt_tokens and reply.ttft is not None
            assert "12 tok" in str(view.query_one(".reply-stats", Static).render())
            # the next turn sends the history: the engine sees a longer prompt
            await type_and_send(pilot, "again")
            second = last_reply(app)
            await wait_for(pilot, lambda: second.state == "done", "the second reply")
            assert second.prompt_tokens > reply.prompt_tokens + reply.completion_tokens  # type: ignore[operator]

    run(scenario)


def test_fan_out_sessions_appear_in_the_running_set(engine: str) -> None:
    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            await connected_app(pilot)
            await long_replies(pilot)
            await type_and_send(pilot, "/fanout 3 Once more unto the breach | To be")
            panes = list(app.query(ChatPane))[1:]
            assert len(panes) == 3
            rids = {pane.session.turns[0].reply.rid for pane in panes}
            await wait_for(pilot, lambda: rids <= running_rids(app) and rids <= table_rids(app, "running"),
                           "all three requests in the running set")
            assert [p.session.turns[0].prompt for p in panes] == ["Once more unto the breach", "To be",
                                                                  "Once more unto the breach"]
            assert all(p.session.params.ignore_eos for p in panes)  # settings follow the session fanned out
            # closing a session (after confirming) aborts its request
            closed = app.current
            assert closed is panes[0], (app.tabs.active, [p.parent.id for p in panes], app.focused)
            await pilot.press("ctrl+w")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the confirmation")
            await pilot.press("y")
            gone = closed.session.turns[0].reply.rid
            await wait_for(pilot, lambda: gone not in running_rids(app), "the closed session's request to go")
            assert len(app.query(ChatPane)) == 3
            for pane in panes[1:]:
                await pane.abort()
            await wait_for(pilot, lambda: not rids & running_rids(app), "the aborts")

    run(scenario)


def test_escape_aborts_the_focused_session(engine: str) -> None:
    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            await connected_app(pilot)
            await long_replies(pilot)
            await type_and_send(pilot, "Pages of sixteen tokens")
            reply = last_reply(app)
            await wait_for(pilot, lambda: reply.text and reply.rid in running_rids(app), "a streaming reply")
            await pilot.press("escape")
            await wait_for(pilot, lambda: reply.state == "aborted", "the reply marked aborted")
            view = app.query_one(ReplyView)
            assert view.has_class("-aborted") and "aborted" in str(view.query_one(".reply-stats", Static).render())
            assert reply.text and reply.finish_reason == "abort"
            await wait_for(pilot, lambda: reply.rid not in running_rids(app) | table_rids(app, "running"),
                           "the request gone from the running set")
            assert app.current is not None and app.current.session.live is None

    run(scenario)


def test_abort_another_clients_request_from_the_ops_panel(engine: str) -> None:
    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=SIZE) as pilot, AsyncEngineClient(engine) as other:
            await connected_app(pilot)
            stream = other.generate("benchmark load", max_tokens=UNTIL_ABORTED, ignore_eos=True, rid="bench-load-1")
            first = asyncio.ensure_future(anext(stream))
            await wait_for(pilot, lambda: "bench-load-1" in table_rids(app, "running"), "the other client's request")
            await first
            table = app.query_one("#running", RequestTable)
            table.focus()
            table.move_cursor(row=table.get_row_index("bench-load-1"))
            await pilot.press("x")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the confirmation")
            await pilot.press("y")
            rest = [out async for out in stream]
            assert rest[-1].finish_reason == "abort"  # type: ignore[union-attr]
            await wait_for(pilot, lambda: "bench-load-1" not in running_rids(app) | table_rids(app, "running"),
                           "the request gone from the running set")

    run(scenario)


def test_unreachable_engine_is_a_state_not_a_crash(tmp_path: Path) -> None:
    async def scenario() -> None:
        address = f"ipc://{tmp_path}/nobody.sock"
        app = MinichatApp(EngineLink(address=address, autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.link.state.kind == "lost", "the lost state")
            assert "no engine answers" in status(app)
            await type_and_send(pilot, "anyone there?")
            reply = last_reply(app)
            assert reply.state == "queued"
            await wait_for(pilot, lambda: "waiting for engine" in str(app.query_one(".reply-stats", Static).render()),
                           "the queued reply")
            await pilot.press("escape")  # stopping a reply that never reached an engine works too
            await wait_for(pilot, lambda: reply.state == "aborted", "the local abort")

    run(scenario)


def test_f4_without_a_fleet_says_how_to_get_one(tmp_path: Path) -> None:
    """f4 did nothing and said nothing without --engines."""
    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=f"ipc://{tmp_path}/nobody.sock", autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("f4")
            await wait_for(pilot, lambda: any("start the console with --engines" in m for m in notes(app)),
                           "the note on f4")

    run(scenario)


def test_engine_death_keeps_the_conversation_and_reconnects(long_ckpt: Path, tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/dies.sock"
    handle = start_engine(long_ckpt, address)

    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=address, autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            await connected_app(pilot)
            reply = await streaming_reply(pilot, "The quick brown fox")
            os.kill(handle.pid, signal.SIGKILL)
            await wait_for(pilot, lambda: app.link.state.kind == "lost", "the lost state")
            await wait_for(pilot, lambda: reply.state == "interrupted", "the reply marked interrupted")
            assert reply.text and "lost" in status(app)
            restarted = await asyncio.to_thread(start_engine, long_ckpt, address)
            try:
                await connected_app(pilot)
                await type_and_send(pilot, "/max_tokens 4")
                await type_and_send(pilot, "still there?")
                await wait_for(pilot, lambda: last_reply(app).state == "done", "a reply from the new engine")
                assert len(app.current.session.turns) == 2  # type: ignore[union-attr]
            finally:
                restarted.stop()

    try:
        run(scenario)
    finally:
        handle.stop()


def test_a_fast_stream_renders_a_frame_at_a_time(tmp_path: Path) -> None:
    """Thousands of deltas, one per loop turn (a fast engine): the view appends to its Markdown a few
    times per FRAME, not per token, shows exactly the text that arrived, and ends in the final state.
    A view in a hidden tab renders nothing until it finishes."""

    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=f"ipc://{tmp_path}/nobody.sock", autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            hidden_pane = app.current
            await pilot.press("ctrl+n")
            await wait_for(pilot, lambda: not hidden_pane.parent.display, "the first tab hidden")  # type: ignore[union-attr]
            shown, hidden = Reply(rid="shown"), Reply(rid="hidden")
            views = [ReplyView(shown), ReplyView(hidden)]
            for pane, view in zip([app.current, hidden_pane], views, strict=True):
                await pane.query_one(".chat-log").mount(view)  # type: ignore[union-attr]
            appends = {id(view): 0 for view in views}
            for view in views:
                markdown = view.query_one(Markdown)

                def counted(text: str, markdown: Markdown = markdown, key: int = id(view)) -> Any:
                    appends[key] += 1
                    return Markdown.append(markdown, text)

                markdown.append = counted  # type: ignore[method-assign]
                view.start_streaming()
            began, deadline, n = time.monotonic(), time.monotonic() + 60, 0
            while appends[id(views[0])] < 3:  # a delta per loop turn until the view has rendered three frames
                assert time.monotonic() < deadline, "timed out waiting for three frames"
                for reply in (shown, hidden):
                    reply.add(Delta(rid=reply.rid, text=f"w{n} \x07", token_ids=[n]))
                n += 1
                await asyncio.sleep(0)
            elapsed = time.monotonic() - began
            assert appends[id(views[0])] <= elapsed / ReplyView.FRAME + 1 < n, (appends, elapsed, n)
            assert appends[id(views[1])] == 0
            timings = Timings(queue=0.0, ttft=0.01, total=elapsed)
            usage = Usage(prompt_tokens=3, completion_tokens=n + 1, cached_tokens=0)
            for view in views:
                view.reply.add(Final(rid=view.reply.rid, text="end", token_ids=[1], finish_reason="length",
                                     usage=usage, timings=timings))
                await view.finish_streaming()
                assert view.query_one(Markdown).source == printable(view.reply.text)
                assert view.reply.text.endswith(f"w{n - 1} \x07end") and view.has_class("-done")
                assert f"{n + 1} tok" in str(view.query_one(".reply-stats", Static).render())
            assert appends[id(views[1])] == 1

    run(scenario)


def test_keys_and_commands_manage_sessions_and_panels(tmp_path: Path) -> None:
    """Everything that needs no engine: sessions, dialogs, panel layout, help, palette."""

    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=f"ipc://{tmp_path}/nobody.sock", autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("ctrl+n")
            assert len(app.query(ChatPane)) == 2 and app.current.session.name == "chat 2"  # type: ignore[union-attr]
            await pilot.press("f2")
            await wait_for(pilot, lambda: isinstance(app.screen, AskScreen), "the rename dialog")
            app.screen.query_one(Input).value = "poems"
            await pilot.press("enter")
            await wait_for(pilot, lambda: app.current.session.name == "poems", "the rename")  # type: ignore[union-attr]
            assert "poems" in str(app.tabs.get_tab(app.tabs.active).label)
            await type_and_send(pilot, "/temperature 0.3")
            await type_and_send(pilot, "/system Answer in verse.")
            session = app.current.session  # type: ignore[union-attr]
            assert session.params.temperature == 0.3 and session.system_prompt == "Answer in verse."
            assert session.messages("hi")[0] == {"role": "system", "content": "Answer in verse."}
            await type_and_send(pilot, "/top_p 7")  # out of range: refused, setting unchanged
            assert session.params.top_p == 0.95
            await pilot.press("ctrl+pageup")
            assert app.current.session.name == "chat 1"  # type: ignore[union-attr]
            await pilot.press("ctrl+w")  # an empty session closes without asking
            await wait_for(pilot, lambda: len(app.query(ChatPane)) == 1, "the close")
            assert app.current.session.name == "poems"  # type: ignore[union-attr]

            assert app.ops.display  # wide terminal: open beside the chat
            await pilot.press("f6")  # the panels' digit keys work where focus is in the panels
            assert isinstance(app.focused, RequestTable)
            await pilot.press("2")
            assert not app.query_one("#running").display
            await pilot.press("2", "f8")
            assert app.query_one("#running").display and app.ops_width == 60
            await pilot.press("1", "2")  # both tables hidden: focus stays in the panels, digits still work
            assert app.focused is app.ops and not app.query_one("#waiting").display
            await pilot.press("1", "2", "f6")
            assert isinstance(app.focused, PromptInput)
            await pilot.press("f5")
            assert not app.ops.display and isinstance(app.focused, PromptInput)
            await pilot.press("f5", "f6")
            assert isinstance(app.focused, RequestTable)

            await pilot.press("f1")
            await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen), "the help screen")
            screen = app.screen
            help_text = " ".join(" ".join(row) for row in [*screen.keys, *screen.commands])
            for key in ("ctrl+n", "ctrl+w", "f2", "ctrl+f", "escape", "f5", "ctrl+j", "ctrl+p", "ctrl+q", "ctrl+o",
                        "pageup", "pagedown", "ctrl+home", "ctrl+end", "ctrl+pageup", "x / delete", "/fanout",
                        "/clear"):
                assert key in help_text, key
            keys = [row[0] for row in screen.keys]
            assert not [k for k in keys if "alt+" in k or "shift+enter" in k], keys  # tmux mangles these
            await pilot.press("escape")
            await pilot.press("ctrl+p")
            await wait_for(pilot, lambda: isinstance(app.screen, CommandPalette), "the command palette")

    run(scenario)


def test_every_command_has_an_app_handler(tmp_path: Path) -> None:
    """The table is data and the app maps its names to handlers: a command left out would only show when it is
    run, and a handler whose command is gone would never run."""
    link = EngineLink(address=f"ipc://{tmp_path}/nobody.sock", autostart=False)
    handlers = MinichatApp(link, tmp_path / "chats.sqlite3").command_handlers(ChatPane(Session("s"), link))
    assert set(handlers) == {c.name for c in COMMANDS}


# -- issue 12: keys in order, context, queued messages, ops selection, scrolling, quitting, saving ------

def burst(app: MinichatApp, *keys: str) -> None:
    """Keys arriving all at once, as from a fast typist, a macro or tmux send-keys: no pause in between
    (pilot.press waits for the app to be idle after each key, which hides ordering bugs)."""
    for key in keys:
        app.post_message(events.Key(key, key if len(key) == 1 else None))


def box(app: MinichatApp) -> PromptInput:
    assert app.current is not None
    return app.current.query_one(PromptInput)


def shown(widget: Static) -> str:
    return str(widget.render())


def cell(table: DataTable, rid: str, column: str) -> str:
    """The text of request `rid`'s cell in the column labelled `column`."""
    key = next(c.key for c in table.ordered_columns if c.label.plain == column)
    return str(table.get_cell(rid, key))


def test_keys_apply_in_the_order_typed(engine: str) -> None:
    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            await connected_app(pilot)
            await type_and_send(pilot, "/max_tokens 2")
            burst(app, *"hello there friend", "enter")
            await wait_for(pilot, lambda: app.current.session.turns, "the message")  # type: ignore[union-attr]
            await wait_for(pilot, lambda: last_reply(app).state == "done", "the reply")
            assert [t.prompt for t in app.current.session.turns] == ["hello there friend"]  # type: ignore[union-attr]
            assert box(app).text == ""
            burst(app, "a", "b", "c", "ctrl+j", "d", "backspace", "e", "enter")
            await wait_for(pilot, lambda: len(app.current.session.turns) == 2, "the second message")  # type: ignore[union-attr]
            assert app.current.session.turns[1].prompt == "abc\ne" and box(app).text == ""  # type: ignore[union-attr]
            await wait_for(pilot, lambda: last_reply(app).state == "done", "the second reply")
            await pilot.press("f2")  # the rename dialog: its text starts selected, and typing replaces it
            await wait_for(pilot, lambda: isinstance(app.screen, AskScreen), "the rename dialog")
            burst(app, *"poemx", "backspace", "s", "enter")
            await wait_for(pilot, lambda: app.current.session.name == "poems", "the rename")  # type: ignore[union-attr]

            # typing while eight replies stream (the engine's four slots busy, four waiting for one): the
            # frames the replies render never reorder or drop a key
            await long_replies(pilot)
            await type_and_send(pilot, "/fanout 8 Once more unto the breach")
            panes = list(app.query(ChatPane))[1:]
            front = app.current
            assert front is not None and len(panes) == 8 and front is panes[0]
            await wait_for(pilot, lambda: app.focused is box(app), "the front tab's prompt box focused")
            view = front.query_one(ReplyView)
            await wait_for(pilot, lambda: len(running_rids(app)) == 4 and view.query_one(Markdown).source,
                           "four replies streaming, the front one on screen")
            shown_before = len(view.query_one(Markdown).source)
            typed = [*"the quick brown fox", "ctrl+j", *"jumps overr", "backspace", *" the lazy dog " * 3]
            burst(app, *typed)
            expected = "the quick brown fox\njumps over" + " the lazy dog " * 3
            await wait_for(pilot, lambda: len(box(app).text) >= len(expected), "the typed text")
            assert box(app).text == expected
            assert all(p.session.live is not None for p in panes)  # typed while all eight were in flight
            await wait_for(pilot, lambda: len(view.query_one(Markdown).source) > shown_before,
                           "the front reply rendering on")
            burst(app, "enter")  # the reply still streams: the message waits its turn, whole
            await wait_for(pilot, lambda: front.pending, "the queued message")
            assert front.pending == [expected] and box(app).text == ""
            front.pending.clear()
            for pane in panes:
                await pane.abort()
            await wait_for(pilot, lambda: all(p.session.live is None for p in panes), "the aborts")

    run(scenario)


def test_keys_apply_in_the_order_typed_in_the_command_palette(tmp_path: Path) -> None:
    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=f"ipc://{tmp_path}/nobody.sock", autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("ctrl+p")
            await wait_for(pilot, lambda: isinstance(app.focused, Input) and CommandPalette.is_open(app), "the palette")
            search = app.focused
            assert isinstance(search, Input)
            burst(app, *"abc", "ctrl+u", *"theme")
            await wait_for(pilot, lambda: search.value.endswith("heme"), f"the search text (now {search.value!r})")
            assert search.value == "theme"

    run(scenario)


def test_a_message_sent_while_a_reply_streams_waits_its_turn(engine: str) -> None:
    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            await connected_app(pilot)
            first = await streaming_reply(pilot, "first")
            await type_and_send(pilot, "second, typed meanwhile")
            pane = app.current
            assert pane is not None and box(app).text == "" and len(pane.session.turns) == 1
            pending = pane.query_one(".chat-pending", Static)
            assert pending.display and shown(pending).endswith(": second, typed meanwhile")
            await pilot.press("escape")
            await wait_for(pilot, lambda: len(pane.session.turns) == 2, "the queued message to go out")
            assert first.state == "aborted" and pane.session.turns[1].prompt == "second, typed meanwhile"
            assert not pending.display
            await pane.abort()
            await wait_for(pilot, lambda: pane.session.live is None, "the second reply to stop")

    run(scenario)


def test_abort_in_the_ops_panel_follows_the_selected_request(engine: str) -> None:
    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=SIZE) as pilot, AsyncEngineClient(engine) as other:
            await connected_app(pilot)
            rids = ["load-a", "load-b", "load-c", "load-d", "load-e"]  # four slots: load-e waits for one
            streams = [other.generate("benchmark load", max_tokens=UNTIL_ABORTED, ignore_eos=True, rid=rid)
                       for rid in rids]
            firsts = [asyncio.ensure_future(anext(stream)) for stream in streams]  # submits each
            table = app.query_one("#running", RequestTable)
            await wait_for(pilot, lambda: set(rids[:4]) <= table_rids(app, "running"), "four requests running")
            await asyncio.gather(*firsts[:4])
            waiting = app.query_one("#waiting", RequestTable)
            await wait_for(pilot, lambda: "load-e" in table_rids(app, "waiting"), "load-e waiting")
            assert cell(waiting, "load-e", "waiting for") == "no free slot"
            table.focus()
            await wait_for(pilot, lambda: table.has_focus and table.selected_rid is not None, "a selection")
            await pilot.press(*["down"] * table.get_row_index("load-b"))  # a person moves to load-b
            assert table.selected_rid == "load-b"
            await other.abort("load-a")  # the row above goes: load-b moves up a row
            await wait_for(pilot, lambda: "load-a" not in table_rids(app, "running"), "load-a's row to go")
            assert table.selected_rid == "load-b"
            assert table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value == "load-b"
            await pilot.press("x")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the confirmation")
            assert shown(app.screen.query_one(Label)) == "Abort the request load-b?"
            await pilot.press("y")
            rest_b = [out async for out in streams[1]]
            assert rest_b[-1].finish_reason == "abort"  # type: ignore[union-attr]
            assert "load-c" in running_rids(app)  # the neighbour is untouched
            assert await app.link.abort("load-b") == "finished"  # gone meanwhile: not an engine error
            for rid in ("load-c", "load-d", "load-e"):
                await other.abort(rid)
            for stream in (streams[0], streams[2], streams[3]):
                assert [out async for out in stream][-1].finish_reason == "abort"  # type: ignore[union-attr]
            first_e = await firsts[4]  # load-e took load-b's slot, or was aborted still waiting
            outs_e = [first_e] if isinstance(first_e, Final) else [first_e, *[out async for out in streams[4]]]
            assert outs_e[-1].finish_reason == "abort"  # type: ignore[union-attr]

    run(scenario)


def test_page_keys_in_the_prompt_box_scroll_the_conversation(engine: str) -> None:
    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=(50, 18)) as pilot:  # a small terminal: a short reply overflows it
            await connected_app(pilot)
            await type_and_send(pilot, "/max_tokens 200")
            await type_and_send(pilot, "/ignore_eos on")
            await type_and_send(pilot, "Tell me a long story")
            await wait_for(pilot, lambda: last_reply(app).state == "done", "a long reply")
            log = app.current.query_one(".chat-log")  # type: ignore[union-attr]
            await wait_for(pilot, lambda: log.max_scroll_y > log.size.height and log.scroll_y == log.max_scroll_y,
                           "a conversation taller than the screen, shown at its end")
            bottom = log.max_scroll_y
            await pilot.press("pageup")
            assert log.scroll_y == bottom - log.scrollable_content_region.height
            await pilot.press("ctrl+home")
            assert log.scroll_y == 0
            user = app.current.query_one(".user", Static)  # type: ignore[union-attr]
            assert user.region.y >= log.region.y and shown(user) == "Tell me a long story"
            await pilot.press("pagedown")
            assert log.scroll_y == log.scrollable_content_region.height
            await pilot.press("ctrl+end")
            assert log.scroll_y == bottom
            assert isinstance(app.focused, PromptInput)

    run(scenario)


def test_quit_asks_while_a_reply_streams(engine: str) -> None:
    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            await connected_app(pilot)
            reply = await streaming_reply(pilot, "keep going")
            await pilot.press("ctrl+q")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the question")
            assert shown(app.screen.query_one(Label)) == "Quit minichat? 1 reply is still streaming."
            await pilot.press("n")
            assert app.is_running and reply.state == "streaming"
            await pilot.press("ctrl+q")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the question again")
            await pilot.press("y")
            await wait_for(pilot, lambda: not app.is_running, "the app to quit")
        assert reply.state == "interrupted"

    run(scenario)


def test_conversations_survive_a_restart_and_are_listed(engine: str, data_dir: Path) -> None:
    async def first_run() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            await connected_app(pilot)
            await type_and_send(pilot, "/rename keeper")
            await type_and_send(pilot, "/system Be brief.")
            await type_and_send(pilot, "/max_tokens 5")
            await type_and_send(pilot, "remember me")
            await wait_for(pilot, lambda: last_reply(app).state == "done", "the reply")
            await pilot.press("ctrl+n")
            await type_and_send(pilot, "/rename other")
            await type_and_send(pilot, "/max_tokens 3")
            await type_and_send(pilot, "another thing")
            await wait_for(pilot, lambda: last_reply(app).state == "done", "the other reply")
            await pilot.press("ctrl+w")  # closed, not deleted: in the list, not reopened
            await wait_for(pilot, lambda: len(app.query(ChatPane)) == 1, "the close")
            texts["keeper"] = app.current.session.turns[0].reply.text  # type: ignore[union-attr]
            await pilot.press("ctrl+q")  # nothing streaming, everything saved: no question
            await wait_for(pilot, lambda: not app.is_running, "the app to quit")

    async def second_run() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            assert [p.session.name for p in app.query(ChatPane)] == ["keeper"]
            session = app.current.session  # type: ignore[union-attr]
            assert session.system_prompt == "Be brief." and session.params.max_tokens == 5
            assert shown(app.current.query_one(".user", Static)) == "remember me"  # type: ignore[union-attr]
            assert app.query_one(ReplyView).query_one(Markdown).source == printable(texts["keeper"])
            await pilot.press("ctrl+o")
            await wait_for(pilot, lambda: isinstance(app.screen, SessionsScreen), "the conversation list")
            table = app.screen.query_one(DataTable)
            assert [table.get_row_at(i)[:2] for i in range(table.row_count)] == [["other", "1"], ["keeper", "1"]]
            burst(app, *"anoth")  # searches prompts and replies as well as names
            await wait_for(pilot, lambda: table.row_count == 1 and table.get_row_at(0)[0] == "other", "the search")
            await pilot.press("enter")  # reopens it in a tab
            await wait_for(pilot, lambda: app.current.session.name == "other", "the reopened session")  # type: ignore[union-attr]
            assert shown(app.current.query_one(".user", Static)) == "another thing"  # type: ignore[union-attr]
            await pilot.press("ctrl+o")
            await wait_for(pilot, lambda: isinstance(app.screen, SessionsScreen), "the list again")
            await pilot.press("down", "down", "e")  # keeper is second: export it
            exported = data_dir / "exports" / "keeper.md"
            await wait_for(pilot, exported.exists, "the export")
            assert exported.read_text().startswith("# keeper\n") and "## You\n\nremember me\n" in exported.read_text()
            await pilot.press("ctrl+o")
            await wait_for(pilot, lambda: isinstance(app.screen, SessionsScreen), "the list once more")
            await pilot.press("down", "d")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the delete question")
            await pilot.press("y")
            await wait_for(pilot, lambda: isinstance(app.screen, SessionsScreen), "the list after the delete")
            table = app.screen.query_one(DataTable)
            assert [table.get_row_at(i)[0] for i in range(table.row_count)] == ["keeper"]

    texts: dict[str, str] = {}
    run(first_run)
    run(second_run)


def test_a_lone_surrogate_typed_in_the_console_is_shown_replaced_and_saved(engine: str, data_dir: Path) -> None:
    """Text no encoding carries (a lone UTF-16 surrogate half) becomes U+FFFD where it enters the console: the
    engine gets a prompt it can encode, the store saves it, and later turns save too."""
    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            await connected_app(pilot)
            await type_and_send(pilot, "/rename odd \ud800 one")
            await type_and_send(pilot, "/max_tokens 3")
            for prompt in ("lone \udc00 half", "then plain"):
                await type_and_send(pilot, prompt)
                await wait_for(pilot, lambda: last_reply(app).state == "done", "the reply")
            session = app.current.session  # type: ignore[union-attr]
            assert session.name == "odd \ufffd one" and session.turns[0].prompt == "lone \ufffd half"
            await pilot.press("ctrl+q")
            await wait_for(pilot, lambda: not app.is_running, "the app to quit")
        saved = Store(data_dir / "conversations.sqlite3").load(session.uid)
        assert saved.name == "odd \ufffd one" and [t.prompt for t in saved.turns] == ["lone \ufffd half", "then plain"]
        assert all(t.reply.state == "done" for t in saved.turns)

    run(scenario)


def test_a_damaged_database_is_reported_and_the_console_runs_on(tmp_path: Path, data_dir: Path) -> None:
    data_dir.mkdir(parents=True)
    (data_dir / "conversations.sqlite3").write_bytes(b"this is not a database" * 100)

    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=f"ipc://{tmp_path}/nobody.sock", autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            assert app.conversations.store is None and "not saving" in status(app)
            assert "is damaged or not a minichat database" in app.conversations.problem
            await type_and_send(pilot, "still works")
            assert last_reply(app).state == "queued"
            await pilot.press("escape")
            await pilot.press("ctrl+q")  # unsaved conversation: asks
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the question")
            assert shown(app.screen.query_one(Label)) == "Quit minichat? 1 conversation is not saved."

    run(scenario)


@pytest.fixture(scope="module")
def small_engine(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An engine whose model holds only 512 tokens, so a conversation outgrows it in a few turns."""
    address = f"ipc://{tmp_path_factory.mktemp('tui-small')}/engine.sock"
    with start_engine(llama_ckpt, address):
        yield address


def test_a_conversation_that_outgrows_the_context_is_trimmed(small_engine: str) -> None:
    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=small_engine, autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            await connected_app(pilot)
            pane = app.current
            assert pane is not None
            gauge = pane.query_one(".chat-gauge", Static)
            await wait_for(pilot, lambda: shown(gauge).endswith(" 0/512"), "the empty gauge")
            await type_and_send(pilot, "/max_tokens 600")  # more than the model holds: refused
            assert pane.session.params.max_tokens == 256
            await type_and_send(pilot, "/max_tokens 40")
            await type_and_send(pilot, "/ignore_eos on")
            await type_and_send(pilot, "/system Keep it short.")
            words = "to be or not to be that is the question " * 8
            for i in range(6):
                await type_and_send(pilot, f"{i}: {words}")
                await wait_for(pilot, lambda: pane.session.live is None, f"reply {i}")
                reply = last_reply(app)
                assert reply.state == "done" and reply.completion_tokens == 40, reply.summary()
                used = f" {reply.prompt_tokens + 40}/512"  # type: ignore[operator]
                await wait_for(pilot, lambda used=used: shown(gauge).endswith(used), f"the gauge at {used}")
            assert pane.session.context_start > 0  # the oldest turns were dropped, not the conversation
            mark = pane.query_one(".context-mark", Static)
            start = pane.session.context_start
            assert shown(mark).startswith(f"▲ the {start} turn{'s' * (start > 1)} above")
            assert pane.session.messages("x")[0] == {"role": "system", "content": "Keep it short."}
            await type_and_send(pilot, "/clear")
            mark = pane.query_one(".context-mark", Static)
            assert shown(gauge).endswith(" 0/512") and shown(mark).startswith("▲ the 6 turns above are no longer")
            await type_and_send(pilot, "afresh")
            await wait_for(pilot, lambda: pane.session.live is None, "the reply after /clear")
            # the system prompt and this message only: less than the first turn, which had no history either
            assert last_reply(app).prompt_tokens < pane.session.turns[0].reply.prompt_tokens  # type: ignore[operator]

    run(scenario)


def test_a_failed_start_shows_its_cause(tmp_path: Path) -> None:
    async def scenario() -> None:
        link = EngineLink(address=f"ipc://{tmp_path}/bad.sock", model=str(tmp_path / "no-such-model"))
        app = MinichatApp(link)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: link.state.kind == "failed", "the failed start")
            assert status(app).startswith(" failed  the engine did not start: cannot load the model")
            assert "no-such-model" in status(app) and status(app).endswith("then /reconnect")
            await pilot.press("ctrl+q")
        assert app.return_code == 1  # the console's exit status says the engine never started (tui/cli.py)

    run(scenario)


def test_an_engine_the_console_did_not_start_is_not_replaced_silently(long_ckpt: Path, tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/theirs.sock"
    theirs = start_engine(long_ckpt, address)

    async def scenario() -> None:
        link = EngineLink(address=address, model=None)  # would start the demo model in its place
        app = MinichatApp(link)
        async with app.run_test(size=SIZE) as pilot:
            await connected_app(pilot)
            theirs.stop()
            await wait_for(pilot, lambda: link.state.kind == "lost", "the lost state")
            assert "it was not started by this console" in status(app) and link.handle is None
            assert link.lost_options == (str(long_ckpt), {**link.lost_options[1]})  # type: ignore[index]
            assert link.lost_options[1]["max_running_requests"] == 4  # type: ignore[index]
            await type_and_send(pilot, "/reconnect")  # starts it again, as it was
            await wait_for(pilot, lambda: link.state.kind == "connected", "the restarted engine", timeout=120)
            assert link.handle is not None and link.info is not None and link.info.model == str(long_ckpt)
            assert link.info.config["max_running_requests"] == 4
        link.stop_engine()

    try:
        run(scenario)
    finally:
        theirs.stop()


# -- keep the speed when the machine is shared: the console costs nothing when nothing moves ----------------

def hidden(node: object) -> bool:
    """Not on screen: the widget or one of its ancestors is not displayed (a tab not in front)."""
    return isinstance(node, Widget) and not all(n.display for n in node.ancestors_with_self if isinstance(n, Widget))


class Work:
    """Every timer callback and refresh request in the app from now on, each with the widget it was for
    (a timer's: the one that set it) and whether that widget was hidden then (Textual's Timer._tick and
    Widget.refresh, wrapped for the test)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ticks: list[tuple[object, bool]] = []
        self.refreshes: list[tuple[Widget, bool]] = []
        self.callers: list[str] = []  # for each refresh, the console's own frames that asked for it
        tick, refresh = Timer._tick, Widget.refresh

        async def counted_tick(timer: Timer, **kwargs: Any) -> None:
            target = timer._target()
            self.ticks.append((target, hidden(target)))
            await tick(timer, **kwargs)

        def counted_refresh(widget: Widget, *args: Any, **kwargs: Any) -> Widget:
            self.refreshes.append((widget, hidden(widget)))
            self.callers.append(f"{widget!r} from " + " < ".join(
                f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(traceback.extract_stack()[:-1])
                if f"{os.sep}tui{os.sep}" in f.filename))
            return refresh(widget, *args, **kwargs)

        monkeypatch.setattr(Timer, "_tick", counted_tick)
        monkeypatch.setattr(Widget, "refresh", counted_refresh)

    def clear(self) -> None:
        self.ticks.clear()
        self.refreshes.clear()

    def in_hidden_widgets(self) -> list[str]:
        return [f"{kind} {node!r}" for kind, work in (("timer", self.ticks), ("refresh", self.refreshes))
                for node, was_hidden in work if was_hidden]


def counting_snapshots(app: MinichatApp) -> Callable[[], int]:
    """How many stats snapshots the app has been handed from now on."""
    seen = [0]
    on_stats = app.link.on_stats

    def counted(stats: Stats) -> None:
        seen[0] += 1
        on_stats(stats)

    app.link.on_stats = counted
    return lambda: seen[0]


async def snapshots(pilot: Pilot, count: Callable[[], int], n: int) -> None:
    """Let the app run until it has been handed `n` more snapshots."""
    target = count() + n
    await wait_for(pilot, lambda: count() >= target, f"{n} more stats snapshots")


def engine_idle(stats: Stats | None) -> bool:
    """Nothing runs, waits or moves: no rate, and no KV page on its way to or from disk (the disk tier's writes
    of earlier tests' pages go on after their last step)."""
    c = stats.counters if stats is not None else None
    return c is not None and stats is not None and not stats.running and not stats.waiting and \
        c.prefill_tokens_per_s == c.decode_tokens_per_s == c.steps_per_s == 0 and \
        not any(t.writing or t.loading for t in stats.pages.tiers)


def saved_session(i: int) -> Session:
    """A conversation as a tab reopened from the store holds it: one finished exchange."""
    reply = Reply(rid=f"saved-{i}", text=f"Reply {i}: *some* Markdown,\n\n- a list\n- of two", state="done",
                  finish_reason="stop", prompt_tokens=12, completion_tokens=20, ttft=0.05, total=0.5)
    return Session(f"saved {i}", turns=[Turn(f"question {i}", reply)])


def test_an_idle_console_with_many_tabs_does_no_work(engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Twenty tabs, an idle engine whose snapshots keep coming (and repeat): over eight snapshots no
    hidden tab's widget runs a timer or asks for a refresh, the ops panels and the status line redraw
    nothing, and the one thing that may move is the cursor blinking in the front tab's prompt box."""

    async def scenario() -> None:
        async with AsyncEngineClient(engine) as client:  # an engine at rest: no earlier test's requests or rates
            deadline = time.monotonic() + 60
            while not engine_idle(await client.stats()):
                assert time.monotonic() < deadline, "timed out waiting for the engine to idle"
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            count = counting_snapshots(app)
            await connected_app(pilot)
            for i in range(19):
                await app.open_session(saved_session(i), activate=False)
            assert len(app.query(ChatPane)) == 20 and app.current is not None
            await wait_for(pilot, lambda: engine_idle(app.last_stats), "an idle snapshot")
            throughput = app.query_one(ThroughputPanel)
            assert all(h.count(0.0) == HISTORY for h in throughput.history.values())  # flat: nothing to scroll
            await pilot.pause()
            await snapshots(pilot, count, 2)  # the tabs opened are laid out and drawn
            work = Work(monkeypatch)
            await snapshots(pilot, count, 8)
            assert engine_idle(app.last_stats)
            assert not work.in_hidden_widgets()
            ops = app.query_one(OpsPanels)
            redrawn = [where for (w, _), where in zip(work.refreshes, work.callers, strict=True)
                       if ops in w.ancestors_with_self]
            assert not redrawn, f"the panels redrew: {redrawn}"
            assert {type(w) for w, _ in work.refreshes} <= {PromptInput}, work.refreshes
            front = app.current.query_one(PromptInput)
            assert {type(t) for t, _ in work.ticks} <= {MinichatApp, Screen, PromptInput}, work.ticks
            assert all(t is front for t, _ in work.ticks if isinstance(t, PromptInput))  # its cursor blink

    run(scenario)


def test_replies_streaming_in_hidden_tabs_wait_to_render_until_shown(engine: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A fan-out streams into hidden tabs: their reply views' frame clocks stand still (no frame, no
    refresh) until their tab comes to the front, where the view catches up and streams on; the view
    left behind stops in turn."""

    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            count = counting_snapshots(app)
            await connected_app(pilot)
            await long_replies(pilot)
            await type_and_send(pilot, "/fanout 3 Once more unto the breach")
            panes = list(app.query(ChatPane))[1:]
            views = [pane.query_one(ReplyView) for pane in panes]
            assert app.current is panes[0]
            await wait_for(pilot, lambda: all(v.reply.text for v in views) and views[0].query_one(Markdown).source,
                           "three replies streaming, the front one on screen")
            work = Work(monkeypatch)
            await snapshots(pilot, count, 4)
            ticks = [t for t, _ in work.ticks]
            assert ticks.count(views[0]) > 0 and ticks.count(views[1]) == ticks.count(views[2]) == 0
            assert not work.in_hidden_widgets()
            assert views[1].query_one(Markdown).source == views[2].query_one(Markdown).source == ""

            await pilot.press("ctrl+pagedown")  # the second fan-out tab to the front
            assert app.current is panes[1]
            await wait_for(pilot, lambda: len(views[1].query_one(Markdown).source) > 0, "the shown view catching up")
            await snapshots(pilot, count, 1)  # the view left behind notices at its next frame, and stops
            work.clear()
            await snapshots(pilot, count, 4)
            ticks = [t for t, _ in work.ticks]
            assert ticks.count(views[1]) > 0 and ticks.count(views[0]) == ticks.count(views[2]) == 0
            assert not work.in_hidden_widgets()
            shown = len(views[1].query_one(Markdown).source)
            await wait_for(pilot, lambda: len(views[1].query_one(Markdown).source) > shown, "the shown view streaming")
            for pane in panes:
                await pane.abort()
            await wait_for(pilot, lambda: all(p.session.live is None for p in panes), "the aborts")
            for view in views:  # every view ends with the whole reply, shown or not
                assert view.query_one(Markdown).source == printable(view.reply.text)

    run(scenario)


# -- scheduler v2 made visible: priorities, retraction, the admission rule ------------------------------------

def notes(app: MinichatApp) -> list[str]:
    """The notifications on screen."""
    return [str(n.message) for n in app._notifications]


def test_priority_is_a_session_setting_sent_with_its_requests(engine: str) -> None:
    async def first_run() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            await connected_app(pilot)
            pane = app.current
            assert pane is not None
            settings = pane.query_one(".chat-settings", Static)
            await type_and_send(pilot, "/priority x")  # not an integer: refused in words, nothing changes
            assert pane.session.params.priority == 0 and "priority" not in shown(settings)
            assert any(n.startswith("priority must be an integer") and n.endswith("got 'x'") for n in notes(app))
            await type_and_send(pilot, "/priority 3")
            assert pane.session.params.priority == 3 and shown(settings).endswith(" · priority 3")
            reply = await streaming_reply(pilot, "Who goes first?")
            running = app.query_one("#running", RequestTable)
            await wait_for(pilot, lambda: reply.rid in table_rids(app, "running"), "the request in the running set")
            assert cell(running, reply.rid, "prio") == "3" and cell(running, reply.rid, "state") == "decode"
            stats = app.last_stats
            assert stats is not None and next(r for r in stats.running if r.rid == reply.rid).priority == 3
            # at 80 columns the status line still shows the running set and the queue first
            await pilot.resize_terminal(80, 24)
            await wait_for(pilot, lambda: app.query_one("#status").size.width == 80, "the small terminal")
            assert status(app).startswith(" connected  running ") and " · waiting " in status(app)[:80]
            await pane.abort()
            await wait_for(pilot, lambda: pane.session.live is None, "the abort")

    async def second_run() -> None:  # the setting was saved with the session
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            assert app.current is not None and app.current.session.params.priority == 3

    run(first_run)
    run(second_run)


# A pool of 2,000 pages of 4 tokens, the queue in priority order, and no starvation bound to speak of.
TIGHT = {"page_size": 4, "num_pages": 2000, "schedule_policy": "priority", "max_wait_steps": 1_000_000,
         "max_running_requests": 2}
"""Two request slots: the crowd waits for a slot while the two long requests run, and runs two at a time after
the retraction, so the retracted request waits behind it for some 3,000 steps."""
RETRACTED_BUDGET = 5600
"""Each long request's max_tokens: 70% of two budgets (2,868 tokens each, the expectation's 4,096-token clip) fit
the 8,000 tokens of the TIGHT pool, and the tokens written (over 11,000) do not, so the pool runs dry after some
4,000 steps. The margins are in steps, because a loaded test process can fall hundreds of steps behind its engine:
the two may start up to 3,200 steps apart and still meet the dry pool together, and the crowd has some 4,000 steps
to be queued before the retraction (which must find it there to wait behind)."""


def test_a_retracted_request_is_shown_as_retracted(long_ckpt: Path, tmp_path: Path) -> None:
    """Optimistic admission lets two long requests in together that the pool cannot hold once they
    have grown: the one of lower priority is retracted, keeping its tokens, and waits behind a crowd
    of higher priority; the waiting queue marks it, and the console counts the retractions."""
    address = f"ipc://{tmp_path}/tight.sock"

    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=address, autostart=False))
        async with app.run_test(size=SIZE) as pilot, AsyncEngineClient(address) as other:
            await connected_app(pilot)
            pages = app.query_one("#pages", Widget)
            await wait_for(pilot, lambda: "queue order priority" in str(pages.render()), "the admission rule")
            assert "admission optimistic (expects 70%" in str(pages.render())
            low = other.generate([1], max_tokens=RETRACTED_BUDGET, ignore_eos=True, priority=5, rid="low")
            lead = other.generate([2, 3], max_tokens=RETRACTED_BUDGET, ignore_eos=True, rid="lead")
            await asyncio.gather(anext(low), anext(lead))  # both running: the pool runs dry in ~4,000 steps
            crowd = [asyncio.ensure_future(other.complete([10 + i, 200 - i], max_tokens=96, ignore_eos=True,
                                                          rid=f"crowd-{i}")) for i in range(64)]
            waiting = app.query_one("#waiting", RequestTable)
            seen: set[str] = set()  # every way the low request was shown waiting, for a failure to say

            def marked() -> bool:
                if "low" not in table_rids(app, "waiting"):
                    return False
                seen.add(cell(waiting, "low", "waiting for"))
                return cell(waiting, "low", "waiting for").startswith("retracted ×1 · keeps ")

            try:
                try:
                    await wait_for(pilot, marked, "the retracted request marked in the waiting queue")
                except AssertionError as e:
                    raise AssertionError(f"{e}; it was shown waiting for {seen or 'nothing'}; the engine's "
                                         f"counters: {app.last_stats and app.last_stats.counters}") from None
                assert cell(waiting, "low", "prio") == "5"
                kept = int(cell(waiting, "low", "waiting for").split("keeps ")[1].split(" tok")[0])
                assert 0 < kept < RETRACTED_BUDGET
                stats = app.last_stats
                assert stats is not None and stats.counters.retractions > 0
                low_waiting = next(w for w in stats.waiting if w.rid == "low")
                assert low_waiting.retractions == 1 and low_waiting.generated == kept
                await wait_for(pilot, lambda: f"retracted {stats.counters.retractions}" in status(app),
                               "the retraction count in the status line")
                counters = app.query_one("#counters", Static)
                assert f"retracted {stats.counters.retractions}" in shown(counters)
                assert "queue order priority" in str(pages.render())
            finally:
                for task in crowd:
                    task.cancel()
                await asyncio.gather(*crowd, return_exceptions=True)
                await low.aclose()
                await lead.aclose()

    with start(address, model=str(long_ckpt), timeout=120, **TIGHT):
        run(scenario)
