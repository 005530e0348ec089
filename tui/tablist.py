"""The open tabs as a numbered list, to jump to one by its number.

alt+digit, the usual tab key, does not reach an app inside tmux (and ctrl+digit reaches few
terminals at all), so the jump is two keys that every terminal passes: ctrl+t opens this list, and
a digit picks the tab; enter picks the selected one for tabs past the ninth (or `/tab N`).
"""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Label

from tui.names import printable
from tui.session import Session


def doing(session: Session) -> str:
    """What the tab is doing: streaming, or its last reply's state (done, aborted…), and its fan-out group."""
    state = "streaming" if session.live else session.turns[-1].reply.state if session.turns else "empty"
    return state + (f" · {session.group}, not saved" if session.group else "")


class TabsScreen(ModalScreen[int | None]):
    """Answers with the 0-based index of the tab chosen, or None."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "dismiss(None)", "Close"),
        *[Binding(str(n), f"dismiss({n - 1})", "Go to that tab" if n == 1 else "", key_display="1…9",
                  show=False) for n in range(1, 10)],
    ]

    def __init__(self, sessions: list[Session], current: int) -> None:
        """`sessions`: the open tabs' sessions, in the tab bar's order; `current`: the front one's index."""
        super().__init__(classes="dialog")
        self.sessions, self.current = sessions, current

    def compose(self) -> ComposeResult:
        with Vertical(id="tab-list") as box:
            box.border_title = "Open tabs"
            yield DataTable(cursor_type="row", zebra_stripes=True)
            yield Label("1…9: go to that tab · ↑↓ enter: the selected one · escape: close", classes="dialog-hint")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("#", "tab", "")
        for n, session in enumerate(self.sessions, 1):
            table.add_row(str(n), printable(session.name), doing(session))
        table.move_cursor(row=self.current)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.dismiss(event.cursor_row)
