"""Tool calls (OpenAI's `tools` / `tool_calls`) for the chat template families that have them.

Pure functions and small parsers: no torch, no xgrammar.

Which format a model speaks is read off its chat template (`tool_format`), because the template is
what teaches the model the syntax. Each format is one module with one `ToolSyntax` (base.py), listed in
formats.py; a new format is a new module there:

- "qwen" (qwen.py): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` after any text.
- "llama3" (llama3.py): the whole reply is `{"name": ..., "parameters": {...}}` calls, ";"-separated.
- None: the template knows no tools; a request with tools should be refused (400).

The pieces, in the order a chat request meets them:

    fmt = tool_format(tokenizer)                                # None: refuse `tools`
    messages = template_messages(openai_messages)               # tool_calls' arguments as the templates want them
    ids = apply_chat_template(tokenizer, messages, tools=tools)  # engine/tokenizer.py renders the tools
    spec = forced_tool_grammar(fmt, tools, name=None)           # tool_choice "required" (name: a named function)
    # generate (with `spec` as the request's grammar when forced), then
    content, calls = parse_tool_calls(text, fmt)                # non-streaming
    parser = ToolCallStreamParser(fmt)                          # streaming: feed(text delta) -> StreamDelta
    delta = parser.feed(piece); ...; delta = parser.finish()    # assemble(deltas): the whole reply

Streaming follows OpenAI's chunks: a call's first delta carries its index, id, type "function", the
function's name and arguments ""; later ones carry fragments of the arguments' JSON text, in order
(json_call.py reads a call's JSON the same way in every format). Streamed content equals the
non-streaming content exactly (the non-streaming parse is the streaming parser fed the whole text). A
call cut off by max_tokens keeps the arguments it got (finish_reason "length" says so); an unclosed tag
whose body never became a call is given back as content.
"""

from engine.tools.base import StreamDelta, ToolCall, ToolCallDelta, ToolFormat, ToolSyntax, new_call_id
from engine.tools.forcing import InvalidTools, forced_tool_grammar, tool_call_schema, tool_functions
from engine.tools.formats import FORMATS, tool_format
from engine.tools.messages import template_messages
from engine.tools.stream import ToolCallStreamParser, assemble, parse_tool_calls

__all__ = [
    "FORMATS",
    "InvalidTools",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStreamParser",
    "ToolFormat",
    "ToolSyntax",
    "assemble",
    "forced_tool_grammar",
    "new_call_id",
    "parse_tool_calls",
    "template_messages",
    "tool_call_schema",
    "tool_format",
    "tool_functions",
]
