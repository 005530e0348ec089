"""What a prompt may be, everywhere it is accepted (in process, on the wire, in the clients)."""

from __future__ import annotations

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
