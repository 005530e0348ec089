"""The last scheduler steps as a table: step, prefill or decode, and the requests in the batch.

Read top to bottom it shows continuous batching happen: a prefill step admits newcomers, decode
steps advance the running set one token each, and a finished request's place is taken at the next
prefill.
"""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.widget import Widget

from engine.service.protocol import Stats, StepRecord
from tui.names import RequestNames

KIND_STYLES = {"prefill": "bold magenta", "decode": "cyan", "mixed": "bold blue"}


class StepTimeline(Widget):
    """The newest steps that fit, oldest at the top (the engine keeps the last few dozen)."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, classes="panel")
        self.border_title = "Step timeline"
        self.steps: list[StepRecord] = []
        self.names = RequestNames()
        self._newest = -1  # index of the newest step shown

    def show_stats(self, stats: Stats, names: RequestNames) -> None:
        newest = stats.steps[-1].index if stats.steps else -1
        if newest == self._newest:
            return  # nothing new since the last snapshot (or none yet: the empty table is drawn already)
        self.steps, self.names, self._newest = stats.steps, names, newest
        self.refresh()

    def render(self) -> Table:
        table = Table(box=None, expand=True, padding=(0, 1), header_style="bold")
        table.add_column("step", justify="right", width=6)
        table.add_column("batch", width=7)
        table.add_column("tok", justify="right", width=5)
        table.add_column("ms", justify="right", width=6)
        table.add_column("members", no_wrap=True, overflow="ellipsis", ratio=1)
        for step in self.steps[-max(1, self.size.height - 1):]:
            members = Text(", ").join(self.names.styled(rid, 10) for rid in step.rids)
            table.add_row(str(step.index), Text(step.kind, KIND_STYLES.get(step.kind, "")), str(step.num_tokens),
                          f"{step.duration * 1e3:.1f}", members)
        return table
