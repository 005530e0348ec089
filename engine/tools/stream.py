"""A reply's text split into content and tool calls, as it streams and whole (the whole parse is the
streaming parser fed the whole text, so the two agree exactly)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from engine.tools.base import StreamDelta, ToolCall, ToolCallDelta, ToolFormat, new_call_id
from engine.tools.formats import FORMATS
from engine.tools.json_call import StreamedCall


class ToolCallStreamParser:
    """Splits streamed model text into content and tool-call deltas: the format's syntax says where calls
    start and what is content, `StreamedCall` reads each call's JSON."""

    def __init__(self, fmt: ToolFormat, make_id: Callable[[], str] = new_call_id) -> None:
        self._syntax = FORMATS[fmt]()
        self._make_id = make_id
        self._unread = ""  # text not yet resolved into content or a call
        self._call: StreamedCall | None = None
        self._calls = 0  # calls emitted so far: the next call's index

    @property
    def calls(self) -> int:
        """Tool calls parsed so far, the one in progress excepted (after `finish`, all of them: the API's
        finish_reason is "tool_calls" when there were any)."""
        return self._calls

    def feed(self, text: str) -> StreamDelta:
        out = StreamDelta()
        self._unread += text
        self._run(out, final=False)
        return out

    def finish(self) -> StreamDelta:
        """The reply ended: resolve whatever was held back."""
        out = StreamDelta()
        self._run(out, final=True)
        if self._call is not None:
            call, self._call = self._call, None
            if call.finish(out.tool_calls):
                self._calls += 1
            else:
                out.content += self._syntax.not_a_call(call.raw)
        out.content += self._syntax.leftover(self._unread)
        self._unread = ""
        return out

    def _run(self, out: StreamDelta, final: bool) -> None:
        while True:
            call = self._call
            if call is None:
                if not self._unread:
                    return
                split = self._syntax.split(self._unread, final)
                out.content += split.content
                self._unread = split.rest
                if split.lead is None:
                    return
                self._call = StreamedCall(self._calls, self._make_id, split.lead, self._syntax.close_tag)
                continue
            call.feed(self._unread, out.tool_calls)
            self._unread = ""
            if not (call.done or call.failed):
                return
            self._call, self._unread = None, call.rest
            if call.failed:  # not a call after all: its text is content
                out.content += self._syntax.not_a_call(call.raw)
            else:
                self._calls += 1
                self._syntax.call_ended()


def assemble(deltas: Iterable[StreamDelta]) -> tuple[str | None, list[ToolCall]]:
    """A whole reply from its stream's deltas, as (content, calls): content is None when the reply is only
    calls, and is the text unchanged when there are none."""
    content: list[str] = []
    starts: list[ToolCallDelta] = []
    arguments: list[list[str]] = []
    for delta in deltas:
        content.append(delta.content)
        for d in delta.tool_calls:
            if d.id is not None:
                starts.append(d)
                arguments.append([])
            arguments[d.index].append(d.arguments)
    calls = [ToolCall(s.id or "", s.name or "", "".join(a)) for s, a in zip(starts, arguments, strict=True)]
    text = "".join(content)
    return (text or None) if calls else text, calls


def parse_tool_calls(text: str, fmt: ToolFormat,
                     make_id: Callable[[], str] = new_call_id) -> tuple[str | None, list[ToolCall]]:
    """A whole reply as (content, calls), see `assemble`."""
    parser = ToolCallStreamParser(fmt, make_id)
    return assemble([parser.feed(text), parser.finish()])
