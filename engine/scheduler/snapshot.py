"""A read-only picture of the scheduler, for LLM.stats(), the server and its stats publisher.

Everything outside the scheduler reads queues, slots and pages through this, never through the
managers' internals, so the scheduler can change how it keeps them. Taking one copies only small
host lists (O(requests + pages)); the server takes one only when someone is listening.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from engine.request import ReqState
from engine.scheduler.budget import reserved_pages

if TYPE_CHECKING:
    from engine.scheduler.scheduler import Scheduler


@dataclass(frozen=True)
class WaitingEntry:
    rid: str
    prompt_tokens: int
    arrival_time: float  # time.monotonic() at submission


@dataclass(frozen=True)
class RunningEntry:
    """An admitted, unfinished request: `state` is "prefilling" (prompt mid-chunk) or "running"."""

    rid: str
    slot: int
    state: str
    prompt_tokens: int
    prefilled: int
    generated: int
    max_tokens: int
    pages: int
    reserved_pages: int


@dataclass(frozen=True)
class PageSnapshot:
    """Every KV page is exactly one of free, used (held by a request: `owners`) or cached (`cached`,
    mapped to whether a running request locks it). `reserved` is what admitted requests may still
    claim for their output budget (admission keeps it free)."""

    page_size: int
    total: int
    free: int
    used: int
    cached: int
    locked: int
    reserved: int
    owners: Mapping[int, str]
    cached_pages: Mapping[int, bool]


@dataclass(frozen=True)
class SchedulerCounters:
    steps: int
    prefill_tokens: int
    decode_tokens: int
    finished: int
    aborted: int


@dataclass(frozen=True)
class SchedulerSnapshot:
    waiting: tuple[WaitingEntry, ...]  # arrival order
    running: tuple[RunningEntry, ...]  # arrival order
    slots: tuple[str | None, ...]  # request id holding each request slot
    pages: PageSnapshot
    counters: SchedulerCounters
    inflight_batches: int  # scheduled but not yet processed (overlap keeps up to two)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and not self.inflight_batches


def take_snapshot(scheduler: Scheduler) -> SchedulerSnapshot:
    s = scheduler
    alloc = s.cache.allocator
    cached = s.cache.cached_pages()
    admitted = sorted(((r, r.slot) for r in s.reqs.values() if r.slot is not None), key=lambda held: held[0].uid)
    running = tuple(
        RunningEntry(rid=r.rid, slot=slot, state="prefilling" if r.state is ReqState.PREFILLING else "running",
                     prompt_tokens=r.input_len, prefilled=min(r.cached_len, r.input_len), generated=len(r.output_ids),
                     max_tokens=r.max_output, pages=len(r.pages), reserved_pages=reserved_pages(r, s.page_size))
        for r, slot in admitted)
    locked = sum(cached.values())
    pages = PageSnapshot(page_size=s.page_size, total=alloc.num_pages, free=alloc.num_free, used=len(alloc.owner),
                         cached=len(cached), locked=locked, reserved=sum(e.reserved_pages for e in running),
                         owners=MappingProxyType(dict(alloc.owner)), cached_pages=MappingProxyType(cached))
    waiting = tuple(WaitingEntry(r.rid, r.input_len, r.arrival_time) for r in s.prefill_manager.waiting)
    return SchedulerSnapshot(waiting=waiting, running=running, slots=tuple(s.table.holder), pages=pages,
                             counters=SchedulerCounters(**s.counters), inflight_batches=s.inflight_batches)
