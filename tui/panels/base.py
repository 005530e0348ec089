"""Redraw only what changed: snapshots arrive four times a second and mostly repeat, while setting a
title or a Static's text repaints (a Static even re-lays-out) however equal the new value is."""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget
from textual.widgets import Static


def same_text(a: object, b: object) -> bool:
    """Equal text, spans and style (Text's own == ignores the style of the whole text)."""
    if isinstance(a, Text) and isinstance(b, Text):
        return a.plain == b.plain and a.spans == b.spans and a.style == b.style
    return a == b


def update_text(static: Static, text: Text) -> None:
    if not same_text(text, static.content):
        static.update(text)


def set_titles(widget: Widget, title: str, subtitle: str | None = None) -> None:
    if widget.border_title != title:
        widget.border_title = title
    if subtitle is not None and widget.border_subtitle != subtitle:
        widget.border_subtitle = subtitle
