"""The waiting queue and the running set as tables, one row per request, any of which can be aborted.

Rows are keyed by request id and updated in place, and the selection is a request id, not a row
number: rows come and go several times a second, and `x` must abort the request the person chose.
"""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.widgets import DataTable

from engine.service.protocol import RunningReq, Stats
from tui.names import RequestNames
from tui.panels.base import same_text, set_titles

Row = tuple[Text | str, ...]


def bar(done: int, total: int, width: int = 10) -> Text:
    """A progress bar with the numbers after it, e.g. `█████░░░░░ 12/24`."""
    filled = round(width * done / total) if total else 0
    return Text.assemble(("█" * filled, "green"), ("░" * (width - filled), "grey39"), f" {done}/{total}")


RETRACTED = "bold magenta"
REASONS = {"slot": ("no free slot", "bold red"), "kv_pages": ("KV pages", "bold yellow"),
           "token_budget": ("token budget", "green"), "queue": ("its turn", "grey62"),
           "sibling": ("first choice's prompt", "cyan")}


def reason(code: str, retractions: int = 0, kept: int = 0) -> Text:
    """Why a request waits, in words (an older engine sends no reason); a retracted request says so
    first, with how often and the tokens it keeps, e.g. `retracted ×2 · keeps 40 tok · KV pages`."""
    text, style = REASONS.get(code, (code or "?", ""))
    if not retractions:
        return Text(text, style)
    return Text.assemble((f"retracted ×{retractions}", RETRACTED), f" · keeps {kept} tok · ", (text, style))


def retracted(count: int) -> Text:
    """A running request's retraction count: blank until it has been sent back to the queue."""
    return Text(f"×{count}", RETRACTED) if count else Text("")


class RequestTable(DataTable):
    """A table of live requests; `x` or delete asks the app to abort the selected request (it confirms)."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("x,delete", "abort_request", "Abort the selected request")]
    COLUMNS: ClassVar[tuple[str, ...]] = ()
    TITLE: ClassVar[str] = ""

    class AbortRequested(Message):
        def __init__(self, rid: str) -> None:
            super().__init__()
            self.rid = rid

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, id=id, classes="panel")
        self.border_title = self.TITLE
        self.border_subtitle = "x: abort"
        self.selected_rid: str | None = None
        self._drawn_part: object = None
        self._drawn_rows: dict[str, Row] = {}  # request id -> the cells it shows

    def on_mount(self) -> None:
        self.add_columns(*self.COLUMNS)
        self.show_cursor = False

    def on_focus(self) -> None:
        self.show_cursor = True  # the selection matters only to the person about to press x

    def on_blur(self) -> None:
        self.show_cursor = False

    def snapshot_part(self, stats: Stats) -> object:
        """The part of a snapshot this table shows: when it did not change, the table draws nothing."""
        raise NotImplementedError

    def snapshot_rows(self, stats: Stats, names: RequestNames) -> dict[str, Row]:
        """Request id -> the row's cells, for this snapshot."""
        raise NotImplementedError

    def show_stats(self, stats: Stats, names: RequestNames) -> None:
        part = self.snapshot_part(stats)
        if self._drawn_part is not None and part == self._drawn_part:
            return  # an idle engine, or news for the other panels only
        self._drawn_part = part
        rows = self.snapshot_rows(stats, names)
        drawn, self._drawn_rows = self._drawn_rows, rows
        for rid in drawn.keys() - rows.keys():
            self.remove_row(rid)
        columns = list(self.columns)
        for rid, cells in rows.items():
            if (old := drawn.get(rid)) is None:
                self.add_row(*cells, key=rid)
                continue
            for column, cell, was in zip(columns, cells, old, strict=True):
                if not same_text(cell, was):  # only the cells that changed (a decoding request's progress)
                    self.update_cell(rid, column, cell, update_width=True)
        if self.selected_rid in rows:  # the cursor follows the request, wherever its row moved
            self.move_cursor(row=self.get_row_index(self.selected_rid))
        set_titles(self, f"{self.TITLE} ({len(rows)})")

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        # A moved cursor (a key, a click) selects its row. A row removed above the cursor shifts the
        # cursor onto another request too, but show_stats has moved it back by the time this message
        # is read: a highlight the cursor no longer shows is stale and selects nothing.
        if self.row_count and event.cursor_row == self.cursor_row and \
                event.row_key == self.coordinate_to_cell_key(self.cursor_coordinate).row_key:
            self.selected_rid = event.row_key.value

    def select(self, rid: str) -> None:
        """Select a request (a person's choice, as a cursor move would)."""
        self.selected_rid = rid
        self.move_cursor(row=self.get_row_index(rid))

    def action_abort_request(self) -> None:
        if (rid := self.selected_rid) is not None:
            self.post_message(self.AbortRequested(rid))


class WaitingTable(RequestTable):
    """The waiting queue in admission order (the engine's --schedule-policy: arrival, priority or longest
    cached prefix; a retracted request goes back ahead of its equals): admission takes from the top and
    stops at the first misfit."""

    TITLE = "Waiting queue"
    COLUMNS = ("request", "prio", "prompt", "waited", "waiting for")

    def snapshot_part(self, stats: Stats) -> object:
        return stats.waiting

    def snapshot_rows(self, stats: Stats, names: RequestNames) -> dict[str, Row]:
        return {w.rid: (names.styled(w.rid), str(w.priority), str(w.prompt_tokens), f"{w.waited:.1f}s",
                        reason(w.reason, w.retractions, w.generated))
                for w in stats.waiting}


class RunningTable(RequestTable):
    """Requests holding a request slot: a prompt mid-chunk (prefilling) or generating (running), with
    how often each was retracted (sent back to the queue when the KV pool ran dry) so far."""

    TITLE = "Running set"
    COLUMNS = ("request", "slot", "prio", "state", "progress", "pages", "retracted")

    def snapshot_part(self, stats: Stats) -> object:
        return stats.running

    def snapshot_rows(self, stats: Stats, names: RequestNames) -> dict[str, Row]:
        return {r.rid: (names.styled(r.rid), str(r.slot), str(r.priority), *self._progress(r), str(r.pages),
                        retracted(r.retractions))
                for r in stats.running}

    @staticmethod
    def _progress(r: RunningReq) -> tuple[Text, Text]:
        if r.state == "prefilling":
            return Text("prefill", "magenta"), bar(r.prefilled, r.prompt_tokens)
        return Text("decode", "cyan"), bar(r.generated, r.max_tokens)
