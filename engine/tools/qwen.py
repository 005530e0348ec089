"""The "qwen" tool-call format (Qwen2.5, Qwen3 and Hermes-style templates, which mention `<tool_call>`):
the model writes any text, then one or more calls, each
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

Text that may be the start of a `<tool_call>` tag is held back until it resolves, and whitespace
touching a call is dropped, so streamed content equals the non-streaming content exactly."""

from __future__ import annotations

import json
from typing import Any

from engine.structured import MAX_JSON_WHITESPACE, GrammarSpec
from engine.tools.base import Split, ToolSyntax

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


class QwenSyntax(ToolSyntax):
    argument_key = "arguments"
    close_tag = TOOL_CALL_CLOSE

    def __init__(self) -> None:
        self._held_ws = ""  # whitespace at the end of the content so far (dropped if a call follows)
        self._after_call = False  # a call just ended: whitespace after it is dropped

    @staticmethod
    def taught_by(template: str) -> bool:
        return TOOL_CALL_OPEN in template

    @staticmethod
    def forced_grammar(schema: dict[str, Any], one: bool) -> GrammarSpec:
        """An xgrammar structural tag: `<tool_call>\\n` + a call's JSON + `\\n</tool_call>`, one or more
        separated by a newline (exactly one when `one`)."""
        tag = {"type": "tag", "begin": TOOL_CALL_OPEN + "\n", "end": "\n" + TOOL_CALL_CLOSE,
               # max_whitespace_cnt: honoured by xgrammar >= 0.2.4 (structural tags), ignored before
               "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_JSON_WHITESPACE}}
        fmt = tag if one else {"type": "tags_with_separator", "tags": [tag], "separator": "\n", "at_least_one": True}
        return GrammarSpec(kind="structural_tag", value=json.dumps({"type": "structural_tag", "format": fmt}))

    def split(self, text: str, final: bool) -> Split:
        at = text.find(TOOL_CALL_OPEN)
        if at < 0:  # hold back what may be the start of the tag
            cut = len(text) - (0 if final else _partial_suffix(text, TOOL_CALL_OPEN))
            return Split(self._shown(text[:cut]), text[cut:])
        content = self._shown(text[:at])
        lead, self._held_ws = self._held_ws + TOOL_CALL_OPEN, ""  # whitespace before a call is dropped
        return Split(content, text[at + len(TOOL_CALL_OPEN):], lead)

    def not_a_call(self, raw: str) -> str:
        return self._shown(raw)

    def call_ended(self) -> None:
        self._after_call = True

    def leftover(self, unread: str) -> str:
        """The held-back whitespace (a final `split` has read everything, so nothing is unread)."""
        return self._held_ws

    def _shown(self, text: str) -> str:
        """Content to show now: whitespace right after a call is dropped, and trailing whitespace is held
        back (a call after it drops it)."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return ""
            self._after_call = False
        body = text.rstrip()
        if not body:
            self._held_ws += text
            return ""
        shown = self._held_ws + body
        self._held_ws = text[len(body):]
        return shown


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
