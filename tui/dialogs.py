"""Small modal dialogs: ask for one line of text, or confirm a destructive step."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label

from tui.keys import InOrderKeys


class AnswerInput(InOrderKeys, Input):
    """A dialog's line of input: keys in the order typed."""


class AskScreen(ModalScreen[str | None]):
    """One line of input; Enter answers it, escape cancels (None)."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, question: str, value: str = "", placeholder: str = "", select: bool = False) -> None:
        """`select`: the value starts selected, so typing replaces it (a new name) rather than extends it."""
        super().__init__(classes="dialog")
        self.question, self.value, self.placeholder, self.select = question, value, placeholder, select

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self.question)
            yield AnswerInput(self.value, placeholder=self.placeholder, select_on_focus=self.select)
            yield Label("enter: OK · escape: cancel", classes="dialog-hint")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)


class ConfirmScreen(ModalScreen[bool]):
    """A yes/no question; y or enter says yes, n or escape says no."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y,enter", "dismiss(True)", "Yes"),
        Binding("n,escape", "dismiss(False)", "No"),
    ]

    def __init__(self, question: str) -> None:
        super().__init__(classes="dialog")
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self.question)
            yield Label("y / enter: yes · n / escape: no", classes="dialog-hint")
