"""The chat tabs: one ChatPane per tab, in the tab bar's order.

The tabs add, label, find and bring panes to the front; which sessions open, close or fan out, and
when, is the app's (tui/app.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from textual.content import Content
from textual.widgets import TabbedContent, TabPane

from tui.chat import ChatPane
from tui.link import EngineLink
from tui.session import Session


def tab_id(session: Session) -> str:
    """The id of the tab that shows `session`."""
    return f"session-{session.uid}"


class SessionTabs(TabbedContent):
    """The chat tabs. Only the app picks the front tab, never a focus change inside a hidden one.

    Switching tabs hides the old pane at once, but the app's focus reaches the new pane's prompt box
    a few messages later. If the old prompt box hears that it was hidden first, Textual moves its
    focus to a sibling in the same, hidden, pane, and TabbedContent would bring that pane back to
    the front: a fan-out or a new chat would now and then land on the tab it came from.
    """

    def __init__(self, replica_of: Callable[[EngineLink], int | str | None], *, id: str) -> None:
        """`replica_of`: the fleet's number for an engine (or a catalogue's model id), shown on the tabs of the
        chats that talk to it (None: nothing, as when there is no fleet to choose from)."""
        super().__init__(id=id)
        self.replica_of = replica_of

    def _on_tab_pane_focused(self, event: TabPane.Focused) -> None:
        if not event.tab_pane.display:
            event.prevent_default()  # skip TabbedContent's handler, which activates the pane
            event.stop()

    @property
    def panes(self) -> list[ChatPane]:
        """The open chats, in the tab bar's order."""
        return list(self.query(ChatPane))

    @property
    def front(self) -> ChatPane | None:
        """The chat in the active tab."""
        pane = self.active_pane
        return pane.query_one(ChatPane) if pane is not None else None

    def pane_of(self, uid: str) -> ChatPane | None:
        """The open chat of session `uid`, if it is open."""
        return next((pane for pane in self.panes if pane.session.uid == uid), None)

    async def add(self, *panes: ChatPane) -> None:
        """A tab for each pane, at the end of the bar, all at once."""
        await asyncio.gather(*[self.add_pane(TabPane(self._label(pane), pane, id=tab_id(pane.session)))
                               for pane in panes])

    async def close(self, *panes: ChatPane) -> None:
        await asyncio.gather(*[self.remove_pane(tab_id(pane.session)) for pane in panes])

    def bring_to_front(self, pane: ChatPane) -> None:
        self.active = tab_id(pane.session)
        pane.focus_input()

    def go_to(self, index: int) -> None:
        """Bring the tab at `index` (0-based, in the tab bar's order) to the front."""
        panes = self.panes
        if not 0 <= index < len(panes):
            raise ValueError(f"there is no tab {index + 1}: {len(panes)} are open")
        self.bring_to_front(panes[index])

    def label(self, pane: ChatPane) -> None:
        """The tab follows its session's name, whether a reply streams and the engine it talks to."""
        tab_pane = pane.parent
        if pane.is_attached and isinstance(tab_pane, TabPane) and tab_pane.id is not None:
            self.get_tab(tab_pane.id).label = self._label(pane)

    def _label(self, pane: ChatPane) -> Content:
        """The session's name, with a dot while its reply is generating, and the fleet's replica it talks to."""
        replica = self.replica_of(pane.link)
        return Content(("● " if pane.session.live is not None else "") + pane.session.name
                       + (f" @{replica}" if replica is not None else ""))
