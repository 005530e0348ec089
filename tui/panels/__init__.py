"""The ops panels: live views of the engine's scheduler, fed from its stats stream.

Two groups, side by side when there is room and stacked otherwise: the scheduler's requests
(waiting queue, running set, step timeline) and its resources (request slots, KV pages, rates).
"""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Container, Vertical
from textual.events import Resize
from textual.widget import Widget

from engine.service.protocol import Stats
from tui.names import RequestNames
from tui.panels.grids import PageGrid, SlotGrid
from tui.panels.requests import RequestTable, RunningTable, WaitingTable
from tui.panels.steps import StepTimeline
from tui.panels.throughput import ThroughputPanel

# (id, title) in the order of their digit keys.
PANELS = (("waiting", "waiting queue"), ("running", "running set"), ("steps", "step timeline"),
          ("slots", "request slots"), ("pages", "KV pages"), ("throughput", "throughput"))
SIDE_BY_SIDE = 100  # columns from which the two groups sit next to each other

__all__ = ["PANELS", "OpsPanels", "RequestTable"]


@runtime_checkable
class StatsPanel(Protocol):
    """What every panel does: draw itself from a stats snapshot."""

    def show_stats(self, stats: Stats, names: RequestNames) -> None: ...


class OpsPanels(Container, can_focus=True):
    """Holds every panel and hands each stats snapshot to the visible ones. Focusable itself, so that its
    digit keys still work when every table is hidden."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding(str(i), f"app.toggle_panel('{panel_id}')", f"Show/hide the {title} panel", show=False)
        for i, (panel_id, title) in enumerate(PANELS, 1)]

    def compose(self) -> ComposeResult:
        with Vertical(classes="ops-group"):
            yield WaitingTable(id="waiting")
            yield RunningTable(id="running")
            yield StepTimeline(id="steps")
        with Vertical(classes="ops-group"):
            yield SlotGrid(id="slots")
            yield PageGrid(id="pages")
            yield ThroughputPanel(id="throughput")

    def show_stats(self, stats: Stats, names: RequestNames) -> None:
        for panel_id, _ in PANELS:
            panel = self.query_one(f"#{panel_id}", Widget)
            if panel.display and isinstance(panel, StatsPanel):
                panel.show_stats(stats, names)

    def toggle(self, panel_id: str) -> bool:
        """Show or hide one panel; a group with no visible panel gives its room to the other."""
        panel = self.query_one(f"#{panel_id}", Widget)
        panel.display = not panel.display
        for group in self.query(".ops-group"):
            group.display = any(child.display for child in group.children)
        return bool(panel.display)

    def on_resize(self, event: Resize) -> None:
        self.set_class(event.size.width >= SIDE_BY_SIDE, "-side-by-side")
