"""The fleet view (f4, and first when `--engines` names several): one row per replica, redrawn each second
from the replicas' readings (tui/fleet.py), and the imbalance between those that are up.

It only picks: enter on an engine's row answers ("ops", replica) and the app points its status line,
ops panels and new chats at that engine; `c` answers ("chat", replica) for a new chat pinned to it.
An HTTP replica has no ops panels to open (they are drawn from the engine's own snapshots, which only
its ZeroMQ address publishes), so enter shows what its /metrics says, and says so.
"""

from __future__ import annotations

import time
from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import DataTable, Footer, Label, Static

from tui.fleet import EngineReplica, Fleet, HttpReplica, Reading, Replica, imbalance
from tui.link import EngineLink
from tui.panels.base import same_text, update_text
from tui.scrape import quantile

FleetChoice = tuple[str, EngineReplica]  # (ops | chat, the engine)
REDRAW_EVERY = 1.0
STATE_STYLES = {"up": "bold green", "stale": "bold yellow", "down": "bold red", "connecting": "yellow"}
COLUMNS = (("n", "#"), ("replica", "replica"), ("state", "state"), ("model", "model"), ("running", "running"),
           ("waiting", "waiting"), ("kv", "KV used"), ("prefill", "prefill t/s"), ("decode", "decode t/s"),
           ("ttft", "TTFT p95"), ("tpot", "TPOT p95"), ("note", "note"))
NAME_WIDTH = 30  # an address's characters in the table
LABEL_WIDTH = 44  # a metric name's in an HTTP replica's metrics
MISSING = "—"  # what a replica has not said (as the request detail shows it)
HINT = ("enter: this replica's ops panels (ZeroMQ) or its metrics (HTTP) · c: a new chat on it · escape: back · "
        "TTFT and TPOT p95 over the last 10 s: over HTTP from the histograms; over ZeroMQ from the engine's recent "
        "TTFTs and the gaps between the steps each request was in")


def short(name: str, width: int = NAME_WIDTH) -> str:
    """An address cut in the middle to `width` characters (its scheme and its end are what tell replicas apart)."""
    if len(name) <= width:
        return name
    head = (width - 1) // 2
    return f"{name[:head]}…{name[len(name) - (width - 1 - head):]}"


def count(value: float | None) -> str:
    return MISSING if value is None else f"{value:,.0f}"


def latency(value: float | None) -> str:
    if value is None:
        return MISSING
    return f"{1000 * value:.0f} ms" if value < 1 else f"{value:.2f} s"


def cells(n: int, replica: Replica, reading: Reading, shown: bool) -> list[Text]:
    """One row: stale numbers are dimmed (they are the last known), a down replica's are left out."""
    r = reading if reading.state in ("up", "stale") else Reading(reading.state, reading.note)
    dim = "dim" if r.state == "stale" else ""
    numbers = [count(r.running), count(r.waiting), MISSING if r.kv_used is None else f"{100 * r.kv_used:.1f}%",
               count(r.prefill_tps), count(r.decode_tps), latency(r.ttft_p95), latency(r.tpot_p95)]
    return [Text(f"{'▶' if shown else ' '}{n}"), Text(short(replica.name)), Text(r.state, STATE_STYLES[r.state]),
            Text(r.model), *(Text(v, dim, justify="right") for v in numbers), Text(r.note, "dim")]


class FleetScreen(Screen[FleetChoice | None]):
    """Every replica of the fleet, one row each; ▶ marks the engine the console shows."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,f4", "dismiss(None)", "Back to the console"),
        Binding("enter", "open", "Open this replica: its ops panels (ZeroMQ) or its metrics (HTTP)"),
        Binding("c", "chat", "A new chat on this replica"),
    ]

    def __init__(self, fleet: Fleet, shown: EngineLink) -> None:
        super().__init__(id="fleet")
        self.fleet, self.shown = fleet, shown

    def compose(self) -> ComposeResult:
        yield Static(id="fleet-title")
        yield DataTable(cursor_type="row", zebra_stripes=True, id="fleet-table")
        yield Static(id="fleet-imbalance")
        yield Static(id="fleet-note")
        yield Label(HINT, id="fleet-hint")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        for key, label in COLUMNS:
            table.add_column(label, key=key)
        for n in range(1, len(self.fleet.replicas) + 1):
            table.add_row(*([""] * len(COLUMNS)), key=str(n))
        self.redraw()
        self.set_interval(REDRAW_EVERY, self.redraw)

    def row(self, n: int, replica: Replica, reading: Reading) -> list[Text]:
        return cells(n, replica, reading, shown=isinstance(replica, EngineReplica) and replica.link is self.shown)

    def redraw(self) -> None:
        """Each second: the cells that changed, the title's count and the imbalance line."""
        table = self.query_one(DataTable)
        readings = self.fleet.readings()
        for n, (replica, reading) in enumerate(zip(self.fleet.replicas, readings, strict=True), 1):
            for (key, _), cell in zip(COLUMNS, self.row(n, replica, reading), strict=True):
                if not same_text(table.get_cell(str(n), key), cell):
                    table.update_cell(str(n), key, cell, update_width=True)
        up = sum(r.state == "up" for r in readings)
        update_text(self.query_one("#fleet-title", Static),
                    Text.assemble((" fleet ", "bold reverse"), f" {len(readings)} replicas · ",
                                  (f"{up} up", "green" if up == len(readings) else "yellow")))
        update_text(self.query_one("#fleet-imbalance", Static), Text(imbalance(readings)))
        self._show_note(readings)

    def _show_note(self, readings: list[Reading] | None = None) -> None:
        """The highlighted replica's note in full, wrapped: in the table it is the last column, which a wide
        table cuts (an unreachable replica's reason read "unreachable: All connection atte")."""
        row = self.query_one(DataTable).cursor_row
        readings = readings if readings is not None else self.fleet.readings()
        note = readings[row].note if 0 <= row < len(readings) else ""
        update_text(self.query_one("#fleet-note", Static), Text(f"#{row + 1} {note}" if note else ""))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        event.stop()
        self._show_note()

    @property
    def selected(self) -> Replica:
        return self.fleet.replicas[self.query_one(DataTable).cursor_row]

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.action_open()

    def action_open(self) -> None:
        replica = self.selected
        if isinstance(replica, HttpReplica):
            self.app.push_screen(MetricsScreen(replica, self.fleet.replicas.index(replica) + 1))
        else:
            self.dismiss(("ops", replica))

    def action_chat(self) -> None:
        replica = self.selected
        if isinstance(replica, HttpReplica):
            self.notify("chats talk to an engine over ZeroMQ: list this replica's engine address (the --address "
                        "of its `minichat serve --http`) in --engines to chat with it", severity="warning")
            return
        self.dismiss(("chat", replica))


class MetricsScreen(ModalScreen[None]):
    """What an HTTP replica's /metrics says, read each second: its row, every gauge and total, and each
    histogram's count and quantiles since it started; and why there are no ops panels to open."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q", "dismiss", "Close")]
    WHY = ("The ops panels (waiting queue, running set, request slots, KV pages, steps) are drawn from the "
           "engine's own stats snapshots, which only its ZeroMQ address publishes; /metrics carries totals, gauges "
           "and histograms. To open them, list this replica's engine address (the --address its `minichat serve "
           "--http` was given) in --engines.")

    def __init__(self, replica: HttpReplica, number: int) -> None:
        super().__init__(classes="dialog")
        self.replica, self.number = replica, number

    def compose(self) -> ComposeResult:
        with Vertical(id="replica-metrics") as box:
            box.border_title = f"Replica #{self.number}: {self.replica.metrics_url}"
            yield Label(self.WHY, id="replica-why")
            with VerticalScroll():
                yield Static(id="replica-numbers")
            yield Label("escape: back to the fleet", classes="dialog-hint")

    def on_mount(self) -> None:
        self.redraw()
        self.set_interval(REDRAW_EVERY, self.redraw)

    def redraw(self) -> None:
        replica = self.replica
        text = Text()
        row = cells(self.number, replica, replica.reading(time.monotonic()), shown=False)
        for (key, label), cell in zip(COLUMNS, row, strict=True):
            if key not in ("n", "replica"):  # the title says them
                text.append(f"{label:<{LABEL_WIDTH}} ", "bold").append_text(cell).append("\n")
        if replica.scrapes:
            new = replica.scrapes[-1]
            text.append("\nsince the replica started\n", "bold underline")
            for name, buckets in sorted(new.histograms.items()):
                p50, p95, p99 = (latency(quantile(q, buckets)) for q in (0.5, 0.95, 0.99))
                text.append(f"{name:<{LABEL_WIDTH}} ", "cyan").append(
                    f"{buckets[-1][1]:,.0f} observed · p50 {p50} · p95 {p95} · p99 {p99}\n")
            for name, value in sorted(new.values.items()):
                if not any(name.startswith(f"{histogram}_") for histogram in new.histograms):  # their buckets say it
                    text.append(f"{name:<{LABEL_WIDTH}} ", "cyan").append(f"{value:,.6g}\n")
        update_text(self.query_one("#replica-numbers", Static), text)
