"""Request slots and KV pages drawn as grids of coloured cells.

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

from engine.pages import CACHED, FREE, HELD, LOCKED, cells, paint
from engine.service.protocol import Stats
from tui.names import RequestNames
from tui.panels.base import pack, set_titles
from tui.status import kv_tiers

Item = tuple[str, str]  # (glyph, style)
FREE_ITEM: Item = ("░", "grey35")
PAGE_STATES: dict[str, Item] = {FREE: FREE_ITEM, CACHED: ("▒", "#5f87af"), LOCKED: ("▓", "bold #ffffff")}
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
        return self.render_cells(self.size.width, max(1, self.size.height))

    def render_cells(self, width: int, rows: int) -> Text:
        """The items as cells in `rows` lines of `width` columns (cells share items when they must)."""
        cell, per_cell = fit(len(self.items), width, rows)
        per_row = max(1, width // cell) * per_cell  # items per line
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
        self.set_items([FREE_ITEM if rid is None else ("█", names.colour(rid)) for rid in stats.slots])
        busy = sum(rid is not None for rid in stats.slots)
        set_titles(self, f"Request slots {busy}/{len(stats.slots)}")

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        cell, per_cell = fit(len(self.items), width, SLOT_ROWS)
        return max(1, math.ceil(len(self.items) / per_cell / max(1, width // cell)))


class PageGrid(CellGrid):
    """One cell per KV page (or per group of pages): free, held by a request, cached, or cached and
    locked (a running request reads it). Above the cells, the counts of each, how the engine admits
    requests into the pages (reserve, or optimistic and what it expects of their output now) and in
    which order, and the KV tiers (pool, host memory, disk: what each holds and the prompt tokens it served):
    in lines that wrap between those parts, where a title would be cut at 80 columns.
    A pool larger than the panel is summarised from its runs (engine/pages.py) straight into as many
    cells as fit, so a 600,000-page pool costs a few byte scans, not 600,000 items."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "KV pages"
        self.header: list[str] = []  # the parts of the lines above the cells, laid out to the width

    def show_stats(self, stats: Stats, names: RequestNames) -> None:
        p, c = stats.pages, stats.counters
        hits = (c.hit_tokens_pool, c.hit_tokens_host, c.hit_tokens_disk)
        drawn = (p, hits, self.size, stats.admission, stats.policy)  # the size too: it sets pages per cell
        if drawn == self._drawn:
            return
        self._drawn = drawn
        header = [f"{p.held} held (+{p.claimed} claimed)", f"{p.locked} locked", f"{p.cached} cached",
                  f"{p.free} free of {p.total} × {p.page_size} tok",
                  *(part for part in (stats.admission and f"admission {stats.admission}",
                                      stats.policy and f"queue order {stats.policy}") if part),
                  *kv_tiers(stats, brief=True)]
        if header != self.header:
            width = self.size.width  # counts change at every step of a busy engine; the line count seldom
            lines = len(pack(self.header, width))
            self.header = header
            self.refresh(layout=len(pack(header, width)) != lines)
        _, per_cell = fit(p.total, self.size.width, self.grid_rows(self.size.width, self.size.height))
        states, holders = paint(p.total, p.runs, p.owners)
        self.set_items([("█", names.colour(holder)) if state == HELD else PAGE_STATES[state]
                        for state, holder in cells(states, holders, per_cell)])
        set_titles(self, f"KV pages {p.held + p.locked}/{p.total} used" + (f" · {p.dtype}" if p.dtype else ""),
                   "█ held ▓ locked ▒ cached ░ free" + (f" · 1 cell = {per_cell} pages" if per_cell > 1 else ""))

    def header_lines(self, width: int) -> list[Text]:
        """The header's parts joined by ` · `, wrapped between parts (a part longer than the line
        between its words) to `width`."""
        return [Text(line, "grey62") for line in pack(self.header, width)]

    def grid_rows(self, width: int, height: int) -> int:
        """Lines left for the cells under the header (at least one)."""
        return max(1, height - len(self.header_lines(width)))

    def render(self) -> Text:
        width = self.size.width
        header = self.header_lines(width)
        grid = self.render_cells(width, self.grid_rows(width, self.size.height))
        return Text("\n").join([*header, grid])

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return len(self.header_lines(width)) + max(1, math.ceil(len(self.items) / max(1, width)))
