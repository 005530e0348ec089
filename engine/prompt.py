"""What a prompt may be, everywhere it is accepted (in process, on the wire, in the clients)."""

from __future__ import annotations

from typing import TypeGuard

ChatMessage = dict[str, str]
"""One chat turn: {"role": ..., "content": ...}, rendered through the model's chat template."""

Prompt = str | list[int] | list[ChatMessage]
"""Text, token ids given directly, or chat messages."""


def is_chat(prompt: Prompt) -> TypeGuard[list[ChatMessage]]:
    """A non-empty list of dicts: chat messages (their keys are checked where they are rendered)."""
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def is_token_ids(prompt: Prompt) -> TypeGuard[list[int]]:
    """A list of ints (bools are not token ids)."""
    return isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
