"""The tool-call formats minichat reads, by name, and which one a tokenizer's chat template teaches."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from engine.tools.base import ToolFormat, ToolSyntax
from engine.tools.llama3 import Llama3Syntax
from engine.tools.qwen import QwenSyntax

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# in the order templates are tried: the first whose markers a template has is its format
FORMATS: dict[ToolFormat, type[ToolSyntax]] = {"qwen": QwenSyntax, "llama3": Llama3Syntax}


def tool_format(tokenizer: PreTrainedTokenizerBase | None) -> ToolFormat | None:
    """The tool-call format the tokenizer's chat template teaches, by markers in the template's text;
    None when it has none. A template dict (named templates) is read at its "tool_use" entry, the one
    transformers renders when tools are given, else at "default"."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        template = template.get("tool_use") or template.get("default")
    if not isinstance(template, str):
        return None
    return next((name for name, syntax in FORMATS.items() if syntax.taught_by(template)), None)
