"""Live stats: counters and recent steps recorded by the server, and complete snapshots built from an LLM.

A snapshot names every waiting and running request, every request slot and every KV page, so a
dashboard that subscribes late (PUB/SUB drops what was sent before it joined) can draw the whole
scheduler from one message.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

from engine.service.protocol import Counters, Pages, RunningReq, Stats, StepRecord, WaitingReq

if TYPE_CHECKING:  # only the engine process builds snapshots; `minichat status` just formats them
    from engine.llm import LLM
    from engine.outputs import StepResult
    from engine.scheduler.snapshot import PageSnapshot, SchedulerCounters

RATE_WINDOW = 2.0  # seconds of recent steps that token and step rates average over


class StatsRecorder:
    """Counts what the server did (submissions, refusals), remembers the last `history` steps, and turns
    the scheduler's read-only snapshot into a complete `Stats` message."""

    def __init__(self, llm: LLM, history: int = 32) -> None:
        self.llm = llm
        self.start = time.monotonic()
        self.seq = 0
        self.submitted = self.errors = self.steps = 0
        self.unscheduled_aborts = 0  # requests aborted before they reached the scheduler (while tokenizing)
        self.recent: deque[StepRecord] = deque(maxlen=history)
        self._window: deque[tuple[float, int, int]] = deque()  # (end time, prefill tokens, decode tokens)

    def record_step(self, result: StepResult) -> None:
        if result.kind == "idle":
            return
        now = time.monotonic()
        self.steps += 1
        self.recent.append(StepRecord(index=self.steps, kind=result.kind, rids=result.rids,
                                      num_tokens=result.num_tokens, duration=result.duration,
                                      at=now - self.start))
        self._window.append((now, result.num_prefill_tokens, result.num_decode_tokens))

    def _counters(self, now: float, counts: SchedulerCounters) -> Counters:
        while self._window and self._window[0][0] < now - RATE_WINDOW:
            self._window.popleft()
        span = max(min(RATE_WINDOW, now - self.start), 1e-3)
        prefill = sum(n for _, n, _ in self._window)
        decode = sum(n for _, _, n in self._window)
        return Counters(submitted=self.submitted, finished=counts.finished,
                        aborted=counts.aborted + self.unscheduled_aborts, errors=self.errors, steps=counts.steps,
                        prefill_tokens=counts.prefill_tokens,
                        decode_tokens=counts.decode_tokens, prefill_tokens_per_s=prefill / span,
                        decode_tokens_per_s=decode / span, steps_per_s=len(self._window) / span,
                        retractions=counts.retractions)

    def snapshot(self) -> Stats:
        now = time.monotonic()
        snap = self.llm.stats()
        self.seq += 1
        return Stats(seq=self.seq, time=time.time(), uptime=now - self.start, model=Path(self.llm.model_path).name,
                     waiting=[WaitingReq(rid=w.rid, prompt_tokens=w.prompt_tokens, waited=now - w.arrival_time,
                                         reason=w.reason, priority=w.priority, retractions=w.retractions,
                                         generated=w.generated, client=w.client) for w in snap.waiting],
                     running=[RunningReq(rid=r.rid, slot=r.slot, state=r.state, prompt_tokens=r.prompt_tokens,
                                         prefilled=r.prefilled, generated=r.generated, max_tokens=r.max_tokens,
                                         pages=r.pages, priority=r.priority, retractions=r.retractions,
                                         client=r.client)
                              for r in snap.running],
                     slots=list(snap.slots), pages=_pages(snap.pages), counters=self._counters(now, snap.counters),
                     steps=list(self.recent), admission=snap.admission, policy=snap.policy)


def _pages(pages: PageSnapshot) -> Pages:
    states = ["."] * pages.total
    for page in pages.owners:
        states[page] = "R"
    for page, locked in pages.cached_pages.items():
        states[page] = "L" if locked else "c"
    return Pages(page_size=pages.page_size, states="".join(states), owners=dict(pages.owners), free=pages.free,
                 held=pages.used, cached=pages.cached - pages.locked, locked=pages.locked, total=pages.total,
                 claimed=pages.claimed)
