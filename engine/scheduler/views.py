"""The scheduler's state as the console and the wire see it: functions of that state, changing none of it.

`SchedulerView.snapshot` is the whole picture (queues, slots, pages, counters; the row types are in snapshot.py,
which the clients import without torch); `describe` is one live request in detail.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from engine.pages import PageMap
from engine.request import Req, ReqState
from engine.scheduler.snapshot import (
    PROMPT_ENDS,
    PageSnapshot,
    RequestDetail,
    RunningEntry,
    SchedulerCounters,
    SchedulerSnapshot,
    Speculation,
    WaitingEntry,
)

if TYPE_CHECKING:
    from engine.scheduler.scheduler import Scheduler


class SchedulerView:
    """What the engine's stats and request details read of `scheduler`. It keeps the KV page map, made at the first
    snapshot (until then nobody asks, and the allocator notes nothing)."""

    def __init__(self, scheduler: Scheduler, kv_dtype: str = "", page_bytes: int = 0) -> None:
        self.scheduler = scheduler
        self.kv_dtype, self.page_bytes = kv_dtype, page_bytes  # the pool's (engine/kv/pool.py), for the snapshots
        self.pages: PageMap | None = None

    def page_map(self) -> PageMap:
        if self.pages is None:
            self.pages = PageMap(self.scheduler.cache)
        return self.pages

    def watch_pages(self) -> set[int]:
        """A set each snapshot from now on adds the pages whose state changed to; its holder empties it,
        and gives it to `snapshot` to have only those pages listed."""
        return self.page_map().watch()

    def snapshot(self, changed: set[int] | None = None) -> SchedulerSnapshot:
        """Queues, slots, pages and counters: every page, or with `changed` (from `watch_pages`) only those."""
        return snapshot(self.scheduler, self.page_map(), changed, self.kv_dtype, self.page_bytes)

    def describe(self, rid: str, text_from: int = 0) -> RequestDetail[tuple[int, ...]] | None:
        """One live request in detail, by the client's rid or a choice's own; None when it is not live."""
        return describe(self.scheduler, rid, text_from)


def snapshot(s: Scheduler, page_map: PageMap, changed: set[int] | None = None, kv_dtype: str = "",
             page_bytes: int = 0) -> SchedulerSnapshot:
    """Queues, slots, pages and counters: every page, or with `changed` (from `PageMap.watch`) only those; the
    pages said to hold `kv_dtype`, `page_bytes` each."""
    alloc = s.cache.allocator
    page_map.refresh()
    runs, owners = page_map.runs(changed)
    held = len(alloc.owner)
    cached = alloc.num_pages - alloc.num_free - held
    admitted = sorted(((r, r.kv.slot) for r in s.reqs.values() if r.kv.slot is not None), key=lambda a: a[0].uid)
    running = tuple(
        RunningEntry(rid=r.rid, client=r.client, slot=slot,
                     state="prefilling" if r.state is ReqState.PREFILLING else "running",
                     prompt_tokens=r.input_len, prefilled=min(r.cached_len, r.input_len),
                     generated=len(r.output_ids), max_tokens=r.max_output, pages=len(r.kv.pages),
                     claimed_pages=s.admission.claim(r), priority=r.params.priority,
                     retractions=r.retractions, spec=_speculation(r))
        for r, slot in admitted)
    pages = PageSnapshot(page_size=s.page_size, total=alloc.num_pages, free=alloc.num_free, held=held,
                         cached=cached, locked=cached - s.cache.evictable_size,
                         claimed=sum(e.claimed_pages for e in running), runs=tuple(runs), owners=tuple(owners),
                         complete=changed is None, tiers=tuple(s.cache.tier_use()), dtype=kv_dtype,
                         page_bytes=page_bytes)
    now = time.monotonic()
    waiting = tuple(WaitingEntry(rid=r.rid, client=r.client, prompt_tokens=r.input_len, waited=now - r.times.arrival,
                                 reason=s.prefill_manager.reason(r), priority=r.params.priority,
                                 retractions=r.retractions, generated=len(r.output_ids))
                    for r in s.prefill_manager.ordered(s.counters["steps"]))
    hits = {f"hit_tokens_{tier}": n for tier, n in s.prefill_manager.hit_tokens.items()}
    return SchedulerSnapshot(waiting=waiting, running=running, slots=tuple(s.table.holder), pages=pages,
                             counters=SchedulerCounters(**s.counters, **hits), inflight_batches=s.inflight_batches,
                             admission=s.admission.describe(), policy=s.policy)


def describe(s: Scheduler, rid: str, text_from: int = 0) -> RequestDetail[tuple[int, ...]] | None:
    """One live request in detail (see RequestDetail), by the client's rid or a choice's own; None when it
    is not live. Costs O(PROMPT_ENDS) plus the output text from `text_from` on."""
    req = s.reqs.get(rid)
    if req is None and (group := s.groups.get(rid)) is not None and group.open:
        req = group.open[0]
    if req is None:
        return None
    waiting = req.state is ReqState.WAITING
    text = req.reply.detokenizer.text[:req.reply.detokenizer.emitted] if req.reply.detokenizer is not None else ""
    ends = PROMPT_ENDS
    return RequestDetail(
        rid=req.client_rid, client=req.client, state=req.state.value,
        reason=s.prefill_manager.reason(req) if waiting else "", params=req.params,
        prompt_tokens=req.input_len, prompt_head=tuple(req.input_ids[:ends]),
        prompt_tail=tuple(req.input_ids[-ends:]) if req.input_len > 2 * ends else (),
        cached_tokens=req.kv.cached_tokens, host_tokens=req.kv.host_tokens, disk_tokens=req.kv.disk_tokens,
        slot=req.kv.slot, pages=len(req.kv.pages),
        claimed_pages=0 if waiting else s.admission.claim(req), generated=len(req.output_ids),
        max_tokens=req.max_output, retractions=req.retractions, choices=req.params.n,
        age=time.monotonic() - req.times.arrival, ttft=req.ttft,
        queue=None if req.times.admitted is None else req.times.admitted - req.times.arrival,
        output=text[max(0, text_from):], output_chars=len(text), spec=_speculation(req))


def _speculation(req: Req) -> Speculation | None:
    spec = req.spec
    return None if spec is None else Speculation(draft_tokens=spec.proposed, accepted_tokens=spec.accepted,
                                                 verifications=spec.verifies)
