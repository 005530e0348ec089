"""The waiting queue and the running set as tables, one row per request, any of which can be aborted
or opened in detail.

Rows are keyed by request id and updated in place, and the selection is a request id, not a row
number: rows come and go several times a second, and `x` must abort the request the person chose.
When the chosen request's row goes (it finished, or the filter hides it), the selection moves to the
row that took its place, or is cleared when none is left: it never names a request that is not shown.
A filter (set by the ops panels' `/`) keeps the rows whose id, owner or state contain every word of
it; `s` sorts by the next column (engine order first and last), `r` reverses.
"""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.binding import Binding, BindingType
from textual.coordinate import Coordinate
from textual.message import Message
from textual.widgets import DataTable

from engine.scheduler.snapshot import Speculation
from engine.service.protocol import RunningEntry, Stats, WaitingEntry
from tui.names import RequestNames
from tui.panels.base import same_text, set_titles

Row = tuple[Text | str, ...]
Entry = WaitingEntry | RunningEntry
OWNER_WIDTH = 12


def bar(done: int, total: int, width: int = 10) -> Text:
    """A progress bar with the numbers after it, e.g. `█████░░░░░ 12/24`."""
    filled = round(width * done / total) if total else 0
    return Text.assemble(("█" * filled, "green"), ("░" * (width - filled), "grey39"), f" {done}/{total}")


RETRACTED = "bold magenta"
REASONS = {"slot": ("no free slot", "bold red"), "kv_pages": ("KV pages", "bold yellow"),
           "token_budget": ("token budget", "green"), "queue": ("its turn", "grey62"),
           "sibling": ("first choice's prompt", "cyan"), "tokenizing": ("tokenizing", "grey62"),
           "compiling grammar": ("compiling grammar", "bold cyan"), "loading_kv": ("loading KV", "bold magenta")}


def reason(code: str, retractions: int = 0, kept: int = 0) -> Text:
    """Why a request waits, in words (an older engine sends no reason); a retracted request says so
    first, with how often and the tokens it keeps, e.g. `retracted ×2 · keeps 40 tok · KV pages`."""
    text, style = REASONS.get(code, (code or "?", ""))
    if not retractions:
        return Text(text, style)
    return Text.assemble((f"retracted ×{retractions}", RETRACTED), f" · keeps {kept} tok · ", (text, style))




def drafts(spec: Speculation | None) -> str:
    """A running request's speculative drafts, accepted of verified, for its state cell, e.g. ` 41/52`; empty while
    it has verified none."""
    return f" {spec.accepted_tokens}/{spec.draft_tokens}" if spec is not None and spec.verifications else ""


def owner(rid: str, names: RequestNames) -> Text:
    """The owner column: this console's own requests, or the engine's label for the client that sent it."""
    text = "this console" if names.is_own(rid) else names.owner(rid)
    return Text(text if len(text) <= OWNER_WIDTH else text[: OWNER_WIDTH - 1] + "…", "grey70")


def matches(words: list[str], haystack: str) -> bool:
    return all(word in haystack for word in words)


class RequestTable(DataTable):
    """A table of live requests: `x` or delete asks to abort the selected request (the ops panels confirm),
    enter opens it in detail, `s` / `r` sort."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("x,delete", "abort_request", "Abort", tooltip="Abort the selected request (asks first)"),
        Binding("s", "sort", "Sort by the next column (engine order first and last)", show=False),
        Binding("r", "reverse", "Reverse the sort order", show=False),
    ]
    COLUMNS: ClassVar[tuple[str, ...]] = ()
    TITLE: ClassVar[str] = ""

    class AbortRequested(Message):
        def __init__(self, rid: str) -> None:
            super().__init__()
            self.rid = rid

    class DetailRequested(Message):
        """Enter on a row: show that request in detail."""

        def __init__(self, rid: str) -> None:
            super().__init__()
            self.rid = rid

    class Redraw(Message):
        """The table's order changed: the ops panels draw it again from the snapshot they show."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, id=id, classes="panel")
        self.border_title = self.TITLE
        self.border_subtitle = "x abort · enter detail · s sort · / filter · p pause"
        self.selected_rid: str | None = None
        self.filter: list[str] = []  # lower-case words a row must all contain
        self.sort_column: int | None = None  # None: the engine's order
        self.sort_reverse = False
        self.shown = 0  # rows shown, of `total` live
        self.total = 0
        self._drawn_part: object = None
        self._drawn_rows: dict[str, Row] = {}  # request id -> the cells it shows
        self._drawing = False  # `draw` moves the cursor: its moves are not a person's

    def on_mount(self) -> None:
        self.add_columns(*self.COLUMNS)
        self.show_cursor = False

    def on_focus(self) -> None:
        self.show_cursor = True  # the selection matters only to the person about to press x

    def on_blur(self) -> None:
        self.show_cursor = False

    def entries(self, stats: Stats) -> list[Entry]:
        """The requests this table shows, in the engine's order."""
        raise NotImplementedError

    def cells(self, entry: Entry, names: RequestNames) -> Row:
        """One request's row."""
        raise NotImplementedError

    def state(self, entry: Entry) -> str:
        """The words a filter finds a request's state by."""
        raise NotImplementedError

    def sort_value(self, entry: Entry, column: int, names: RequestNames) -> str | float:
        """What the column sorts by (numbers as numbers)."""
        raise NotImplementedError

    def haystack(self, entry: Entry, names: RequestNames) -> str:
        """What a filter looks in: the request's id and label, its owner and its state."""
        return f"{entry.rid} {names.label(entry.rid, 200)} {names.owner(entry.rid)} {self.state(entry)}".lower()

    def wanted(self, stats: Stats, names: RequestNames) -> list[Entry]:
        """The requests the filter keeps, in the chosen order."""
        entries = self.entries(stats)
        self.total = len(entries)
        if self.filter:
            entries = [e for e in entries if matches(self.filter, self.haystack(e, names))]
        if (column := self.sort_column) is not None:
            entries.sort(key=lambda e: self.sort_value(e, column, names), reverse=self.sort_reverse)
        self.shown = len(entries)
        return entries

    def show_stats(self, stats: Stats, names: RequestNames) -> None:
        part = (self.entries(stats), self.filter, self.sort_column, self.sort_reverse)
        if self._drawn_part is not None and part == self._drawn_part:
            return  # an idle engine, or news for the other panels only
        self._drawn_part = part
        self.draw({e.rid: self.cells(e, names) for e in self.wanted(stats, names)})

    def draw(self, rows: dict[str, Row]) -> None:
        """Show `rows` in their order, touching only what changed when the order allows, and keep the
        selection on a shown request."""
        self._drawing = True
        try:
            self._draw(rows)
        finally:
            self._drawing = False
        self.show_title()

    def _draw(self, rows: dict[str, Row]) -> None:
        drawn, self._drawn_rows = self._drawn_rows, rows
        order = list(drawn)
        at = order.index(self.selected_rid) if self.selected_rid in drawn else None
        for rid in drawn.keys() - rows.keys():
            self.remove_row(rid)
        kept = [rid for rid in order if rid in rows]
        if kept + [rid for rid in rows if rid not in drawn] != list(rows):  # reordered: rows go in afresh
            self.clear()
            drawn = {}
        columns = list(self.columns)
        for rid, cells in rows.items():
            if (old := drawn.get(rid)) is None:
                self.add_row(*cells, key=rid)
                continue
            for column, cell, was in zip(columns, cells, old, strict=True):
                if not same_text(cell, was):  # only the cells that changed (a decoding request's progress)
                    self.update_cell(rid, column, cell, update_width=True)
        if self.selected_rid not in rows and at is not None:  # its row went: the one now in its place
            self.selected_rid = list(rows)[min(at, len(rows) - 1)] if rows else None
        if self.selected_rid is None and rows:  # the first rows: the cursor's is the selection
            self.selected_rid = self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value
        if self.selected_rid in rows:  # the cursor follows the request, wherever its row moved
            self.move_cursor(row=self.get_row_index(self.selected_rid))

    def show_title(self) -> None:
        count = f"{self.shown} of {self.total}" if self.filter else str(self.total)
        order = ""
        if self.sort_column is not None:
            order = f" · by {self.COLUMNS[self.sort_column]} {'↓' if self.sort_reverse else '↑'}"
        set_titles(self, f"{self.TITLE} ({count}){order}")

    def forget(self) -> None:
        """Drop every row (the engine they came from is gone)."""
        self._drawn_part = None
        self.draw({})

    def watch_cursor_coordinate(self, old: Coordinate, new: Coordinate) -> None:
        """A cursor moved by a person (a key, a click) selects its row at once, not when its highlight message is
        read: a snapshot drawn in between would put the cursor back on the old selection. Moves of `draw`'s own
        (rows removed above the cursor, rows put in afresh) select nothing: it places the cursor on the selection."""
        super().watch_cursor_coordinate(old, new)
        if not self._drawing and self.row_count and new.row < self.row_count:
            self.selected_rid = self.coordinate_to_cell_key(new).row_key.value

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        if event.row_key.value is not None:
            self.post_message(self.DetailRequested(event.row_key.value))

    def select(self, rid: str) -> None:
        """Select a request (a person's choice, as a cursor move would)."""
        self.selected_rid = rid
        self.move_cursor(row=self.get_row_index(rid))

    def action_abort_request(self) -> None:
        if (rid := self.selected_rid) is not None and rid in self._drawn_rows:
            self.post_message(self.AbortRequested(rid))

    def action_sort(self) -> None:
        column = -1 if self.sort_column is None else self.sort_column
        self.sort_column = column + 1 if column + 1 < len(self.COLUMNS) else None
        self.sort_reverse = False
        self.post_message(self.Redraw())

    def action_reverse(self) -> None:
        self.sort_reverse = not self.sort_reverse
        self.post_message(self.Redraw())


class WaitingTable(RequestTable):
    """The waiting queue in admission order (the engine's --schedule-policy: arrival, priority or longest
    cached prefix; a retracted request goes back ahead of its equals): admission takes from the top and
    stops at the first misfit."""

    TITLE = "Waiting queue"
    COLUMNS = ("request", "owner", "prio", "prompt", "waited", "waiting for")

    def entries(self, stats: Stats) -> list[Entry]:
        return list(stats.waiting)

    def cells(self, entry: Entry, names: RequestNames) -> Row:
        assert isinstance(entry, WaitingEntry)
        return (names.styled(entry.rid), owner(entry.rid, names), str(entry.priority), str(entry.prompt_tokens),
                f"{entry.waited:.1f}s", reason(entry.reason, entry.retractions, entry.generated))

    def state(self, entry: Entry) -> str:
        assert isinstance(entry, WaitingEntry)
        return f"waiting {reason(entry.reason, entry.retractions, entry.generated).plain}"

    def sort_value(self, entry: Entry, column: int, names: RequestNames) -> str | float:
        assert isinstance(entry, WaitingEntry)
        return (names.label(entry.rid, 200), names.owner(entry.rid), entry.priority, entry.prompt_tokens,
                entry.waited, entry.reason)[column]


class RunningTable(RequestTable):
    """Requests holding a request slot: a prompt mid-chunk (prefilling) or generating (running), its state
    marked with how often it was retracted (sent back to the queue when the KV pool ran dry) so far and, with
    speculative decoding, its drafts accepted of verified, e.g. `decode ×2 41/52`: columns of their own did not
    fit the 80 columns a split gives the panels."""

    TITLE = "Running set"
    COLUMNS = ("request", "owner", "slot", "prio", "state", "progress", "pages")
    BAR = 8  # cells of the progress bar: with the numbers after it, the row fits 80 columns

    def entries(self, stats: Stats) -> list[Entry]:
        return list(stats.running)

    def cells(self, entry: Entry, names: RequestNames) -> Row:
        assert isinstance(entry, RunningEntry)
        return (names.styled(entry.rid), owner(entry.rid, names), str(entry.slot), str(entry.priority),
                *self._progress(entry), str(entry.pages))

    def state(self, entry: Entry) -> str:
        assert isinstance(entry, RunningEntry)
        retracted = f" retracted ×{entry.retractions}" if entry.retractions else ""
        speculating = " drafts" if entry.spec is not None and entry.spec.verifications else ""
        return ("prefilling prefill" if entry.state == "prefilling" else "running decode") + retracted + speculating

    def sort_value(self, entry: Entry, column: int, names: RequestNames) -> str | float:
        assert isinstance(entry, RunningEntry)
        done = entry.prefilled / max(1, entry.prompt_tokens) if entry.state == "prefilling" else \
            1 + entry.generated / max(1, entry.max_tokens)
        return (names.label(entry.rid, 200), names.owner(entry.rid), entry.slot, entry.priority,
                f"{entry.state} {entry.retractions:09d}", done, entry.pages)[column]

    def _progress(self, r: RunningEntry) -> tuple[Text, Text]:
        state = Text("prefill", "magenta") if r.state == "prefilling" else Text("decode", "cyan")
        if r.retractions:
            state.append(f" ×{r.retractions}", RETRACTED)
        state.append(drafts(r.spec), "green")
        if r.state == "prefilling":
            return state, bar(r.prefilled, r.prompt_tokens, self.BAR)
        return state, bar(r.generated, r.max_tokens, self.BAR)
