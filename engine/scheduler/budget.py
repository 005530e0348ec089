"""The pages a running request needs next (admission, the step policy and speculation count with it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.pages import pages_for

if TYPE_CHECKING:
    from engine.request import Req


def next_pages(req: Req, page_size: int, tokens: int = 1) -> int:
    """New pages a running request needs for its next `tokens` query tokens (its next token and drafts)."""
    return max(0, pages_for(req.cached_len + tokens, page_size) - len(req.kv.pages))
