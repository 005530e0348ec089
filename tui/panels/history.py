"""The scheduler's load over the last minutes: waiting-queue length, running-set size and KV pages in use.

The throughput panel's sparklines move with every snapshot (the last half minute); these keep one
sample a second for HISTORY_SECONDS, each the highest value seen in its second, so a burst that filled
the queue for a moment still shows minutes later. Until the console has watched that long, the lines
span the seconds it has watched (at least MIN_SPAN), not a window of zeros it never saw. Samples are
recorded while the panel is hidden or the view is paused, and drawn when it shows again.
"""

from __future__ import annotations

from collections import deque

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, Sparkline

from engine.service.protocol import Stats
from tui.names import RequestNames
from tui.panels.base import update_text

HISTORY_SECONDS = 300  # samples kept per line: one a second
MIN_SPAN = 60  # seconds the lines span at least
SERIES = (("waiting", "waiting"), ("running", "running"), ("kv", "KV used"))


def values(stats: Stats) -> tuple[int, int, int]:
    """This snapshot's point of each series: queue length, running set, KV pages held or locked."""
    return len(stats.waiting), len(stats.running), stats.pages.held + stats.pages.locked


class HistoryPanel(Vertical):
    """One sparkline per series, with its value now and its peak over the window.

    Like the throughput panel's lines, a line that is flat at a value takes no more samples of that
    value, so an idle engine costs no redraw."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, classes="panel")
        self.border_title = f"History · 1 sample/s, up to {HISTORY_SECONDS // 60} min"
        self.history = {name: deque([0] * HISTORY_SECONDS, maxlen=HISTORY_SECONDS) for name, _ in SERIES}
        self.now = dict.fromkeys(self.history, 0)
        self.total_pages = 0
        self.seconds = 0  # seconds sampled so far
        self._second: tuple[float, int] | None = None  # (engine start, second of uptime) being sampled
        self._peak = [0, 0, 0]  # the highest values seen in that second
        self._drawn = False  # the sparklines show the samples (else they are drawn when next shown)
        self._flat: dict[str, int | None] = dict.fromkeys(self.history)  # the value a flat line shows

    def compose(self) -> ComposeResult:
        for name, _ in SERIES:
            with Horizontal(classes="rate"):
                yield Label(id=f"history-{name}", classes="rate-label history-label")
                yield Sparkline(list(self.history[name]), summary_function=max, id=f"history-spark-{name}")

    def on_mount(self) -> None:
        self._sparks = {name: self.query_one(f"#history-spark-{name}", Sparkline) for name, _ in SERIES}
        self._labels = {name: self.query_one(f"#history-{name}", Label) for name, _ in SERIES}

    def record(self, stats: Stats) -> None:
        """Take a snapshot's point into the second it belongs to; a second that is over becomes a sample.
        Cheap enough for every snapshot, shown or not."""
        second = (round(stats.time - stats.uptime), int(stats.uptime))  # a restarted engine starts afresh
        point = values(stats)
        self.now = dict(zip(self.history, point, strict=True))
        self.total_pages = stats.pages.total
        if second != self._second:
            if self._second is not None:
                self.seconds += 1
                for (name, _), peak in zip(SERIES, self._peak, strict=True):
                    history = self.history[name]
                    if history.count(peak) < HISTORY_SECONDS:  # else the line is flat at this value already
                        history.append(peak)
                        self._drawn = False
            self._second, self._peak = second, list(point)
        else:
            self._peak = [max(a, b) for a, b in zip(self._peak, point, strict=True)]

    def show_stats(self, stats: Stats, names: RequestNames) -> None:
        """Draw what was recorded (the app records every snapshot, this panel shown or not)."""
        if not self._drawn:
            self._drawn = True
            span = min(HISTORY_SECONDS, max(MIN_SPAN, self.seconds))
            for name, spark in self._sparks.items():
                window = list(self.history[name])[-span:]
                flat = window[0] if window.count(window[0]) == len(window) else None
                if flat is None or flat != self._flat[name]:  # a flat line looks the same at any span
                    spark.data = window
                self._flat[name] = flat
        for name, title in SERIES:
            peak = max(max(self.history[name]), self.now[name])
            of = f"/{self.total_pages}" if name == "kv" else ""
            update_text(self._labels[name], Text(f"{title:<8}{self.now[name]:>5}{of} max {peak}"))
