"""The console's ops side driven by Textual's pilot against a real engine: aborts that act on live rows
only, focus that shows and cycles, the layout key and narrow terminals, the request detail view,
filter / sort / pause / abort-all, and the history panel.

As in tests/test_tui.py every wait is on a condition with a deadline (`wait_for`), never a bare sleep;
requests that must stay alive until aborted use ignore_eos and a large max_tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from pathlib import Path

import pytest
from textual.widgets import Label, Sparkline, Static

from engine.outputs import Final, Output
from engine.service.client import AsyncEngineClient, EngineError
from engine.service.launcher import start
from tests.checkpoints import UNTIL_ABORTED
from tests.test_tui import (
    ENGINE_OPTIONS,
    SIZE,
    box,
    cell,
    connected_app,
    run,
    shown,
    status,
    table_rids,
    wait_for,
)
from tui.app import MinichatApp
from tui.link import EngineLink
from tui.panels import OpsPanels, RequestTable
from tui.panels.abort import AbortScreen
from tui.panels.detail import RequestDetailScreen
from tui.panels.history import HistoryPanel

FOREVER = {"max_tokens": UNTIL_ABORTED, "ignore_eos": True}


pytestmark = pytest.mark.usefixtures("data_dir")  # conversations in a private directory (conftest.py)


def table(app: MinichatApp, table_id: str) -> RequestTable:
    return app.query_one(f"#{table_id}", RequestTable)


def started(client: AsyncEngineClient, rid: str, prompt: str = "benchmark load",
            **params: object) -> AsyncGenerator[Output, None]:
    """A request of another client that runs until aborted; it is submitted at its first `anext`."""
    return client.generate(prompt, rid=rid, **{**FOREVER, **params})


async def drain(stream: AsyncGenerator[Output, None]) -> Output:
    """The rest of a stream: its Final."""
    outs = [out async for out in stream]
    return outs[-1]


def errors(app: MinichatApp) -> int:
    assert app.last_stats is not None
    return app.last_stats.counters.errors


def test_an_abort_confirmed_after_the_request_ended_is_not_an_error(engine: str) -> None:
    """The selection follows the live rows; a request that ends while its confirmation is open turns
    the question into "already finished", and a yes then sends nothing and counts no error."""

    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=SIZE) as pilot, AsyncEngineClient(engine, name="bench") as other:
            await connected_app(pilot)
            rids = ["stale-a", "stale-b", "stale-c"]
            streams = [started(other, rid) for rid in rids]
            await asyncio.gather(*(anext(s) for s in streams))
            running = table(app, "running")
            await wait_for(pilot, lambda: set(rids) <= table_rids(app, "running"), "three requests shown")
            running.focus()
            running.select("stale-b")
            await other.abort("stale-b")  # its row goes: the selection moves to the row now in its place
            await wait_for(pilot, lambda: "stale-b" not in table_rids(app, "running"), "stale-b's row to go")
            assert running.selected_rid in {"stale-a", "stale-c"} and running.selected_rid in table_rids(app, "running")
            assert (await drain(streams[1])).finish_reason == "abort"  # type: ignore[union-attr]

            running.select("stale-c")
            await pilot.press("x")
            await wait_for(pilot, lambda: isinstance(app.screen, AbortScreen), "the confirmation")
            question = app.screen.query_one(Label)
            latest = app.last_stats
            assert shown(question) == "Abort the request stale-c?", (
                f"link {app.link.state}; the newest snapshot runs "
                f"{latest and sorted(r.rid for r in latest.running)}, counters {latest and latest.counters}")
            await wait_for(pilot, lambda: app.last_stats is not None and app.last_stats.counters.steps > 0, "stats")
            before = errors(app)
            await other.abort("stale-c")  # it ends while the question is open
            await wait_for(pilot, lambda: shown(question) == "stale-c has already finished: nothing to abort.",
                           "the question to say it finished")
            assert isinstance(app.screen, AbortScreen) and app.screen.live_rids == []
            await pilot.press("y")  # nothing is sent
            assert (await drain(streams[2])).finish_reason == "abort"  # type: ignore[union-attr]
            # an abort that crosses the request's end anyway is "finished", and not an error
            assert await app.link.abort("stale-c") == "finished"
            seq = app.last_stats.seq  # type: ignore[union-attr]
            await wait_for(pilot, lambda: app.last_stats.seq > seq + 1, "a later snapshot")  # type: ignore[union-attr]
            assert errors(app) == before
            await other.abort("stale-a")
            assert (await drain(streams[0])).finish_reason == "abort"  # type: ignore[union-attr]
            await wait_for(pilot, lambda: not table_rids(app, "running"), "the table empty")
            assert running.selected_rid is None
            await pilot.press("x")  # nothing selected: nothing asked
            assert not isinstance(app.screen, AbortScreen)

    run(scenario)


def test_f6_cycles_the_panels_and_their_keys_stay_out_of_the_prompt_box(tmp_path: Path) -> None:
    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=f"ipc://{tmp_path}/nobody.sock", autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            prompt, waiting, running = box(app), table(app, "waiting"), table(app, "running")
            assert app.focused is prompt
            for expected in (waiting, running, prompt, waiting):
                await pilot.press("f6")
                assert app.focused is expected
            # the focused panel is unmistakable: a heavy accent rule and its title in reverse
            assert waiting.styles.border_top[0] == "heavy" and running.styles.border_top[0] != "heavy"
            assert waiting.styles.border_title_background is not None
            await pilot.press("f6")  # the running set
            await pilot.press("x", "delete", "s", "r", "X", "p", "p", "7", "7")
            assert prompt.text == "" and app.focused is running
            assert running.sort_column == 0 and running.sort_reverse
            await pilot.press("slash", "n", "o", "p", "e")  # a filter, typed into its own box
            filter_box = app.ops.query_one("#ops-filter")
            assert app.focused is filter_box and app.ops.filter == "nope" and prompt.text == ""
            await pilot.press("escape")  # clears it, back to the table it came from
            assert app.ops.filter == "" and not filter_box.display and app.focused is running
            await pilot.press("escape")  # and from the panels back to the prompt box
            assert app.focused is prompt

            # the palette lists Textual's own entries only where minichat has none of its own
            titles = [c.title for c in app.get_system_commands(app.screen)]
            assert "Keys" not in titles and titles.count("Quit") == 1 and "Help: keys and commands" in titles
            assert "Layout: chat, split or ops panels" in titles

            # one key through the three views; a narrow terminal keeps the side that has focus
            assert 0 < app.ops_width < 100
            await pilot.press("f5")
            assert app.ops_width == 0 and app.focused is prompt
            await pilot.press("f5")
            assert app.ops_width == 100 and isinstance(app.focused, RequestTable)
            await pilot.press("f5")
            assert 0 < app.ops_width < 100
            await pilot.press("f6", "f6")  # the running set
            await pilot.resize_terminal(80, 24)
            await wait_for(pilot, lambda: app.size.width == 80, "the small terminal")
            await wait_for(pilot, lambda: app.ops_width == 100, "the ops panels alone")
            assert isinstance(app.focused, RequestTable)
            await pilot.press("f5")
            assert app.ops_width == 0 and app.focused is prompt
            await pilot.press("f5")
            assert app.ops_width == 100
            await pilot.resize_terminal(*SIZE)
            await wait_for(pilot, lambda: 0 < app.ops_width < 100, "the split back")

    run(scenario)


def test_kv_title_and_totals_are_whole_at_80_columns(engine: str) -> None:
    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=(80, 24)) as pilot, AsyncEngineClient(engine, name="bench") as other:
            await connected_app(pilot)
            assert app.ops_width == 0
            await pilot.press("f5")
            assert app.ops_width == 100
            stream = started(other, "layout-1")
            await anext(stream)
            pages, totals = app.query_one("#pages"), app.query_one("#counters", Static)
            await wait_for(pilot, lambda: "layout-1" in table_rids(app, "running"), "a request running")
            await wait_for(pilot, lambda: "held" in str(pages.render()), "the KV counts")
            width = pages.size.width
            assert width <= 80
            title = str(pages.border_title)
            assert title.startswith("KV pages ") and title.endswith(" used · float32") and len(title) + 4 <= width
            header = str(pages.render()).splitlines()[:2]
            p = app.last_stats.pages  # type: ignore[union-attr]
            assert " locked · " in header[0] and f" free of {p.total} × {p.page_size} tok" in header[0]
            assert header[1].startswith("admission optimistic") and header[1].endswith("queue order fcfs")
            lines = str(totals.render()).splitlines()  # beside the history at 80x24: half the width, 3-4 lines
            assert 3 <= len(lines) <= 4 and all(len(line) <= totals.size.width for line in lines)
            assert "…" not in "".join(lines) and lines[-1].endswith(" tok")
            for part in ("submitted ", "finished ", "aborted ", "retracted ", "errors ", "steps ", "prefill ",
                         "decode "):
                assert part in "".join(lines)
            assert status(app).startswith(" connected  running 1 · waiting 0")
            await other.abort("layout-1")
            await drain(stream)

    run(scenario)


def test_request_detail_shows_owner_params_timings_and_output_and_aborts(engine: str) -> None:
    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=SIZE) as pilot, AsyncEngineClient(engine, name="nightly eval") as other:
            await connected_app(pilot)
            stream = started(other, "described", "Once more unto the breach", temperature=0.5, priority=3,
                                   seed=7)
            await anext(stream)
            running = table(app, "running")
            await wait_for(pilot, lambda: "described" in table_rids(app, "running"), "the request shown")
            assert cell(running, "described", "owner") == "nightly eval"
            running.focus()
            running.select("described")
            await pilot.press("enter")
            await wait_for(pilot, lambda: isinstance(app.screen, RequestDetailScreen), "the detail view")
            detail = app.screen
            assert isinstance(detail, RequestDetailScreen)
            facts = detail.query_one("#detail-facts", Static)
            await wait_for(pilot, lambda: "timings" in shown(facts), "the description")
            text = shown(facts)
            assert "owner     nightly eval" in text and "state     decoding" in text and "priority  3" in text
            assert f"max_tokens {UNTIL_ABORTED} · temperature 0.5 · ignore_eos True · seed 7" in text
            assert "from the prefix cache" in text and "KV pages held" in text and "queued " in text
            assert "first token " in text and "unto the breach" in shown(detail.query_one("#detail-prompt", Static))
            output = detail.query_one("#detail-text", Static)
            await wait_for(pilot, lambda: len(shown(output)) > 20, "its tokens streaming")
            seen = len(detail.output)
            await wait_for(pilot, lambda: len(detail.output) > seen, "more of them")
            await pilot.press("x")
            await wait_for(pilot, lambda: isinstance(app.screen, AbortScreen), "the confirmation")
            assert shown(app.screen.query_one(Label)) == "Abort the request described?"
            await pilot.press("y")
            final = await drain(stream)
            assert isinstance(final, Final) and final.finish_reason == "abort"
            await wait_for(pilot, lambda: detail.gone and "no longer live" in shown(facts), "the view to say so")
            assert detail.output  # what it saw stays
            await pilot.press("x")  # aborting it again: the dialog says it is over (by the next snapshot at most)
            await wait_for(pilot, lambda: isinstance(app.screen, AbortScreen), "the confirmation")
            await wait_for(pilot, lambda: shown(app.screen.query_one(Label))
                           == "described has already finished: nothing to abort.", "the dialog to say it is over")
            await pilot.press("escape", "escape")
            assert app.focused is running

    run(scenario)


def test_filter_sort_abort_all_and_pause(engine: str) -> None:
    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=SIZE) as pilot, AsyncEngineClient(engine, name="bench") as other:
            await connected_app(pilot)
            rids = ["keep-1", "drop-1", "drop-2", "drop-3", "keep-2"]  # four slots: keep-2 waits
            streams = [started(other, rid, priority=i) for i, rid in enumerate(rids)]
            await asyncio.gather(*(anext(s) for s in streams[:4]))
            waiting_first = asyncio.ensure_future(anext(streams[4]))
            await wait_for(pilot, lambda: set(rids[:4]) <= table_rids(app, "running") and
                           "keep-2" in table_rids(app, "waiting"), "four running, one waiting")
            running = table(app, "running")
            running.focus()
            await pilot.press("s", "s", "s", "s", "r")  # by priority, highest first
            assert running.sort_column == 3 and running.sort_reverse
            await wait_for(pilot, lambda: [running.get_row_at(i)[0].plain for i in range(running.row_count)]
                           == ["drop-3", "drop-2", "drop-1", "keep-1"], "the rows by priority")
            assert str(running.border_title).endswith("by prio ↓")

            await pilot.press("slash", *"drop", "enter")
            assert app.focused is running and app.ops.filter == "drop"
            await wait_for(pilot, lambda: table_rids(app, "running") == {"drop-1", "drop-2", "drop-3"} and
                           not table_rids(app, "waiting"), "only the matching rows")
            assert str(running.border_title).startswith("Running set (3 of 4)")
            assert "filter 'drop': 3 of 5" in shown(app.ops.query_one("#ops-marks", Static))

            await pilot.press("X")
            await wait_for(pilot, lambda: isinstance(app.screen, AbortScreen), "the confirmation")
            assert shown(app.screen.query_one(Label)) == "Abort the 3 requests matching 'drop'?"
            await pilot.press("y")
            for stream in streams[1:4]:
                assert (await drain(stream)).finish_reason == "abort"  # type: ignore[union-attr]
            await wait_for(pilot, lambda: any("aborted 3 of 3 requests" in str(n.message) for n in app._notifications),
                           "the report")
            await waiting_first  # keep-2 took a freed slot
            await wait_for(pilot, lambda: not table_rids(app, "running"), "no match left")
            assert app.last_stats is not None and {r.rid for r in app.last_stats.running} == {"keep-1", "keep-2"}

            await pilot.press("escape")  # the filter goes: the others show again
            await wait_for(pilot, lambda: table_rids(app, "running") == {"keep-1", "keep-2"}, "all rows back")
            await pilot.press("p")
            marks = app.ops.query_one("#ops-marks", Static)
            assert "PAUSED" in shown(marks) and app.ops.query_one("#ops-bar").display
            frozen = cell(running, "keep-1", "progress")
            seq = app.last_stats.seq
            await wait_for(pilot, lambda: app.last_stats.seq > seq + 2, "snapshots meanwhile")  # type: ignore[union-attr]
            assert cell(running, "keep-1", "progress") == frozen  # the view stands still
            await pilot.press("p")
            await wait_for(pilot, lambda: cell(running, "keep-1", "progress") != frozen, "the view moving again")
            assert not app.ops.query_one("#ops-bar").display
            for rid, stream in (("keep-1", streams[0]), ("keep-2", streams[4])):
                await other.abort(rid)
                await drain(stream)

    run(scenario)


def test_history_records_queue_running_and_kv_over_time(engine: str) -> None:
    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=SIZE) as pilot, AsyncEngineClient(engine) as other:
            await connected_app(pilot)
            await pilot.press("f5")  # the chat alone: the history keeps recording
            assert not app.ops.display
            rids = [f"hist-{i}" for i in range(6)]  # four run, two wait
            streams = [started(other, rid) for rid in rids]
            firsts = [asyncio.ensure_future(anext(s)) for s in streams]
            history = app.query_one(HistoryPanel)
            # a second of four running and two waiting (the first second may also count the six while they are
            # tokenized, as the waiting queue shows them: its peak is more than 2)
            await wait_for(pilot, lambda: 4 in history.history["running"] and 2 in history.history["waiting"] and
                           max(history.history["kv"]) > 0, "samples of the busy seconds", timeout=90)
            await pilot.press("f5")  # the panels again: the lines show what was recorded
            spark = history.query_one("#history-spark-running", Sparkline)
            await wait_for(pilot, lambda: max(spark.data or [0]) == 4, "the running line drawn")
            label = history.query_one("#history-running", Label)
            await wait_for(pilot, lambda: shown(label).startswith("running ") and "max 4" in shown(label), "the label")
            # a client without a name is shown by its number, not by hex
            assert app.last_stats is not None and {r.client for r in app.last_stats.running} == {
                app.last_stats.running[0].client} and app.last_stats.running[0].client.startswith("client ")
            # end them all: one may have reached its context's end on a fast machine, which is a Final too
            for rid in rids:
                try:
                    await other.abort(rid)
                except EngineError as e:
                    assert e.code == "unknown_request", e
            for first, stream in zip(firsts, streams, strict=True):
                final = await first
                final = final if isinstance(final, Final) else await drain(stream)
                assert isinstance(final, Final) and final.finish_reason in ("abort", "length"), final

    run(scenario)


def test_ops_panels_forget_the_requests_of_a_lost_engine(long_ckpt: Path, tmp_path: Path) -> None:
    """An engine that goes takes its requests with it: their rows go, and none is offered to abort."""
    address = f"ipc://{tmp_path}/lost.sock"
    handle = start(address, model=str(long_ckpt), timeout=120, **ENGINE_OPTIONS)

    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=address, autostart=False))
        async with app.run_test(size=SIZE) as pilot, AsyncEngineClient(address) as other:
            await connected_app(pilot)
            stream = started(other, "doomed")
            await anext(stream)
            await wait_for(pilot, lambda: "doomed" in table_rids(app, "running"), "the request shown")
            running = table(app, "running")
            running.focus()
            running.select("doomed")
            await pilot.press("x")
            await wait_for(pilot, lambda: isinstance(app.screen, AbortScreen), "the confirmation")
            handle.stop()
            await wait_for(pilot, lambda: app.link.state.kind == "lost", "the lost state")
            assert shown(app.screen.query_one(Label)) == "doomed has already finished: nothing to abort."
            await pilot.press("escape")
            assert not table_rids(app, "running") and running.selected_rid is None
            assert isinstance(app.ops, OpsPanels) and not app.ops.live
            assert isinstance(app.focused, RequestTable)

    try:
        run(scenario)
    finally:
        handle.stop()
