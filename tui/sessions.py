"""The saved conversations as a searchable list: reopen, rename, delete, export one as Markdown.

The list reads the store each time the search changes (a LIKE over names, prompts and replies: a
person's history is thousands of turns, not millions). It only picks; what a choice does (open a
tab, ask for a name, confirm a delete) is the app's, so the screen answers with (action, uid).
"""

from __future__ import annotations

import time
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Input, Label

from tui.keys import InOrderKeys
from tui.names import printable
from tui.session import TITLE_WIDTH
from tui.store import SessionRow, Store

Choice = tuple[str, str]  # (open | rename | delete | export, session uid)
PREVIEW = 32  # characters of the last prompt and of the last reply in the list
NAME_WIDTH = TITLE_WIDTH  # characters of a name in the list (an automatic title's), and of a model's: with the
MODEL_WIDTH = 14  # turns and the dates, 80 columns hold them


def head(text: str, width: int = PREVIEW) -> str:
    """The start of `text` on one line, cut with `…`."""
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 1] + "…"


def preview(row: SessionRow) -> str:
    """The conversation's last exchange, e.g. `To be, or not to be → Ay, there's the rub`."""
    return printable(f"{head(row.last_prompt)} → {head(row.last_reply)}") if row.turns else ""


def when(epoch: float) -> str:
    """`14:05` today, `Mon 14:05` this week, `2025-11-02` before."""
    age = time.time() - epoch
    fmt = "%H:%M" if age < 86400 else "%a %H:%M" if age < 6 * 86400 else "%Y-%m-%d"
    return time.strftime(fmt, time.localtime(epoch))


class SearchInput(InOrderKeys, Input):
    """The search box: keys in the order typed."""


class SessionsScreen(ModalScreen[Choice | None]):
    """Type to search; enter opens the selected conversation; r / e / d on the list rename, export, delete."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "dismiss(None)", "Close"),
        Binding("down", "to_list", "To the list", show=False),
        Binding("r,f2", "choose('rename')", "Rename"),
        Binding("e", "choose('export')", "Export Markdown"),
        Binding("d,delete", "choose('delete')", "Delete"),
    ]

    def __init__(self, store: Store, search: str = "") -> None:
        super().__init__(classes="dialog")
        self.store, self.search = store, search
        self.rows: list[SessionRow] = []

    def compose(self) -> ComposeResult:
        with Vertical(id="sessions") as box:
            box.border_title = "Saved conversations"
            yield SearchInput(self.search, placeholder="search names, prompts and replies", id="sessions-search")
            yield DataTable(cursor_type="row", zebra_stripes=True, id="sessions-table")
            yield Label("type to search · enter: open · ↓: to the list, then r: rename · e: export Markdown · "
                        "d: delete · escape: close", classes="dialog-hint")

    def on_mount(self) -> None:
        # the preview last: it is what a narrow terminal cuts, not the dates
        self.query_one(DataTable).add_columns("conversation", "turns", "updated", "started", "model", "last exchange")
        self.show()

    def show(self) -> None:
        table = self.query_one(DataTable)
        table.clear()
        self.rows = self.store.sessions(self.search)
        for row in self.rows:
            table.add_row(printable(head(row.name, NAME_WIDTH)), str(row.turns), when(row.updated), when(row.created),
                          printable(head(row.model or "?", MODEL_WIDTH)), preview(row), key=row.uid)
        self.query_one(Label).update(f"{len(self.rows)} conversation{'s' * (len(self.rows) != 1)}"
                                     + (f" matching {self.search!r}" if self.search else "")
                                     + " · enter: open · ↓: to the list, then r: rename · e: export Markdown · "
                                       "d: delete · escape: close")

    def on_input_changed(self, event: Input.Changed) -> None:
        self.search = event.value
        self.show()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.action_choose("open")

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.action_choose("open")

    def action_to_list(self) -> None:
        self.query_one(DataTable).focus()

    @property
    def selected(self) -> str | None:
        table = self.query_one(DataTable)
        if not table.row_count:
            return None
        return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value

    def action_choose(self, action: str) -> None:
        if (uid := self.selected) is not None:
            self.dismiss((action, uid))
