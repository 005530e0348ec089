"""KV capacity arithmetic shared by admission (prefill) and the running set (decode)."""

from __future__ import annotations

from engine.request import Req


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def reserved_pages(req: Req, page_size: int) -> int:
    """Pages this request may still claim: its whole output budget is reserved up front, so
    nothing ever needs preempting."""
    return pages_for(req.kv_budget, page_size) - len(req.pages)
