"""`tools` checked, and the grammar that forces calls (tool_choice "required" or a named function)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from engine.structured import GrammarSpec
from engine.tools.base import ToolFormat
from engine.tools.formats import FORMATS


class InvalidTools(ValueError):
    """`tools` or `tool_choice` that cannot work; the message says what to change."""


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
    key = FORMATS[fmt].argument_key
    variants = [{"type": "object", "properties": {"name": {"const": n}, key: params},
                 "required": ["name", key], "additionalProperties": False} for n, params in functions.items()]
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def forced_tool_grammar(fmt: ToolFormat, tools: Sequence[Mapping[str, Any]], name: str | None = None,
                        one: bool = False) -> GrammarSpec:
    """The grammar that makes the model's whole reply tool calls (tool_choice "required"; with `name`,
    tool_choice {"type": "function", "function": {"name": name}}, one call), in the format it was taught
    (each format's `forced_grammar`), so `parse_tool_calls` finds them and their arguments match the tools'
    parameter schemas; `one`: a single call (parallel calls switched off). InvalidTools if the tools are
    malformed or `name` is not among them."""
    return FORMATS[fmt].forced_grammar(tool_call_schema(fmt, tools, name), one=one or name is not None)
