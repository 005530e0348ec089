"""The help screen: every key binding and command, read from the bindings themselves so it cannot drift."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

from tui.commands import COMMANDS

PANELS_GUIDE = """\
## Reading the ops panels

A request waits in the **waiting queue** until a prefill step admits it: admission walks the queue
in arrival order and stops at the first request that lacks a free **request slot**, room in the
step's **token budget** (long prompts are chunked across steps) or **KV pages** for its prompt plus
its whole output budget. Admitted requests join the **running set**; each **step** is either one
prefill batch or one decode batch (prefill first), as the step timeline shows. A finished or aborted
request frees its slot at once, and its pages go back to the pool or stay cached for reuse. One
colour follows each request through every panel; bold labels are this app's own sessions.
"""


def keys(binding: Binding) -> str:
    return " / ".join(f"`{k.strip()}`" for k in binding.key.split(","))


def binding_rows(bindings: Iterable[BindingType], where: str) -> list[str]:
    """Markdown table rows for the bindings that have a description (the others are internal)."""
    return [f"| {keys(b)} | {b.description} | {where} |"
            for b in bindings if isinstance(b, Binding) and b.description]


def help_markdown(sections: Iterable[tuple[str, Iterable[BindingType]]], palette_key: str) -> str:
    rows = [f"| `{palette_key}` | command palette: every command below, searchable | everywhere |"]
    for where, bindings in sections:
        rows += binding_rows(bindings, where)
    commands = [f"| `/{c.name}{' ' + c.arg if c.arg else ''}` | {c.help} |" for c in COMMANDS]
    return "\n".join(["# minichat help", "", "## Keys", "", "| key | does | where |", "|---|---|---|", *rows, "",
                      "## Commands", "", "Type them in the prompt box, or pick them from the command palette.", "",
                      "| command | does |", "|---|---|", *commands, "", PANELS_GUIDE])


class HelpScreen(ModalScreen[None]):
    """Shows `help_markdown` for the running app; escape, q or f1 closes it."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q,f1", "dismiss", "Close help")]

    def __init__(self, sections: Iterable[tuple[str, Iterable[BindingType]]]) -> None:
        super().__init__(classes="dialog")
        self.sections = list(sections)

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            yield Markdown(help_markdown(self.sections, App.COMMAND_PALETTE_BINDING))
