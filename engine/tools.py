"""Tool calls (OpenAI's `tools` / `tool_calls`) for the chat template families that have them.

Pure functions and small parsers: no torch, no xgrammar.

Which format a model speaks is read off its chat template (`tool_format`), because the template is
what teaches the model the syntax:

- "qwen": the template mentions `<tool_call>` (Qwen2.5, Qwen3, and Hermes-style models). The model
  writes any text, then one or more calls, each `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
- "llama3": a Llama 3 template (`<|start_header_id|>`) that offers `<|python_tag|>` or asks for
  `{"name": ..., "parameters": ...}` (Llama 3.1, 3.2, 3.3). The whole reply is the call, a JSON object
  `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`; several are separated by ";".
  A reply that does not start with `{` is plain text.
- None: the template knows no tools; a request with tools should be refused (400).

The pieces, in the order a chat request meets them:

    fmt = tool_format(tokenizer)                                # None: refuse `tools`
    messages = template_messages(openai_messages)               # tool_calls' arguments as the templates want them
    ids = apply_chat_template(tokenizer, messages, tools=tools)  # engine/tokenizer.py renders the tools
    spec = forced_tool_grammar(fmt, tools, name=None)           # tool_choice "required" (name: a named function)
    # generate (with `spec` as the request's grammar when forced), then
    content, calls = parse_tool_calls(text, fmt)                # non-streaming
    parser = ToolCallStreamParser(fmt)                          # streaming: feed(text delta) -> StreamDelta
    delta = parser.feed(piece); ...; delta = parser.finish()

Streaming follows OpenAI's chunks: a call's first delta carries its index, id, type "function", the
function's name and arguments ""; later ones carry fragments of the arguments' JSON text, in order.
Text that may be the start of a `<tool_call>` tag is held back until it resolves, and whitespace
touching a call is dropped, so streamed content equals the non-streaming content exactly (the
non-streaming parse is the streaming parser fed the whole text). A call cut off by max_tokens keeps
the arguments it got (finish_reason "length" says so); an unclosed tag whose body never became a call
is given back as content.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from engine.structured import MAX_JSON_WHITESPACE, GrammarSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ToolFormat = Literal["qwen", "llama3"]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("arguments", "parameters")  # Qwen writes "arguments", Llama "parameters"; either is taken
MAX_HEADER_CHARS = 1024  # a call whose {"name": ..., "arguments": prefix is longer is not the usual shape


class InvalidTools(ValueError):
    """`tools` or `tool_choice` that cannot work; the message says what to change."""


# ---------------------------------------------------------------- which format, and rendering


def tool_format(tokenizer: PreTrainedTokenizerBase | None) -> ToolFormat | None:
    """The tool-call format the tokenizer's chat template teaches, by markers in the template's text;
    None when it has none. A template dict (named templates) is read at its "tool_use" entry, the one
    transformers renders when tools are given, else at "default"."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        template = template.get("tool_use") or template.get("default")
    if not isinstance(template, str):
        return None
    if TOOL_CALL_OPEN in template:
        return "qwen"
    if "<|start_header_id|>" in template and (PYTHON_TAG in template or '"parameters"' in template):
        return "llama3"
    return None


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages as HF chat templates take them: an assistant turn's tool calls keep
    OpenAI's shape, but their `arguments` become objects (templates write them with `tojson`, so a JSON
    string would be quoted twice), and a missing content becomes "" (templates concatenate it)."""
    out = []
    for m in messages:
        msg = dict(m)
        if msg.get("content") is None:
            msg["content"] = ""
        if isinstance(msg.get("tool_calls"), list):
            msg["tool_calls"] = [_template_call(c) for c in msg["tool_calls"]]
        out.append(msg)
    return out


def _template_call(call: object) -> object:
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    function = dict(call["function"])
    if isinstance(function.get("arguments"), str):
        with contextlib.suppress(ValueError):  # not JSON: the template gets the text as the model wrote it
            function["arguments"] = json.loads(function["arguments"])
    return {**call, "function": function}


# ---------------------------------------------------------------- forcing calls (tool_choice)


def tool_functions(tools: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Function name -> its parameters' JSON schema, from OpenAI `tools`; InvalidTools if malformed.
    A function without parameters takes none: its arguments must be {}."""
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(fn, Mapping):
            raise InvalidTools(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                               f"...}}}}")
        name, params = fn.get("name"), fn.get("parameters")
        if not isinstance(name, str) or not name:
            raise InvalidTools(f"tools[{i}].function.name must be a non-empty string")
        if name in functions:
            raise InvalidTools(f"tools[{i}]: the function name {name!r} is used twice")
        if params is not None and not isinstance(params, Mapping):
            raise InvalidTools(f"tools[{i}].function.parameters must be a JSON schema object")
        functions[name] = dict(params) if params is not None else {"type": "object", "properties": {}}
    return functions


def tool_call_schema(fmt: ToolFormat, tools: Sequence[Mapping[str, Any]], name: str | None = None) -> dict[str, Any]:
    """JSON schema of one call's object in `fmt` ({"name": ..., "arguments"|"parameters": ...}): any of
    the tools, or only the function `name`. Properties are ordered name first, as the models write them."""
    functions = tool_functions(tools)
    if not functions:
        raise InvalidTools("tool_choice requires a tool call, but no tools were given")
    if name is not None:
        if name not in functions:
            raise InvalidTools(f"tool_choice names the function {name!r}, which is not among the tools")
        functions = {name: functions[name]}
    key = "arguments" if fmt == "qwen" else "parameters"
    variants = [{"type": "object", "properties": {"name": {"const": n}, key: params},
                 "required": ["name", key], "additionalProperties": False} for n, params in functions.items()]
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def forced_tool_grammar(fmt: ToolFormat, tools: Sequence[Mapping[str, Any]], name: str | None = None) -> GrammarSpec:
    """The grammar that makes the model's whole reply tool calls (tool_choice "required"; with `name`,
    tool_choice {"type": "function", "function": {"name": name}}), in the format it was taught, so
    `parse_tool_calls` finds them and their arguments match the tools' parameter schemas.

    qwen: an xgrammar structural tag, `<tool_call>\\n` + a call's JSON + `\\n</tool_call>`, one or more
    separated by a newline (exactly one when named). llama3: a JSON schema, one call (Llama 3 templates
    take one call per turn). InvalidTools if the tools are malformed or `name` is not among them."""
    schema = tool_call_schema(fmt, tools, name)
    if fmt == "llama3":
        return GrammarSpec(kind="json_schema", value=json.dumps(schema))
    tag = {"type": "tag", "begin": TOOL_CALL_OPEN + "\n", "end": "\n" + TOOL_CALL_CLOSE,
           # max_whitespace_cnt: honoured by xgrammar >= 0.2.4 (structural tags), ignored before
           "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_JSON_WHITESPACE}}
    fmt_ = tag if name is not None else \
        {"type": "tags_with_separator", "tags": [tag], "separator": "\n", "at_least_one": True}
    return GrammarSpec(kind="structural_tag", value=json.dumps({"type": "structural_tag", "format": fmt_}))


# ---------------------------------------------------------------- parsing the model's text


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """One complete call; `arguments` is JSON text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call `index`: its first carries `id` and `name` (and arguments ""), later ones only
    `arguments`, the next fragment of the arguments' JSON text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """The entry of a streamed chunk's `delta.tool_calls`."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class StreamDelta:
    """What one piece of model text added: content to show and tool-call pieces (either may be empty)."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


def parse_tool_calls(text: str, fmt: ToolFormat,
                     make_id: Callable[[], str] = new_call_id) -> tuple[str | None, list[ToolCall]]:
    """A whole reply as (content, calls): content is None when the reply is only calls, and is the
    text unchanged when there are none."""
    parser = ToolCallStreamParser(fmt, make_id)
    deltas = [parser.feed(text), parser.finish()]
    content = "".join(d.content for d in deltas)
    starts: list[ToolCallDelta] = []
    arguments: list[list[str]] = []
    for d in (c for delta in deltas for c in delta.tool_calls):
        if d.id is not None:
            starts.append(d)
            arguments.append([])
        arguments[d.index].append(d.arguments)
    calls = [ToolCall(s.id or "", s.name or "", "".join(a)) for s, a in zip(starts, arguments, strict=True)]
    return (content or None) if calls else content, calls


class ToolCallStreamParser:
    """Splits streamed model text into content and tool-call deltas (see the module docstring)."""

    def __init__(self, fmt: ToolFormat, make_id: Callable[[], str] = new_call_id) -> None:
        self._fmt = fmt
        self._make_id = make_id
        self._buf = ""  # text not yet resolved into content or a call
        self._call: _Call | None = None
        self._calls = 0  # calls emitted so far: the next call's index
        # qwen: whitespace held back at the end of the content (dropped if a call follows), and whether
        # a call just ended (whitespace after it is dropped)
        self._held_ws = ""
        self._after_call = False
        # llama3: "start" (only whitespace or the python tag so far), "calls" (a call began), "text" (no more calls)
        self._llama = "start"

    @property
    def calls(self) -> int:
        """Tool calls parsed so far, the one in progress excepted (after `finish`, all of them: the API's
        finish_reason is "tool_calls" when there were any)."""
        return self._calls

    def feed(self, text: str) -> StreamDelta:
        out = StreamDelta()
        self._buf += text
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
                self._content(out, call.raw)
        if self._fmt == "qwen":
            out.content += self._held_ws
        elif self._llama == "start":
            out.content += self._buf  # only whitespace (or part of the python tag) came
        self._buf = self._held_ws = ""
        return out

    def _run(self, out: StreamDelta, final: bool) -> None:
        while True:
            call = self._call
            if call is None:
                if not self._buf or not self._begin_call(out, final):
                    return
                continue
            call.feed(self._buf, out.tool_calls)
            self._buf = ""
            if not (call.done or call.failed):
                return
            self._call, self._buf = None, call.rest
            if call.failed:  # not a call after all: its text is content (llama3: and so is the rest)
                if self._fmt == "llama3":
                    self._llama = "text"
                self._content(out, call.raw)
            else:
                self._calls += 1
                self._after_call = True

    def _begin_call(self, out: StreamDelta, final: bool) -> bool:
        """Emit the content before the next call and start that call; False when none can start yet."""
        if self._fmt == "qwen":
            at = self._buf.find(TOOL_CALL_OPEN)
            if at < 0:  # hold back what may be the start of the tag
                keep = 0 if final else _partial_suffix(self._buf, TOOL_CALL_OPEN)
                self._content(out, self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return False
            self._content(out, self._buf[:at])
            lead, self._held_ws = self._held_ws + TOOL_CALL_OPEN, ""  # whitespace before a call is dropped
            self._buf = self._buf[at + len(TOOL_CALL_OPEN):]
            self._call = _Call("qwen", self._calls, self._make_id, lead)
            return True
        if self._llama == "text":
            out.content += self._buf
            self._buf = ""
            return False
        head = self._buf.lstrip(" \t\r\n;" if self._llama == "calls" else " \t\r\n")
        if self._llama == "start" and head.startswith(PYTHON_TAG):
            head = head[len(PYTHON_TAG):].lstrip()
        elif self._llama == "start" and PYTHON_TAG.startswith(head):
            return False  # only whitespace, or part of the python tag: nothing decided yet
        if not head:
            return False
        if head[0] != "{":  # plain text: a reply that starts so has no calls, one after calls ends them
            out.content += head if self._llama == "calls" else self._buf
            self._llama, self._buf = "text", ""
            return False
        lead = self._buf[:len(self._buf) - len(head)] if self._llama == "start" else ""
        self._llama, self._buf = "calls", head
        self._call = _Call("llama3", self._calls, self._make_id, lead)
        return True

    def _content(self, out: StreamDelta, text: str) -> None:
        """Emit content. qwen: whitespace right after a call is dropped, and trailing whitespace is held
        back (a call after it drops it)."""
        if self._fmt == "llama3":
            out.content += text
            return
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if not body:
            self._held_ws += text
            return
        out.content += self._held_ws + body
        self._held_ws = text[len(body):]


class _Call:
    """One call's text as it streams in: after `<tool_call>` (qwen), or from its `{` (llama3); `lead`
    is what came before it (the tag, whitespace), given back with the call's text if it is no call.

    The usual shape, `{"name": "...", "arguments": {...}}`, is streamed: the first delta as soon as the
    name is complete, then the arguments' text as it comes. Anything else is collected to the call's
    end (qwen: `</tool_call>`; llama3: the outer object's closing brace) and parsed whole; if it is not
    a call, `failed` is set and `raw` is its text. Once `done` or `failed`, `rest` is the text after it."""

    def __init__(self, fmt: ToolFormat, index: int, make_id: Callable[[], str], lead: str) -> None:
        self._fmt = fmt
        self._lead = lead
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
            text = text[:self._end] + (TOOL_CALL_CLOSE if self._fmt == "qwen" else "")
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
        """Where the call's text ends (qwen: at its closing tag; llama3: after the outer closing brace);
        sets `rest`. None while the end has not come."""
        if self._fmt == "qwen":
            at = self._text.find(TOOL_CALL_CLOSE, self._pos)
            if at < 0:
                self._pos = max(self._pos, len(self._text) - len(TOOL_CALL_CLOSE) + 1)
                return None
            self._end, self.rest = at, self._text[at + len(TOOL_CALL_CLOSE):]
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


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
