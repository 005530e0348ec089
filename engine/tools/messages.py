"""OpenAI chat messages as HF chat templates take them, tool calls of earlier turns included."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from typing import Any


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
