"""Live stats: counters and recent steps recorded by the server, and snapshots built from an LLM.

A snapshot names every waiting and running request and every request slot, so a dashboard that
subscribes late (PUB/SUB drops what was sent before it joined) can draw the whole scheduler from one
message; the KV pages too, but those cost what moved rather than the pool size: a snapshot lists every
page as runs only when asked (a new subscriber), every FULL_EVERY seconds, or when the pages changed
since the last complete list outnumber its runs (so that list costs no more than the changes would);
the others list just those pages, to lay over it (protocol.Pages). The clients keep the newest complete
list (engine/service/client/core.py's StatsFeed).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.outputs import Final
from engine.service.protocol import Counters, Pages, Stats, StepRecord

if TYPE_CHECKING:  # only the engine process builds snapshots; `minichat status` just formats them
    from engine.llm import LLM
    from engine.outputs import StepResult
    from engine.scheduler.snapshot import PageSnapshot, SchedulerCounters, WaitingEntry

RATE_WINDOW = 2.0  # seconds of recent steps that token and step rates average over
TTFT_WINDOW = 10.0  # seconds of first tokens whose TTFTs a snapshot carries ...
MAX_TTFTS = 256  # ... the latest this many of them
FULL_EVERY = 5.0  # seconds between complete page lists at most, for a subscriber that lost one
FULL_SPACING = 0.25  # and at least, however many subscribers ask for one


class StatsRecorder:
    """Counts what the server did (submissions, refusals), remembers the last `history` steps, and turns
    the scheduler's read-only snapshot into a complete `Stats` message."""

    def __init__(self, llm: LLM, history: int = 32, preparing: Callable[[], list[WaitingEntry]] = list) -> None:
        """`preparing`: the requests not queued yet (tokenizing, compiling their grammar), listed first among
        the waiting, with that as their reason."""
        self.llm = llm
        self.preparing = preparing
        self.start = time.monotonic()
        self.seq = 0
        self.submitted = self.errors = self.steps = 0
        self.unscheduled_aborts = 0  # requests aborted before they reached the scheduler (while tokenizing)
        self.recent: deque[StepRecord] = deque(maxlen=history)
        # (end time, prefill tokens, decode tokens, drafts verified, drafts accepted) per step
        self._window: deque[tuple[float, int, int, int, int]] = deque()
        self._ttfts: deque[tuple[float, float]] = deque(maxlen=MAX_TTFTS)  # (when, TTFT) of recent first tokens
        self._started: set[str] = set()  # live requests whose first token is counted
        self._changed = llm.watch_pages()  # pages whose state changed since the last complete list
        self._full_seq = 0  # the snapshot that last listed every page (none yet)
        self._full_at = -math.inf
        self._full_runs = 0  # how many runs it had
        self._full_wanted = False  # a new subscriber asked for one that FULL_SPACING has held back

    def record_step(self, result: StepResult) -> None:
        now = time.monotonic()
        self._record_ttfts(result, now)  # an idle result still carries the Finals of aborted requests
        if result.kind == "idle":
            return
        self.steps += 1
        self.recent.append(StepRecord(index=self.steps, kind=result.kind, rids=result.rids,
                                      num_tokens=result.num_tokens, duration=result.duration,
                                      at=now - self.start))
        self._window.append((now, result.num_prefill_tokens, result.num_decode_tokens, result.num_draft_tokens,
                             result.num_accepted_tokens))

    def _record_ttfts(self, result: StepResult, now: float) -> None:
        """The TTFT of each request whose first token this step made: from its Final if it ended at once,
        else from the live request (a Delta carries no timings)."""
        for out in result.outputs:
            if out.rid in self._started:
                if out.finished:
                    self._started.discard(out.rid)
                continue
            if isinstance(out, Final):
                ttft = out.timings.ttft
            else:
                req = self.llm.request(out.rid)
                ttft = None if req is None else req.ttft
                if ttft is None:
                    continue
                self._started.add(out.rid)
            if ttft is not None:
                self._ttfts.append((now, ttft))

    def _counters(self, now: float, counts: SchedulerCounters) -> Counters:
        while self._window and self._window[0][0] < now - RATE_WINDOW:
            self._window.popleft()
        span = max(min(RATE_WINDOW, now - self.start), 1e-3)
        prefill, decode, drafted, accepted = (sum(step[i] for step in self._window) / span for i in range(1, 5))
        return Counters(submitted=self.submitted, finished=counts.finished,
                        aborted=counts.aborted + self.unscheduled_aborts, errors=self.errors, steps=counts.steps,
                        prefill_tokens=counts.prefill_tokens,
                        decode_tokens=counts.decode_tokens, prefill_tokens_per_s=prefill,
                        decode_tokens_per_s=decode, steps_per_s=len(self._window) / span,
                        retractions=counts.retractions, spec_drafts=counts.spec_drafts,
                        spec_draft_tokens=counts.spec_draft_tokens, spec_accepted_tokens=counts.spec_accepted_tokens,
                        spec_draft_tokens_per_s=drafted, spec_accepted_tokens_per_s=accepted,
                        hit_tokens_pool=counts.hit_tokens_pool, hit_tokens_host=counts.hit_tokens_host,
                        hit_tokens_disk=counts.hit_tokens_disk)

    def _full_due(self, now: float, asked: bool) -> bool:
        """Whether the next snapshot lists every page (see the module docstring)."""
        self._full_wanted |= asked
        since = now - self._full_at
        return since >= FULL_EVERY or (self._full_wanted and since >= FULL_SPACING) or \
            len(self._changed) > self._full_runs

    def snapshot(self, full: bool = False) -> Stats:
        """The next snapshot; `full`: a new subscriber wants every page listed."""
        now = time.monotonic()
        full = self._full_due(now, full)
        snap = self.llm.stats(None if full else self._changed)
        self.seq += 1
        if full:
            self._changed.clear()
            self._full_seq, self._full_at, self._full_runs = self.seq, now, len(snap.pages.runs)
            self._full_wanted = False
        return Stats(seq=self.seq, time=time.time(), uptime=now - self.start, model=self.llm.checkpoint.name,
                     waiting=[*self.preparing(), *snap.waiting], running=list(snap.running),
                     slots=list(snap.slots), pages=self._pages(snap.pages), counters=self._counters(now, snap.counters),
                     steps=list(self.recent), admission=snap.admission, policy=snap.policy,
                     ttfts=[ttft for at, ttft in self._ttfts if at >= now - TTFT_WINDOW])

    def _pages(self, pages: PageSnapshot) -> Pages:
        return Pages(page_size=pages.page_size, free=pages.free, held=pages.held, cached=pages.cached - pages.locked,
                     locked=pages.locked, total=pages.total, claimed=pages.claimed, base=self._full_seq,
                     runs=list(pages.runs), owners=list(pages.owners), tiers=list(pages.tiers), dtype=pages.dtype,
                     page_bytes=pages.page_bytes)
