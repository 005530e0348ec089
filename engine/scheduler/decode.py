"""DecodeManager: the running set, advanced one token per request per decode step."""

from __future__ import annotations

from engine.request import Req, ReqState
from engine.scheduler.budget import reserved_pages


class DecodeManager:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.running: dict[str, Req] = {}

    @property
    def runnable(self) -> bool:
        return bool(self.running)

    def filter_reqs(self, reqs: list[Req]) -> None:
        """Keep the batch's requests that still have output budget (EOS is handled at processing)."""
        for req in reqs:
            if req.state is not ReqState.FINISHED and req.can_decode:
                req.state = ReqState.RUNNING
                self.running[req.rid] = req

    def remove_req(self, req: Req) -> None:
        self.running.pop(req.rid, None)

    def inflight_pages(self) -> int:
        """KV pages the running set may still claim (the seed's inflight token reservation, in pages)."""
        return sum(reserved_pages(r, self.page_size) for r in self.running.values())

    def schedule_next_batch(self) -> list[Req] | None:
        """Every running request, in arrival order, one token each."""
        if not self.running:
            return None
        reqs = sorted(self.running.values(), key=lambda r: r.uid)
        for req in reqs:
            req.extend_len = 1
        return reqs
