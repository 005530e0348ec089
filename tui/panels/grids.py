"""Request slots and KV pages drawn as grids of coloured cells, the way the seed pictures them.

A held slot or page takes the colour of the request holding it (the colour it has in every other
panel); the KV grid scales, one cell standing for several pages, when the pool outgrows the panel.
"""

from __future__ import annotations

import math
from collections import Counter

from rich.text import Text
from textual.geometry import Size
from textual.widget import Widget

from engine.protocol import Pages, Stats
from tui.names import RequestNames, colour

FREE = "grey35"
PAGE_GLYPHS = {"R": "█", "L": "▓", "c": "▒", ".": "·"}
PAGE_STYLES = {"L": "bold #ffffff", "c": "#5f87af", ".": FREE}


def wrap(cells: list[Text], per_row: int) -> Text:
    """Cells laid out left to right, `per_row` to a line."""
    lines = [Text("").join(cells[i:i + per_row]) for i in range(0, len(cells), per_row)]
    return Text("\n").join(lines)


class SlotGrid(Widget):
    """One cell per request slot (a row of the request table): free, or coloured by its request."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(classes="panel", **kwargs)  # type: ignore[arg-type]
        self.slots: list[str | None] = []
        self.border_title = "Request slots"

    def show_stats(self, stats: Stats, names: RequestNames) -> None:
        self.slots = stats.slots
        busy = sum(rid is not None for rid in self.slots)
        self.border_title = f"Request slots {busy}/{len(self.slots)}"
        self.refresh(layout=True)

    def _cell_width(self, width: int) -> int:
        """Wide cells ("██ ") while the slots fit in four lines, single characters beyond that."""
        return 3 if len(self.slots) * 3 <= max(width, 3) * 4 else 1

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        per_row = max(1, width // self._cell_width(width))
        return max(1, math.ceil(len(self.slots) / per_row))

    def render(self) -> Text:
        width = self._cell_width(self.size.width)
        glyph = "██ " if width == 3 else "█"
        empty = "░░ " if width == 3 else "░"
        cells = [Text(empty, FREE) if rid is None else Text(glyph, colour(rid)) for rid in self.slots]
        return wrap(cells, max(1, self.size.width // width))


class PageGrid(Widget):
    """One cell per KV page (or per group of pages, scaled to fit): free, held, cached or locked."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(classes="panel", **kwargs)  # type: ignore[arg-type]
        self.pages: Pages | None = None
        self.border_title = "KV pages"

    def show_stats(self, stats: Stats, names: RequestNames) -> None:
        p = self.pages = stats.pages
        self.border_title = (f"KV pages: {p.held} held, {p.locked} locked, {p.cached} cached, {p.free} free "
                             f"of {p.total} × {p.page_size} tok")
        per_cell = self.pages_per_cell()
        self.border_subtitle = "█ held ▓ locked ▒ cached · free" + (f" · 1 cell = {per_cell} pages"
                                                                     if per_cell > 1 else "")
        self.refresh()

    def pages_per_cell(self) -> int:
        room = max(1, self.size.width * self.size.height)
        return max(1, math.ceil(self.pages.total / room)) if self.pages else 1

    def render(self) -> Text:
        if self.pages is None:
            return Text("waiting for stats…", FREE)
        per_cell = self.pages_per_cell()
        return wrap([self._cell(i, per_cell) for i in range(0, self.pages.total, per_cell)], max(1, self.size.width))

    def _cell(self, first: int, count: int) -> Text:
        """The state most pages of the group are in; a held group takes its main owner's colour."""
        states = self.pages.states[first:first + count]  # type: ignore[union-attr]
        state = Counter(states).most_common(1)[0][0]
        if state != "R":
            return Text(PAGE_GLYPHS[state], PAGE_STYLES[state])
        owners = Counter(self.pages.owners.get(i) for i in range(first, first + count)  # type: ignore[union-attr]
                         if states[i - first] == "R")
        return Text(PAGE_GLYPHS["R"], colour(owners.most_common(1)[0][0] or ""))
