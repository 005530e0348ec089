"""The console's status line: the link's state, the engine's live counts and rates, the fleet, and
whether conversations are saved, on one line that a narrow terminal shortens by what matters least.

(`minichat status`, the command line's report, is tui/status.py.)
"""

from __future__ import annotations

import time

from rich.cells import cell_len
from rich.text import Text
from textual.widgets import Static

from engine.service.protocol import Stats
from tui.fleet import Fleet
from tui.link import LinkState
from tui.panels.base import update_text

STALE_AFTER = 1.5  # seconds without a stats snapshot after which the status line shows their age
STATE_STYLES = {"connected": "bold green", "stalled": "bold yellow", "connecting": "bold yellow",
                "starting": "bold yellow", "lost": "bold red", "failed": "bold red"}

Piece = tuple[int, int, Text]
"""Part of the status line: (group, priority, text); the highest priority is left out first."""


def fit_status(head: Text, pieces: list[Piece], tail: Text, width: int) -> Text:
    """`head`, the pieces (` · ` within a group, `  │  ` between groups) and `tail`, leaving out the least
    important pieces (the highest priority first, then the next...) until what is left fits `width`
    cells; the order is kept, priority 0 is never left out, and the tail is what a narrow line cuts."""
    for most in sorted({priority for _, priority, _ in pieces}, reverse=True) or [0]:
        groups: dict[int, list[Text]] = {}
        for group, priority, text in pieces:
            if priority <= most:
                groups.setdefault(group, []).append(text)
        body = [Text(" · ").join(texts) for texts in groups.values()]
        if cell_len(head.plain) + 1 + sum(t.cell_len + 5 for t in body) <= width:
            break
    return Text.assemble(head, " ", Text("  │  ").join([*body, tail]))


def engine_pieces(stats: Stats, stats_at: float) -> list[Piece]:
    """The engine's live counts (never left out), its retractions and rates, and the snapshot's age once stale."""
    busy = sum(rid is not None for rid in stats.slots)
    c = stats.counters
    pieces: list[Piece] = [(0, 0, Text(f"running {len(stats.running)} · waiting {len(stats.waiting)}", "dim"))]
    if c.retractions:
        pieces.append((0, 2, Text(f"retracted {c.retractions}", "magenta")))
    pieces += [(0, 0, Text(f"slots {busy}/{len(stats.slots)}", "dim")),
               (0, 4, Text(f"prefill {c.prefill_tokens_per_s:.0f}", "dim")),
               (0, 3, Text(f"decode {c.decode_tokens_per_s:.0f} tok/s", "dim"))]
    if c.spec_drafts:
        pieces.append((0, 5, Text(f"spec {c.spec_acceptance:.0%} · {c.spec_mean_accepted_length:.1f} tok/verify",
                                  "dim")))
    if (age := time.monotonic() - stats_at) > STALE_AFTER:
        pieces.append((1, 1, Text(f"stale: {age:.0f} s old", "bold yellow")))
    return pieces


class StatusLine(Static):
    """One line atop the console (a problem state wraps instead, to say all of what went wrong)."""

    def show(self, state: LinkState, stats: Stats | None, stats_at: float, fleet: Fleet | None,
             problem: str) -> None:
        """The state, the engine's live counts (`stats`, taken at monotonic time `stats_at`), anything amiss,
        the rates, the engine's model, and its weights, pid and address (or what went wrong) last: a narrow
        terminal loses the rates and the retraction count first and then cuts the end, never the model's
        name. `problem`: why conversations are not saved, if they are not."""
        pieces = engine_pieces(stats, stats_at) if stats is not None and state.connected else []
        if fleet is not None:
            states = [r.state for r in fleet.readings()]
            up = states.count("up")
            pieces.append((1, 2, Text(f"fleet {up}/{len(states)} up", "dim" if up == len(states) else "yellow")))
        if problem:
            pieces.append((2, 1, Text("not saving", "bold red")))
        if state.model:  # kept whole where the detail (weights, pid, address) is cut
            pieces.append((3, 0, Text(state.model, "bold")))
        head = Text(f" {state.kind} ", STATE_STYLES.get(state.kind, "bold"))
        update_text(self, fit_status(head, pieces, Text(state.detail), self.app.size.width))
        self.set_class(not state.connected, "-problem")
