"""What a prompt may be, everywhere it is accepted (in process, on the wire, in the clients)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeGuard

ChatMessage = dict[str, Any]
"""One chat turn: {"role": ..., "content": ...}, rendered through the model's chat template; an
assistant turn may carry `tool_calls`, a "tool" turn its `tool_call_id` (OpenAI's shapes)."""

Tools = list[dict[str, Any]]
"""OpenAI function tools ({"type": "function", "function": {"name", "description", "parameters"}})."""

Prompt = str | list[int] | list[ChatMessage]
"""Text, token ids given directly, or chat messages."""


def is_chat(prompt: Prompt) -> TypeGuard[list[ChatMessage]]:
    """A non-empty list of dicts: chat messages (their keys are checked where they are rendered)."""
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def is_token_ids(prompt: Prompt) -> TypeGuard[list[int]]:
    """A list of ints (bools are not token ids)."""
    return isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)


# apply_chat_template's own arguments and the variables it sets: no chat_template_kwargs key may be one of them
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                      "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                      "truncation", "max_length", "return_tensors", "return_dict",
                                      "return_assistant_tokens_mask", "tokenizer_kwargs"})


def check_template_kwargs(kwargs: Mapping[str, Any] | None) -> None:
    """ValueError for chat template variables a request may not set (`RESERVED_TEMPLATE_KWARGS`): the
    request itself gives them."""
    taken = sorted(set(kwargs or ()) & RESERVED_TEMPLATE_KWARGS)
    if taken:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}: the request itself gives "
                         f"{'them' if len(taken) > 1 else 'it'}")
