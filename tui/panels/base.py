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


def pack(parts: list[str], width: int, sep: str = " · ") -> list[str]:
    """`parts` joined by `sep` into lines of at most `width` columns, a part never split while it fits on a
    line of its own (a longer one wraps between its words; a word wider than the line is cut with `…`)."""
    width = max(1, width)
    lines: list[str] = []
    for part in parts:
        if lines and len(lines[-1]) + len(sep) + len(part) <= width:
            lines[-1] += sep + part
            continue
        if len(part) <= width:
            lines.append(part)
            continue
        line = ""
        for word in part.split():
            if line and len(line) + 1 + len(word) <= width:
                line += " " + word
            else:
                if line:
                    lines.append(line)
                line = word if len(word) <= width else word[: width - 1] + "…"
        lines.append(line)
    return lines
