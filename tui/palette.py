"""Textual's command palette with a search box that applies keys in the order typed.

Its search box is a plain Input whose editing keys (ctrl+u, backspace, enter) are bindings that
Textual runs only after the key has bubbled up to the app, so a key typed right after them reached
the box first: ctrl+u then `theme` searched `heme`. Here the box runs them on arrival (InOrderKeys).
"""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.binding import BindingsMap
from textual.command import CommandInput, CommandPalette
from textual.dom import DOMNode

from tui.keys import InOrderKeys


class PaletteInput(InOrderKeys, CommandInput):
    """The palette's search box. Its screen's keys (up, down, escape) run on arrival too: the palette
    is modal, so its chain ends there, and running only the box's own would let enter overtake a down."""

    def _in_order_bindings(self) -> list[tuple[DOMNode, BindingsMap]]:
        return self.screen._modal_binding_chain


class Palette(CommandPalette):
    """CommandPalette, its layout untouched, with PaletteInput in place of its search box."""

    def compose(self) -> ComposeResult:
        for widget in super().compose():
            if type(widget) is CommandInput:
                original: Any = widget
                widget = PaletteInput(placeholder=original.placeholder, select_on_focus=original.select_on_focus)
            yield widget
