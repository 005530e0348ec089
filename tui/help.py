"""The help screen: every key binding and command, read from the bindings themselves so it cannot drift."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

from rich.table import Table
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown, Static

from tui.commands import COMMANDS

PANELS_GUIDE = """\
## Reading the ops panels

A request waits in the **waiting queue** until a prefill step admits it: admission walks the queue
in the engine's order (`--schedule-policy`: arrival, priority with the lower **prio** first, or the
longest cached prefix first) and stops at the first request that lacks a free **request slot**,
room in the step's **token budget** (long prompts are chunked across steps) or **KV pages** for its
prompt plus the output it is counted for; its **waiting for** column says which (the requests
behind it wait for their turn). Admitted requests join the **running set**; each **step** is either
one prefill batch or one decode batch (prefill first), as the step timeline shows. A finished or
aborted request frees its slot at once, and its pages go back to the pool or stay cached for reuse.
One colour follows each request through every panel; bold labels are this app's own sessions. The
KV panel says how admission counts a request, and counts the pages **claimed** for admitted
requests' remaining output: their whole budget under `--admission reserve`, the share of it that
admission expects now under `optimistic` (the default), where a step that runs out of pages
**retracts** running requests back to the queue (the latest to arrive first; under the priority
policy the lowest priority first). A retracted request resumes where it was: the waiting queue marks
it `retracted ×N` with the tokens it keeps, the running set marks its state `×N`, and the status
line and the throughput panel count them all. `/priority N` sets a session's priority. When
snapshots stop coming, the status line says how old the last one is.

**f6** moves through the prompt box and the tables (the one with focus has a heavy border and its
title in reverse); **f5** switches between chat, split and ops panels. **enter** on a row shows that
request in detail: who sent it (this console's tabs by name, other clients by the label they send,
else `client N`), its prompt's ends, parameters, prefix-cache hit, pages, timings and its output as
it streams. **x** aborts a request, here or there, after asking; a request that ends while you are
asked is reported as already finished, not aborted. **/** filters both tables by id, owner or state,
**X** aborts every request the filter matches, **s** / **r** sort a table, **p** pauses the view.
The **history** panel keeps the queue, the running set and the KV pages in use over five minutes.

## The fleet view (`minichat --engines ADDR1,ADDR2,...`, f4)

One row per replica, redrawn each second: an engine's ZeroMQ address (its stats stream) or an HTTP
replica's URL (its `/metrics`, read once a second: minichat's `serve --http`, vLLM, anything with vLLM's
metric names). A replica is **up**, **stale** (no fresh numbers for 3 s, or an HTTP replica whose engine
publishes none) or **down** (nothing answers). Rates over HTTP are counter deltas between reads; **TTFT
p95** is estimated from the histogram buckets gained over the last 10 s, and only HTTP replicas have
it (an engine's stats carry no per-request latencies); **TPOT p95** over ZeroMQ is the gaps between
the steps each request was in. The line below compares the replicas that are up: the busiest and the
idlest by running + waiting, and the spread of their KV use. **enter** on an engine's row turns the
status line, the ops panels and new chats to that engine (▶ marks it; open chats stay on theirs); on
an HTTP row it shows the replica's metrics, since the ops panels need the engine's own snapshots.
**c** opens a chat on the replica, `/engine N` moves the current chat to replica N (`@N` on its tab).
"""

Row = tuple[str, str, str]


def key_rows(sections: Iterable[tuple[str, Iterable[BindingType]]]) -> list[Row]:
    """(keys, what they do, where) for every binding with a description (the others are internal), in full:
    the tooltip where the footer's label is a word."""
    rows = [(App.COMMAND_PALETTE_BINDING, "Command palette: every command below, searchable", "everywhere")]
    for where, bindings in sections:
        rows += [(b.key_display or " / ".join(k.strip() for k in b.key.split(",")), b.tooltip or b.description,
                  where) for b in bindings if isinstance(b, Binding) and b.description]
    return rows


def command_rows() -> list[Row]:
    return [(f"/{c.name}" + (f" {c.arg}" if c.arg else ""), c.help, c.title) for c in COMMANDS]


def table(title: str, headers: Row, rows: list[Row]) -> Table:
    t = Table(title=title, title_justify="left", title_style="bold", expand=True, box=None, padding=(0, 1),
              header_style="bold")
    for header in headers:
        t.add_column(header, style="bold cyan" if header in ("key", "command") else "")
    for row in rows:
        t.add_row(*row)
    return t


class HelpScreen(ModalScreen[None]):
    """Every key and command of the running app; escape, q or f1 closes it."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q,f1", "dismiss", "Close help")]

    def __init__(self, sections: Iterable[tuple[str, Iterable[BindingType]]]) -> None:
        super().__init__(classes="dialog")
        self.keys, self.commands = key_rows(sections), command_rows()

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help") as scroll:
            scroll.border_title = "minichat help · escape closes"
            yield Static(table("Keys", ("key", "does", "where"), self.keys))
            yield Static(table("Commands: type them in the prompt box (// sends a message that starts with /), or "
                               "find them with ctrl+p",
                               ("command", "does", "palette entry"), self.commands), classes="help-commands")
            yield Markdown(PANELS_GUIDE)
