"""One call's JSON object as it streams in, the same in every format: `{"name": ..., "arguments": {...}}`
(or "parameters"), its arguments streamed as they come, anything else collected and parsed whole."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Literal

from engine.tools.base import ToolCallDelta

ARGUMENT_KEYS = ("arguments", "parameters")  # Qwen writes "arguments", Llama "parameters"; either is taken
MAX_HEADER_CHARS = 1024  # a call whose {"name": ..., "arguments": prefix is longer is not the usual shape


class StreamedCall:
    """One call's text as it streams in, from just after what opened it (`lead`: a tag, whitespace, given
    back with the call's text if it is no call); it ends at `close_tag`, or without one where its outer
    object closes.

    The usual shape, `{"name": "...", "arguments": {...}}`, is streamed: the first delta as soon as the
    name is complete, then the arguments' text as it comes. Anything else is collected to the call's
    end and parsed whole; if it is not a call, `failed` is set and `raw` is its text. Once `done` or
    `failed`, `rest` is the text after it."""

    def __init__(self, index: int, make_id: Callable[[], str], lead: str, close_tag: str | None) -> None:
        self._lead = lead
        self._close_tag = close_tag
        self._index = index
        self._make_id = make_id
        self._text = ""  # all of the call's text so far
        self._state: Literal["header", "args", "tail", "whole"] = "header"
        self._pos = 0  # args: arguments emitted up to here; tail/whole: text searched up to here
        self._scanner = _JsonScanner()
        self.done = self.failed = False
        self.rest = ""
        self._end = 0  # where the call's text ends in _text, once done or failed

    @property
    def raw(self) -> str:
        """The call's text as the model wrote it, tags included (to its end if it failed, else all of it)."""
        text = self._text
        if self.failed:
            text = text[:self._end] + (self._close_tag or "")
        return self._lead + text

    def feed(self, text: str, out: list[ToolCallDelta]) -> None:
        self._text += text
        if self._state == "header":
            header = _match_header(self._text)
            if header is None and len(self._text) <= MAX_HEADER_CHARS:
                return
            if header and self._text[header[1]] == "{":
                out.append(ToolCallDelta(self._index, "", id=self._make_id(), name=header[0]))
                self._state, self._pos = "args", header[1]
            else:
                self._state = "whole"
        if self._state == "args":
            end = self._scanner.scan(self._text, self._pos)
            stop = len(self._text) if end is None else end
            if stop > self._pos:
                out.append(ToolCallDelta(self._index, self._text[self._pos:stop]))
            self._pos = stop
            if end is None:
                return
            self._state, self._scanner = "tail", _JsonScanner(depth=1)  # inside the outer object
        end = self._find_end()
        if end is None:
            return
        if self._state == "whole":
            call = _parse_call(self._text[:end])
            if call is None:
                self.failed = True
            else:
                self._emit_whole(call, out)
        self.done = not self.failed

    def _find_end(self) -> int | None:
        """Where the call's text ends (at its closing tag, or after the outer closing brace); sets `rest`.
        None while the end has not come."""
        if self._close_tag is not None:
            at = self._text.find(self._close_tag, self._pos)
            if at < 0:
                self._pos = max(self._pos, len(self._text) - len(self._close_tag) + 1)
                return None
            self._end, self.rest = at, self._text[at + len(self._close_tag):]
            return at
        end = self._scanner.scan(self._text, self._pos)
        self._pos = len(self._text) if end is None else end
        if end is not None:
            self._end, self.rest = end, self._text[end:]
        return end

    def _emit_whole(self, call: tuple[str, str], out: list[ToolCallDelta]) -> None:
        out.append(ToolCallDelta(self._index, "", id=self._make_id(), name=call[0]))
        out.append(ToolCallDelta(self._index, call[1]))

    def finish(self, out: list[ToolCallDelta]) -> bool:
        """The reply ended inside this call: whether it counts as one (a streamed call always does, cut
        short or not; a collected one if its text parses as a call without the closing tag)."""
        if self._state in ("args", "tail"):
            return True
        call = _parse_call(self._text) if self._state == "whole" else None
        if call is not None:
            self._emit_whole(call, out)
        return call is not None


class _JsonScanner:
    """Finds where a JSON object or array closes, fed a growing text piece by piece (brackets inside
    strings and escaped quotes are skipped). `depth` is how many brackets are open where it starts."""

    def __init__(self, depth: int = 0) -> None:
        self.depth = depth
        self._in_string = False
        self._escaped = False

    def scan(self, text: str, start: int) -> int | None:
        """Scan text[start:]; the index just past the bracket that closes depth 0, or None."""
        for i in range(start, len(text)):
            ch = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


_HEADER: tuple[tuple[str, ...] | None, ...] = (
    ("{",), ('"name"',), (":",), None, (",",), tuple(f'"{k}"' for k in ARGUMENT_KEYS), (":",))


def _match_header(text: str) -> tuple[str, int] | Literal[False] | None:
    """`{"name": "<name>", "arguments": ` at the start of `text` (any whitespace; "parameters" too):
    the name and the index of the first character after it; None if the text may still grow into one,
    False if it cannot."""
    i, name = 0, ""
    for options in _HEADER:
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        if i == len(text):
            return None
        if options is None:  # the name, a JSON string
            end = _string_end(text, i)
            if end is None or end is False:
                return end
            try:
                name = json.loads(text[i:end])
            except ValueError:
                return False
            i = end
            continue
        hit = next((o for o in options if text.startswith(o, i)), None)
        if hit is None:
            return None if any(o.startswith(text[i:]) for o in options) else False
        i += len(hit)
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return None if i == len(text) else (name, i)


def _string_end(text: str, i: int) -> int | Literal[False] | None:
    """The index past the JSON string starting at text[i]; None if it is not closed yet, False if text[i]
    does not start one."""
    if text[i] != '"':
        return False
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return j + 1
        j += 1
    return None


def _parse_call(text: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) if `text` is one call's JSON object, else None."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: object = next((obj[k] for k in ARGUMENT_KEYS if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)
