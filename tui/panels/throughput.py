"""Token rates as sparklines and the engine's counters: is it busy, and what has it done so far."""

from __future__ import annotations

from collections import deque

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.geometry import Size
from textual.widgets import Label, Sparkline, Static

from engine.service.protocol import Stats
from tui.names import RequestNames
from tui.panels.base import pack, update_text

HISTORY = 120  # samples kept per sparkline (30 s at the link's four snapshots a second)
RATES = (("decode", "decode_tokens_per_s", "tok/s"), ("prefill", "prefill_tokens_per_s", "tok/s"),
         ("steps", "steps_per_s", "/s"))


class Totals(Static):
    """The engine's totals, in as many lines as the width needs, broken between totals (one line of them
    was cut off at 80 columns)."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.parts: list[str] = []

    def set_parts(self, parts: list[str]) -> None:
        if parts != self.parts:
            width = self.size.width
            lines = len(pack(self.parts, width))
            self.parts = parts
            self.refresh(layout=len(pack(parts, width)) != lines)

    def render(self) -> Text:
        return Text("\n".join(pack(self.parts, self.size.width)))

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return max(1, len(pack(self.parts, width)))


class ThroughputPanel(Vertical):
    """Prefill and decode tokens per second, steps per second, and the totals since the engine started.

    A sparkline is a time axis: it starts full of zeros and moves one sample per snapshot, so a burst
    scrolls away while the engine idles. Once a line is flat (an engine idle for HISTORY snapshots),
    another equal sample changes nothing and draws nothing.
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, classes="panel")
        self.border_title = "Throughput"
        self.history = {name: deque([0.0] * HISTORY, maxlen=HISTORY) for name, _, _ in RATES}

    def compose(self) -> ComposeResult:
        for name, _, _ in RATES:
            with Horizontal(classes="rate", id=f"rate-row-{name}"):
                yield Label(name, id=f"rate-{name}", classes="rate-label")
                yield Sparkline(list(self.history[name]), summary_function=max, id=f"spark-{name}")
        yield Totals(id="counters")

    def on_mount(self) -> None:
        self._sparks = {name: self.query_one(f"#spark-{name}", Sparkline) for name, _, _ in RATES}
        self._labels = {name: self.query_one(f"#rate-{name}", Label) for name, _, _ in RATES}
        self._counters = self.query_one("#counters", Totals)

    def show_stats(self, stats: Stats, names: RequestNames) -> None:
        c = stats.counters
        for name, field, unit in RATES:
            value = getattr(c, field)
            history = self.history[name]
            if history.count(value) < HISTORY:  # else the line is flat at this value already
                history.append(value)
                self._sparks[name].data = list(history)
            update_text(self._labels[name], Text(f"{name:<8}{value:8.1f} {unit}"))
        self._counters.set_parts([f"submitted {c.submitted}", f"finished {c.finished}", f"aborted {c.aborted}",
                                  f"retracted {c.retractions}", f"errors {c.errors}", f"steps {c.steps}",
                                  f"prefill {c.prefill_tokens} tok", f"decode {c.decode_tokens} tok",
                                  *([f"drafts {c.spec_accepted_tokens}/{c.spec_draft_tokens} accepted "
                                     f"({c.spec_acceptance:.0%})", f"{c.spec_mean_accepted_length:.2f} tok/verify",
                                     f"accepting {c.spec_accepted_tokens_per_s:.0f} of "
                                     f"{c.spec_draft_tokens_per_s:.0f} draft tok/s"] if c.spec_drafts else [])])

