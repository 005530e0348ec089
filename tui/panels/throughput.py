"""Token rates as sparklines and the engine's counters: is it busy, and what has it done so far."""

from __future__ import annotations

from collections import deque

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, Sparkline, Static

from engine.service.protocol import Stats
from tui.names import RequestNames
from tui.panels.base import update_text

HISTORY = 120  # samples kept per sparkline (about 24 s at five frames a second)
RATES = (("decode", "decode_tokens_per_s", "tok/s"), ("prefill", "prefill_tokens_per_s", "tok/s"),
         ("steps", "steps_per_s", "/s"))


class ThroughputPanel(Vertical):
    """Prefill and decode tokens per second, steps per second, and the totals since the engine started."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(classes="panel", **kwargs)  # type: ignore[arg-type]
        self.border_title = "Throughput"
        self.history = {name: deque([0.0], maxlen=HISTORY) for name, _, _ in RATES}

    def compose(self) -> ComposeResult:
        for name, _, _ in RATES:
            with Horizontal(classes="rate"):
                yield Label(name, id=f"rate-{name}", classes="rate-label")
                yield Sparkline([0.0], summary_function=max, id=f"spark-{name}")
        yield Static(id="counters")

    def show_stats(self, stats: Stats, names: RequestNames) -> None:
        c = stats.counters
        for name, field, unit in RATES:
            value = getattr(c, field)
            self.history[name].append(value)
            self.query_one(f"#spark-{name}", Sparkline).data = list(self.history[name])
            update_text(self.query_one(f"#rate-{name}", Label), Text(f"{name:<8}{value:8.1f} {unit}"))
        update_text(self.query_one("#counters", Static), Text(
            f"submitted {c.submitted} · finished {c.finished} · aborted {c.aborted} · errors {c.errors} · "
            f"steps {c.steps} · prefill {c.prefill_tokens} tok · decode {c.decode_tokens} tok"))

