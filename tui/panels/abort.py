"""Aborting requests chosen in the ops panels: a confirmation that stays true while it is open.

Requests end on their own at any moment, also while a person reads the question. The dialog hears
every stats snapshot (`show_live`); a request that is no longer live is dropped from what a yes
aborts, and the question says so ("already finished"), so a yes never sends an abort for a request
that has gone, and an abort that crosses the request's end anyway is reported as finished, not as
a failure (the engine does not count it as an error either).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from textual.widgets import Label

from tui.dialogs import ConfirmScreen
from tui.names import RequestNames


@runtime_checkable
class LiveScreen(Protocol):
    """A screen that follows which requests are live (the ops panels tell it at every snapshot)."""

    def show_live(self, live: set[str]) -> None: ...


class AbortScreen(ConfirmScreen):
    """Abort one request, or every request a filter matched. `live_rids` is what a yes aborts now."""

    def __init__(self, rids: list[str], names: RequestNames, live: set[str], matching: str = "") -> None:
        """`matching`: the filter that chose `rids` (empty: one request chosen by hand)."""
        self.rids, self.names, self.matching = rids, names, matching
        self.live_rids = [rid for rid in rids if rid in live]
        super().__init__(self.question_text())

    def question_text(self) -> str:
        total, left = len(self.rids), len(self.live_rids)
        if not self.matching:
            label = self.names.label(self.rids[0], 40)
            return f"Abort the request {label}?" if left else f"{label} has already finished: nothing to abort."
        what = f"matching {self.matching!r}"
        if left == total:
            return f"Abort the {total} request{'s' * (total > 1)} {what}?"
        if left:
            return (f"Abort the {left} request{'s' * (left > 1)} {what} still live? ({total - left} of the {total} "
                    f"have already finished.)")
        return f"The {total} request{'s' * (total > 1)} {what} have already finished: nothing to abort."

    def on_mount(self) -> None:
        self.show_hint()

    def show_live(self, live: set[str]) -> None:
        still = [rid for rid in self.live_rids if rid in live]
        if still != self.live_rids:
            self.live_rids = still
            self.query_one(Label).update(self.question_text())
            self.show_hint()

    def show_hint(self) -> None:
        if not self.live_rids:
            self.query_one(".dialog-hint", Label).update("enter / escape: close")
