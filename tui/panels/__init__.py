"""The ops panels: live views of the engine's scheduler, fed from its stats stream.

Two groups, side by side when there is room and stacked otherwise: the scheduler's requests
(waiting queue, running set, step timeline) and its resources (request slots, KV pages, rates,
history). The panels act on what they show: a request is aborted (tui/panels/abort.py) or described
(tui/panels/detail.py) only while it is live, the tables can be filtered and sorted, and the whole
view can be paused (the snapshots keep coming: the history records them, the dialogs follow them).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Container, Horizontal, Vertical
from textual.events import Resize
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Input, Static

from engine.service.protocol import Stats
from tui.dialogs import AnswerInput
from tui.names import RequestNames
from tui.panels.abort import AbortScreen, LiveScreen
from tui.panels.base import update_text
from tui.panels.detail import RequestDetailScreen
from tui.panels.grids import PageGrid, SlotGrid
from tui.panels.history import HistoryPanel
from tui.panels.requests import RequestTable, RunningTable, WaitingTable
from tui.panels.steps import StepTimeline
from tui.panels.throughput import ThroughputPanel

if TYPE_CHECKING:
    from tui.link import EngineLink

# (id, title) in the order of their digit keys.
PANELS = (("waiting", "waiting queue"), ("running", "running set"), ("steps", "step timeline"),
          ("slots", "request slots"), ("pages", "KV pages"), ("throughput", "throughput"), ("history", "history"))
SIDE_BY_SIDE = 100  # columns from which the two groups sit next to each other
SHORT = 26  # rows below which, stacked, the throughput and history panels share a row (all on screen at 80x24;
# from 26 rows each has a row of its own)

__all__ = ["PANELS", "OpsPanels", "RequestTable"]


@runtime_checkable
class StatsPanel(Protocol):
    """What every panel does: draw itself from a stats snapshot."""

    def show_stats(self, stats: Stats, names: RequestNames) -> None: ...


class FilterInput(AnswerInput):
    """The request tables' filter: rows are kept while they contain every word typed."""


class OpsPanels(Container, can_focus=True):
    """Holds every panel and hands each stats snapshot to the visible ones. Focusable itself, so that its
    keys still work when every table is hidden."""

    BINDINGS: ClassVar[list[BindingType]] = [
        *(Binding(str(i), f"app.toggle_panel('{panel_id}')", f"Show/hide the {title} panel", show=False)
          for i, (panel_id, title) in enumerate(PANELS, 1)),
        Binding("slash", "filter", "Filter the request tables by id, owner or state", show=False, key_display="/"),
        Binding("X", "abort_matching", "Abort every request the filter matches (asks first)", show=False),
        Binding("p", "pause", "Pause / resume the live view", show=False),
        Binding("escape", "leave", "Clear the filter, else back to the prompt box", show=False),
    ]

    class Typed(Message):
        """A character typed in a table (or the panels) that is none of their keys: it belongs in the prompt
        box (the app puts it there), not nowhere."""

        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def __init__(self, link: EngineLink, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.link = link
        self.live: set[str] = set()  # requests waiting or running in the newest snapshot
        self.paused = False
        self.filter = ""
        self.latest: Stats | None = None  # the newest snapshot
        self.shown: Stats | None = None  # the one the panels show (older while paused)
        self._return_to: Widget | None = None  # where focus goes back to from the filter box

    def compose(self) -> ComposeResult:
        with Horizontal(id="ops-bar"):
            yield Static(id="ops-marks")
            yield FilterInput(placeholder="filter: words of an id, owner or state · enter: keep · escape: clear",
                              id="ops-filter")
        with Vertical(classes="ops-group"):
            yield WaitingTable(id="waiting")
            yield RunningTable(id="running")
            yield StepTimeline(id="steps")
        with Vertical(classes="ops-group ops-resources"):
            yield SlotGrid(id="slots")
            yield PageGrid(id="pages")
            yield ThroughputPanel(id="throughput")
            yield HistoryPanel(id="history")

    def on_mount(self) -> None:
        self.query_one("#ops-filter").display = False
        self.show_bar()

    @property
    def tables(self) -> list[RequestTable]:
        return list(self.query(RequestTable))

    def show_stats(self, stats: Stats, names: RequestNames) -> None:
        """Every snapshot, shown or not: the live requests (for the open dialogs), who sent them and the
        history are kept up; the panels draw it when they are shown and not paused."""
        self.latest = stats
        self.live = {w.rid for w in stats.waiting} | {r.rid for r in stats.running}
        clients = {w.rid: w.client for w in stats.waiting if w.client}
        names.learn(clients | {r.rid: r.client for r in stats.running if r.client})
        self.query_one(HistoryPanel).record(stats)
        for screen in self.app.screen_stack:
            if isinstance(screen, LiveScreen):
                screen.show_live(self.live)
        if self.display and not self.paused:
            self.draw(stats)

    def draw(self, stats: Stats) -> None:
        self.shown = stats
        for panel_id, _ in PANELS:
            panel = self.query_one(f"#{panel_id}", Widget)
            if panel.display and isinstance(panel, StatsPanel):
                panel.show_stats(stats, self.link.names)
        if self.filter:
            self.show_bar()  # the counts of matching rows

    def forget(self) -> None:
        """The engine is gone: no request of it is live any more, and none is offered to act on."""
        self.live = set()
        for screen in self.app.screen_stack:
            if isinstance(screen, LiveScreen):
                screen.show_live(self.live)
        for table in self.tables:
            table.forget()

    def toggle(self, panel_id: str) -> bool:
        """Show or hide one panel; a group with no visible panel gives its room to the other."""
        panel = self.query_one(f"#{panel_id}", Widget)
        panel.display = not panel.display
        for group in self.query(".ops-group"):
            group.display = any(child.display for child in group.children)
        return bool(panel.display)

    def focus_targets(self) -> list[Widget]:
        """What F6 moves through on this side: the visible tables, or the panels themselves."""
        tables: list[Widget] = [t for t in self.tables if t.display and t.parent is not None and t.parent.display]
        return tables or [self]

    def on_resize(self, event: Resize) -> None:
        side_by_side = event.size.width >= SIDE_BY_SIDE
        self.set_class(side_by_side, "-side-by-side")
        self.set_class(not side_by_side and event.size.height < SHORT, "-short")

    def on_key(self, event: events.Key) -> None:
        """A character that is none of the focused table's or the panels' keys (which stay theirs: `x`, `/`,
        the digits...) is passed on as Typed, before it would fall through to nothing."""
        focused = self.app.focused
        if not (event.is_printable and event.character) or not (isinstance(focused, RequestTable) or focused is self):
            return
        if event.key not in self.screen.active_bindings:
            event.stop()
            self.post_message(self.Typed(event.character))

    # -- acting on requests -----------------------------------------------------------------------
    def on_request_table_abort_requested(self, event: RequestTable.AbortRequested) -> None:
        event.stop()
        self.confirm_abort([event.rid])

    def on_request_table_detail_requested(self, event: RequestTable.DetailRequested) -> None:
        event.stop()
        self.app.push_screen(RequestDetailScreen(event.rid, self.link, lambda rid: self.confirm_abort([rid])))

    def on_request_table_redraw(self, event: RequestTable.Redraw) -> None:
        event.stop()
        if self.shown is not None and isinstance(event.control, RequestTable):
            event.control.show_stats(self.shown, self.link.names)

    def confirm_abort(self, rids: list[str], matching: str = "") -> None:
        """Ask, then abort those of `rids` still live (see tui/panels/abort.py)."""
        screen = AbortScreen(rids, self.link.names, self.live, matching)

        async def answered(yes: bool | None) -> None:
            if yes and screen.live_rids:
                await self.abort(screen.live_rids)

        self.app.push_screen(screen, answered)

    async def abort(self, rids: list[str]) -> None:
        results = Counter(await asyncio.gather(*(self.link.abort(rid) for rid in rids)))
        if len(rids) == 1:
            label = self.link.names.label(rids[0], 40)
            if results["aborted"]:
                self.notify(f"aborted {label}")
            elif results["finished"]:
                self.notify(f"{label} had already finished")
            else:
                self.notify(f"could not reach the engine to abort {label}", severity="error")
            return
        done = f"aborted {results['aborted']} of {len(rids)} requests"
        if results["finished"]:
            done += f"; {results['finished']} had already finished"
        if results["unreachable"]:
            self.notify(f"{done}; could not reach the engine for {results['unreachable']}", severity="error")
        else:
            self.notify(done)

    def action_abort_matching(self) -> None:
        if not self.filter:
            self.notify("type / and a filter first: X aborts every request it matches", severity="warning")
            return
        if self.latest is None:
            return
        words = self.filter.lower().split()
        names = self.link.names
        rids = [e.rid for table in self.tables for e in table.entries(self.latest)
                if all(w in table.haystack(e, names) for w in words)]
        if not rids:
            self.notify(f"no live request matches {self.filter!r}")
            return
        self.confirm_abort(rids, self.filter)

    # -- filter and pause -------------------------------------------------------------------------
    def action_filter(self) -> None:
        box = self.query_one("#ops-filter", FilterInput)
        box.display = True
        self.show_bar()
        if self.app.focused is not box:
            self._return_to = self.app.focused
        box.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        self.set_filter(event.value)

    def set_filter(self, text: str) -> None:
        """Filter the tables now, in the snapshot they show (also while paused)."""
        self.filter = text.strip()
        words = self.filter.lower().split()
        for table in self.tables:
            table.filter = words
            if self.shown is not None:
                table.show_stats(self.shown, self.link.names)
        self.show_bar()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.close_filter(keep=True)

    def close_filter(self, keep: bool) -> None:
        """Leave the filter box (clearing the filter unless `keep`), back to the panel it was opened from."""
        box = self.query_one("#ops-filter", FilterInput)
        if not keep:
            box.value = ""
            self.set_filter("")
        box.display = bool(self.filter)
        target = self._return_to
        (target if target is not None and target.display else self.focus_targets()[0]).focus()
        self.show_bar()

    def action_leave(self) -> None:
        if self.filter or self.query_one("#ops-filter").has_focus:
            self.close_filter(keep=False)
        else:
            self.screen.focus_next("PromptInput")  # the chat's prompt box, if it is shown

    def action_pause(self) -> None:
        self.paused = not self.paused
        if not self.paused and self.latest is not None:
            self.draw(self.latest)
        self.show_bar()

    def show_bar(self) -> None:
        """The line above the panels: PAUSED, and the filter with how many requests it keeps."""
        bar = self.query_one("#ops-bar")
        marks = Text()
        if self.paused:
            marks.append(" ⏸ PAUSED ", "bold reverse yellow").append(" p resumes ", "yellow")
        if self.filter:
            shown = sum(t.shown for t in self.tables)
            total = sum(t.total for t in self.tables)
            marks.append(f" filter {self.filter!r}: {shown} of {total} · X aborts them ", "bold cyan")
        update_text(self.query_one("#ops-marks", Static), marks)
        bar.display = self.paused or bool(self.filter) or bool(self.query_one("#ops-filter").display)
