"""What a prompt may be, everywhere it is accepted (in process, on the wire, in the clients)."""

from __future__ import annotations

ChatMessage = dict[str, str]
"""One chat turn: {"role": ..., "content": ...}, rendered through the model's chat template."""

Prompt = str | list[int] | list[ChatMessage]
"""Text, token ids given directly, or chat messages."""
