"""The "llama3" tool-call format (Llama 3.1, 3.2, 3.3: a Llama 3 template that offers `<|python_tag|>` or
asks for `{"name": ..., "parameters": ...}`): the whole reply is the call, a JSON object
`{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`; several are separated by ";".
A reply that does not start with `{` is plain text."""

from __future__ import annotations

import json
from typing import Any, Literal

from engine.structured import GrammarSpec
from engine.tools.base import Split, ToolSyntax

PYTHON_TAG = "<|python_tag|>"


class Llama3Syntax(ToolSyntax):
    argument_key = "parameters"
    close_tag = None

    def __init__(self) -> None:
        # "start": only whitespace or the python tag so far; "calls": a call began; "text": no more calls
        self._read: Literal["start", "calls", "text"] = "start"

    @staticmethod
    def taught_by(template: str) -> bool:
        return "<|start_header_id|>" in template and (PYTHON_TAG in template or '"parameters"' in template)

    @staticmethod
    def forced_grammar(schema: dict[str, Any], one: bool) -> GrammarSpec:
        """A JSON schema of one call, named or not (Llama 3 templates take one call per turn)."""
        return GrammarSpec(kind="json_schema", value=json.dumps(schema))

    def split(self, text: str, final: bool) -> Split:
        if self._read == "text":
            return Split(text, "")
        head = text.lstrip(" \t\r\n;" if self._read == "calls" else " \t\r\n")
        if self._read == "start" and head.startswith(PYTHON_TAG):
            head = head[len(PYTHON_TAG):].lstrip()
        elif self._read == "start" and PYTHON_TAG.startswith(head):
            return Split("", text)  # only whitespace, or part of the python tag: nothing decided yet
        if not head:
            return Split("", text)
        if head[0] != "{":  # plain text: a reply that starts so has no calls, one after calls ends them
            content = head if self._read == "calls" else text
            self._read = "text"
            return Split(content, "")
        lead = text[:len(text) - len(head)] if self._read == "start" else ""
        self._read = "calls"
        return Split("", head, lead)

    def not_a_call(self, raw: str) -> str:
        """The text is content, and so is the rest of the reply."""
        self._read = "text"
        return raw

    def call_ended(self) -> None:
        """Nothing to note: `split` reads what follows a call (";", whitespace, the next call)."""

    def leftover(self, unread: str) -> str:
        """Whitespace or part of the python tag, if nothing else came; after calls, separators (dropped)."""
        return unread if self._read == "start" else ""
