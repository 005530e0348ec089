"""KV page arithmetic shared by admission, the scheduler, speculation and the engine's sizing."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.request import Req


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def next_pages(req: Req, page_size: int, tokens: int = 1) -> int:
    """New pages a running request needs for its next `tokens` query tokens (its next token and drafts)."""
    return max(0, pages_for(req.cached_len + tokens, page_size) - len(req.pages))
