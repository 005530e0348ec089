"""Request slots and KV pages drawn as grids of coloured cells, the way the seed pictures them.

A held slot or page takes the colour of the request holding it (the colour it has in every other
panel). Cells are as large as the panel allows; when items outnumber the room, one cell stands
for several items and shows what most of them are.
"""

from __future__ import annotations

import math
from collections import Counter

from rich.text import Text
from textual.geometry import Size
from textual.widget import Widget

from engine.service.protocol import Stats
from tui.names import RequestNames
from tui.panels.base import set_titles

Item = tuple[str, str]  # (glyph, style)
FREE: Item = ("░", "grey35")
PAGE_STATES: dict[str, Item] = {".": FREE, "c": ("▒", "#5f87af"), "L": ("▓", "bold #ffffff")}
SLOT_ROWS = 4  # the slot grid grows to at most this many lines before its cells shrink


def fit(count: int, width: int, rows: int) -> tuple[int, int]:
    """(cell width, items per cell): the widest cells (3, 2 or 1 columns) that fit `count` items in
    `rows` lines of `width` columns, else 1-column cells that each stand for several items."""
    for cell in (3, 2, 1):
        if math.ceil(count / max(1, width // cell)) <= rows:
            return cell, 1
    return 1, math.ceil(count / max(1, width * rows))


class CellGrid(Widget):
    """One cell per item, in rows as wide as the widget."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, classes="panel")
        self.items: list[Item] = []
        self._drawn: object = None  # what the grid was last drawn from: the same again draws nothing

    def set_items(self, items: list[Item]) -> None:
        """Redraw only on change: an idle engine sends the same picture four times a second."""
        if items != self.items:
            self.items = items
            self.refresh(layout=True)

    def render(self) -> Text:
        cell, per_cell = fit(len(self.items), self.size.width, max(1, self.size.height))
        per_row = max(1, self.size.width // cell) * per_cell  # items per line
        text = Text()
        for first in range(0, len(self.items), per_cell):
            if first and first % per_row == 0:
                text.append("\n")
            glyph, style = Counter(self.items[first:first + per_cell]).most_common(1)[0][0]
            text.append(glyph * max(1, cell - 1) + " " * (cell > 1), style)
        return text


class SlotGrid(CellGrid):
    """One cell per request slot (a row of the request table): free, or coloured by its request."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "Request slots"

    def show_stats(self, stats: Stats, names: RequestNames) -> None:
        if stats.slots == self._drawn:
            return
        self._drawn = stats.slots
        self.set_items([FREE if rid is None else ("█", names.colour(rid)) for rid in stats.slots])
        busy = sum(rid is not None for rid in stats.slots)
        set_titles(self, f"Request slots {busy}/{len(stats.slots)}")

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        cell, per_cell = fit(len(self.items), width, SLOT_ROWS)
        return max(1, math.ceil(len(self.items) / per_cell / max(1, width // cell)))


class PageGrid(CellGrid):
    """One cell per KV page (or per group of pages): free, held by a request, cached, or cached and
    locked (a running request reads it)."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "KV pages"

    def show_stats(self, stats: Stats, names: RequestNames) -> None:
        p = stats.pages
        if (p, self.size) == self._drawn:  # the size too: it sets how many pages a cell stands for
            return
        self._drawn = (p, self.size)
        self.set_items([("█", names.colour(p.owners.get(i, ""))) if state == "R" else PAGE_STATES[state]
                        for i, state in enumerate(p.states)])
        _, per_cell = fit(p.total, self.size.width, max(1, self.size.height))
        set_titles(self, f"KV pages: {p.held} held (+{p.claimed} claimed), {p.locked} locked, {p.cached} cached, "
                         f"{p.free} free of {p.total} × {p.page_size} tok",
                   "█ held ▓ locked ▒ cached ░ free" + (f" · 1 cell = {per_cell} pages" if per_cell > 1 else ""))

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return max(1, math.ceil(len(self.items) / max(1, width)))
