"""DecodeManager: the running set, advanced one token per request per decode step."""

from __future__ import annotations

from engine.request import Req, ReqState


class DecodeManager:
    def __init__(self) -> None:
        self.running: dict[str, Req] = {}

    @property
    def runnable(self) -> bool:
        return bool(self.running)

    def filter_reqs(self, reqs: list[Req]) -> None:
        """After scheduling: the batch's requests that may sample another token join (or stay in) the
        running set; those whose length budget is now spent leave it, so no later step is scheduled
        past their reserved pages (EOS and stop strings are only known at processing)."""
        for req in reqs:
            if req.state is ReqState.FINISHED:
                continue
            req.state = ReqState.RUNNING
            if req.can_decode:
                self.running[req.rid] = req
            else:
                self.running.pop(req.rid, None)

    def remove_req(self, req: Req) -> None:
        self.running.pop(req.rid, None)

    def schedule_next_batch(self) -> list[Req] | None:
        """Every running request, in arrival order, one token each."""
        if not self.running:
            return None
        reqs = sorted(self.running.values(), key=lambda r: r.uid)
        for req in reqs:
            req.extend_len = 1
        return reqs
