"""KV page arithmetic shared by admission, the scheduler and the engine's sizing."""

from __future__ import annotations


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)
