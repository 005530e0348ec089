"""The model picker (f9, `/model`): a catalogue's models with their format, size and whether their engine runs;
enter gives the chosen id to the app, which moves the front chat to that model's engine."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Label

from tui.names import printable
from tui.shelf import Row


class ModelsScreen(ModalScreen[str | None]):
    """Answers with the id of the model chosen, or None."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "dismiss(None)", "Close")]

    def __init__(self, rows: list[Row], current: str | None) -> None:
        super().__init__(classes="dialog")
        self.rows, self.current = rows, current

    def compose(self) -> ComposeResult:
        with Vertical(id="model-list") as box:
            box.border_title = "Models"
            yield DataTable(cursor_type="row", zebra_stripes=True)
            yield Label("↑↓ enter: this chat talks to that model (its engine starts if need be) · escape: close",
                        classes="dialog-hint")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("model", "format", "size", "engine")
        for row in self.rows:
            mark = "▶ " if row.id == self.current else "  "
            table.add_row(mark + printable(row.id), row.format, row.size, row.state, key=row.id)
        at = next((i for i, row in enumerate(self.rows) if row.id == self.current), 0)
        table.move_cursor(row=at)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.dismiss(self.rows[event.cursor_row].id)
