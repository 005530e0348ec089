"""Keys applied in the order they were typed, in the text boxes.

Textual checks a focused widget's own (non-priority) bindings only after the key has bubbled up
through every ancestor's message queue to the app. Keys typed faster than that round trip (a fast
typist, a macro, tmux send-keys, a terminal without bracketed paste) reach the box first: `abc`
ctrl+j `d` became `abcd` and a new line, `hello` + enter sent `hell`. A text box with this mixin
runs its own bindings when the key reaches it, in the queue with the characters around it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual import events
from textual.binding import BindingsMap
from textual.dom import DOMNode

if TYPE_CHECKING:
    from textual.widget import Widget as _Base  # to the type checker, the widget this is mixed into
else:
    _Base = object  # at run time a plain mixin (see below)


class InOrderKeys(_Base):
    """Mix in before a Textual text widget (TextArea, Input) to run its bindings in typing order.
    (A plain mixin: a Widget base here would hide the text widget's component classes.)"""

    def _in_order_bindings(self) -> list[tuple[DOMNode, BindingsMap]]:
        """The bindings run on arrival, nearest first: the box's own."""
        return [(self, self._bindings)]

    async def _on_key(self, event: events.Key) -> None:
        for node, bindings in self._in_order_bindings():
            for binding in bindings.key_to_bindings.get(event.key, ()):
                if not binding.priority and await self.app.run_action(binding.action, node):
                    event.stop()
                    event.prevent_default()
                    return
        await super()._on_key(event)
