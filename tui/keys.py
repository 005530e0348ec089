"""Keys applied in the order they were typed, in the text boxes.

Textual checks a focused widget's own (non-priority) bindings only after the key has bubbled up
through every ancestor's message queue to the app. Keys typed faster than that round trip (a fast
typist, a macro, tmux send-keys, a terminal without bracketed paste) reach the box first: `abc`
ctrl+j `d` became `abcd` and a new line, `hello` + enter sent `hell`. A text box with this mixin
runs its own bindings when the key reaches it, in the queue with the characters around it.
"""

from __future__ import annotations

from typing import Any

from textual import events
from textual.binding import BindingsMap
from textual.dom import DOMNode


class InOrderKeys:
    """Mix in before a Textual text widget (TextArea, Input) to run its bindings in typing order.
    (A plain mixin: a Widget base here would hide the text widget's component classes.)"""

    def _in_order_bindings(self) -> list[tuple[DOMNode, BindingsMap]]:
        """The bindings run on arrival, nearest first: the box's own."""
        widget: Any = self
        return [(widget, widget._bindings)]

    async def _on_key(self, event: events.Key) -> None:
        widget: Any = self
        for node, bindings in self._in_order_bindings():
            for binding in bindings.key_to_bindings.get(event.key, ()):
                if not binding.priority and await widget.app.run_action(binding.action, node):
                    event.stop()
                    event.prevent_default()
                    return
        await super()._on_key(event)  # type: ignore[misc]
