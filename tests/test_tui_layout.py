"""The console's third pass on focus and layout (issue 37), driven by Textual's pilot against a real engine, at
80x24 and 160x50: typing reaches the prompt box after every f5 and is never swallowed by a table, a message sent
after scrolling back brings its reply into view, and nothing is cut: the running set's columns at a 160-column
split, the history panel in the 80x24 ops view, the conversation list's dates at 80 columns, and the request
detail, drawn at once, its timings whole.

As in tests/test_tui.py every wait is on a condition with a deadline; keys are pressed one by one, as typed
(`pilot.press`), since it is the keys that went astray.
"""

from __future__ import annotations

import pytest
from textual.containers import VerticalScroll
from textual.widgets import DataTable, Static

from tests.checkpoints import UNTIL_ABORTED
from tests.test_tui import (
    box,
    cell,
    connected_app,
    last_reply,
    long_replies,
    run,
    streaming_reply,
    table_rids,
    type_and_send,
    wait_for,
)
from tui.app import MinichatApp
from tui.chat import ChatPane, PromptInput, ReplyView
from tui.link import EngineLink
from tui.panels import RequestTable
from tui.panels.detail import RequestDetailScreen
from tui.sessions import SessionsScreen

pytestmark = pytest.mark.usefixtures("data_dir")  # conversations in a private directory (conftest.py)

SIZES = [(80, 24), (160, 50)]
IDS = ["80x24", "160x50"]


async def typed(pilot, text: str) -> None:  # type: ignore[no-untyped-def]
    """`text` typed key by key, then enter."""
    await pilot.press(*text, "enter")


@pytest.mark.parametrize("size", SIZES, ids=IDS)
def test_typing_reaches_the_prompt_box_after_every_f5(engine: str, size: tuple[int, int]) -> None:
    """Round the views with f5 (160 columns: split, chat, ops, split; 80: chat, ops, chat), typing after each
    one: in a view with the chat the keys go to the prompt box (a running set that kept focus at 160 columns took
    `/max_tokens 800` as a filter and sent nothing); in the ops panels alone a character that is none of their
    keys brings the chat back and lands in the prompt box; the issue's own sequence fans out."""

    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=size) as pilot:
            await connected_app(pilot)
            wide = size[0] >= 120
            views = ["chat", "ops", "split"] if wide else ["ops", "chat"]
            for n, view in enumerate(views):
                await pilot.press("f5")
                shown = "chat" if app.ops_width == 0 else "ops" if app.ops_width == 100 else "split"
                assert shown == view, (view, app.ops_width)
                if view == "ops":
                    assert isinstance(app.focused, RequestTable)
                    await pilot.press(*"hello")  # none of the panels' keys: to the prompt box, the chat back
                    assert app.ops_width < 100 and isinstance(app.focused, PromptInput) and box(app).text == "hello"
                    box(app).clear()
                    await pilot.press("f5", *(["f5"] if wide else []))  # the ops panels again, then on round
                    assert app.ops_width == 100
                    continue
                await typed(pilot, f"/max_tokens {800 + n}")
                assert app.current is not None and app.current.session.params.max_tokens == 800 + n, view
                assert app.ops.filter == "" and box(app).text == ""
            await typed(pilot, "/fanout 2 Speak of love")
            await wait_for(pilot, lambda: len(app.query(ChatPane)) == 3, "the fan-out's two tabs")
            assert app.ops.filter == ""
            await pilot.press("ctrl+g")
            await wait_for(pilot, lambda: len(app.query(ChatPane)) == 1, "the fan-out closed")

    run(scenario)


@pytest.mark.parametrize("size", SIZES, ids=IDS)
def test_a_message_sent_after_scrolling_back_streams_in_view(engine: str, size: tuple[int, int]) -> None:
    """Page up through a long conversation (the log lets go of its end), then send: the log goes back to its end
    and the new reply streams in view, not below it."""

    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=size) as pilot:
            await connected_app(pilot)
            await type_and_send(pilot, "/ignore_eos on")
            await type_and_send(pilot, "/max_tokens 300")
            log = app.current.query_one(".chat-log", VerticalScroll)  # type: ignore[union-attr]
            for n in range(8):  # replies until the conversation is two screens long
                await type_and_send(pilot, f"long reply {n}")
                reply = last_reply(app)
                await wait_for(pilot, lambda: reply.state == "done", "a long reply")  # noqa: B023
                await pilot.pause()
                if log.max_scroll_y > log.size.height:
                    break
            assert log.max_scroll_y > log.size.height
            await pilot.press("pageup", "pageup")
            assert log.scroll_y < log.max_scroll_y
            await type_and_send(pilot, f"/max_tokens {UNTIL_ABORTED}")
            reply = await streaming_reply(pilot, "and now?")
            view = app.query(ReplyView).last()
            await wait_for(pilot, lambda: reply.completion_tokens > 60 and log.scroll_y >= log.max_scroll_y - 1 and
                           view.region.bottom <= log.region.bottom + 1 and view.region.bottom > log.region.y,
                           "the streaming reply in view at the end of the log")
            await pilot.press("escape")
            await wait_for(pilot, lambda: reply.state == "aborted", "the abort")

    run(scenario)


def test_the_running_set_fits_a_160_column_split(engine: str) -> None:
    """At 160x50 the split gives the ops panels 80 columns: every column of the running set is drawn whole
    within the table, with room for a retraction mark in the state (`decode ×2`, where a column of its own
    showed as `r`)."""

    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=(160, 50)) as pilot:
            await connected_app(pilot)
            reply = await streaming_reply(pilot, "fill the running set")
            running = app.query_one("#running", RequestTable)
            await wait_for(pilot, lambda: reply.rid in table_rids(app, "running"), "the request in the running set")
            assert 0 < app.ops_width < 100 and running.region.width <= 80
            assert cell(running, reply.rid, "state") == "decode"
            widths = sum(column.get_render_width(running) for column in running.ordered_columns)
            assert widths + len(" ×2") <= running.scrollable_content_region.width, widths
            assert running.max_scroll_x == 0
            await pilot.press("escape")
            await wait_for(pilot, lambda: reply.state == "aborted", "the abort")

    run(scenario)


def test_at_80x24_the_ops_panels_the_list_and_the_detail_are_whole(engine: str) -> None:
    """The ops panels alone at 80x24 show every panel, the history too (it was below the screen); the
    conversation list keeps its dates and model (the preview is what it cuts); the request detail draws at once
    (it was blank until the engine answered) and its timings end in words, not a dangling `since`."""

    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=(80, 24)) as pilot:
            await connected_app(pilot)
            await long_replies(pilot)
            await type_and_send(pilot, "Show me every panel")
            reply = last_reply(app)
            await wait_for(pilot, lambda: reply.completion_tokens > 3, "a streaming reply")
            await pilot.press("f5")
            await wait_for(pilot, lambda: app.ops_width == 100 and reply.rid in table_rids(app, "running"),
                           "the ops panels with the request")
            for panel_id in ("waiting", "running", "steps", "slots", "pages", "throughput", "history"):
                panel = app.query_one(f"#{panel_id}")
                assert panel.region.bottom <= 23 and panel.region.right <= 80, (panel_id, panel.region)

            screen = RequestDetailScreen(reply.rid, app.link, lambda rid: None)
            await app.push_screen(screen)
            facts = screen.query_one("#detail-facts", Static)
            assert str(facts.render()).startswith("owner"), str(facts.render())  # drawn before the engine answers
            await wait_for(pilot, lambda: "timings" in str(facts.render()), "the engine's description")
            await wait_for(pilot, lambda: "tok/s" in str(facts.render()), "its decode rate")
            timings = next(line for line in str(facts.render()).splitlines() if line.startswith("timings"))
            assert timings.endswith("tok/s since its first token"), timings
            await pilot.press("escape")
            await app.current.abort()  # type: ignore[union-attr]
            await wait_for(pilot, lambda: reply.state == "aborted", "the abort")

            await pilot.press("ctrl+o")
            await wait_for(pilot, lambda: isinstance(app.screen, SessionsScreen), "the conversation list")
            table = app.screen.query_one(DataTable)
            await wait_for(pilot, lambda: table.row_count == 1, "the conversation in the list")
            right = table.region.x + table.scrollable_content_region.width
            x = table.region.x
            for column in table.ordered_columns:
                width = column.get_render_width(table)
                if column.label.plain in ("conversation", "turns", "updated", "started", "model"):
                    assert x + width <= right, (column.label.plain, x + width, right)
                x += width

    run(scenario)


def _luminance(color) -> float:  # type: ignore[no-untyped-def]
    def channel(v: int) -> float:
        c = v / 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4
    return 0.2126 * channel(color.r) + 0.7152 * channel(color.g) + 0.0722 * channel(color.b)


def _contrast(a, b) -> float:  # type: ignore[no-untyped-def]
    """WCAG's contrast ratio of two colours (1 to 21)."""
    high, low = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (high + 0.05) / (low + 0.05)


def test_at_80x20_the_chat_scrollbar_reads_as_a_scrollbar_in_every_theme(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Issue 50's "glyphs left after a resize" were the chat's scrollbar at 80x20: Textual's default dark thumb
    on a black track showed only the thumb's partial-cell ends ("▁▁", "▆▆"). Now the scrollbar is one column, its
    track stands off the pane and its thumb off the track, in every theme with colours of its own (the ANSI
    themes take the terminal's palette, whose colours Textual does not know)."""

    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=f"ipc://{tmp_path}/nobody.sock", autostart=False))
        async with app.run_test(size=(160, 48)) as pilot:
            await pilot.pause()
            await pilot.resize_terminal(80, 20)
            log = app.query_one(".chat-log", VerticalScroll)
            await wait_for(pilot, lambda: log.show_vertical_scrollbar, "the help text to overflow the 80x20 chat")
            assert log.scrollbar_size_vertical == 1
            themes = sorted(t for t in app.available_themes if not t.startswith("ansi"))
            assert "textual-dark" in themes and len(themes) > 10
            for theme in themes:
                app.theme = theme
                await pilot.pause()
                pane = log.background_colors[1]
                track = pane + log.styles.scrollbar_background
                thumb = track + log.styles.scrollbar_color
                assert _contrast(track, pane) >= 1.05 and _contrast(thumb, track) >= 2.0, (
                    theme, _contrast(track, pane), _contrast(thumb, track))

    run(scenario)
