"""The KV page map: every page free, held by a request, cached, or cached and locked, as runs of pages.

A snapshot of it once had a character per page and an owner per held page, built ten to twenty times a
second: 70 ms and 8 MiB on the 600,000 pages an H200 holds of a 0.5B model. Now the engine keeps a
`PageMap` current from the pages the allocator and the prefix cache mark as moved, so bringing it up to
date costs what moved, and it knows where its runs start, so listing every page costs the runs, not the
pool size; the stats send the pages that changed since the last complete list (engine/service/stats.py).
Whoever reads the runs paints them back into a state per page (`paint`) and summarises a screen's worth
(`cells`). This module imports no torch: the clients use it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from itertools import pairwise, repeat
from typing import TYPE_CHECKING, Annotated, Final, Literal

import msgspec

if TYPE_CHECKING:
    from engine.kv.cache import CacheManager

# what a page is, as `minichat status --pages` prints it
FREE: Final = "."
HELD: Final = "R"
CACHED: Final = "c"
LOCKED: Final = "L"
PageState = Literal[".", "R", "c", "L"]
_STATE_OF: dict[int, PageState] = {ord(FREE): FREE, ord(HELD): HELD, ord(CACHED): CACHED, ord(LOCKED): LOCKED}
NonNegative = Annotated[int, msgspec.Meta(ge=0)]


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold `num_tokens` tokens' K/V."""
    return -(-num_tokens // page_size)


class PageRun(msgspec.Struct, array_like=True, frozen=True):
    """`length` pages from page `start`, all in `state`; `owner` indexes the list of request ids sent with
    the runs (the request holding them) when the state is held, and is -1 otherwise."""

    start: NonNegative
    length: NonNegative
    state: PageState
    owner: int = -1


class PageMap:
    """The state and holder of every page, brought up to date from the pages the allocator and the cache
    marked as moved (`refresh`). `_starts` holds each page that begins a run (differs from the page before
    it), so a complete list of runs is the sorted starts; `watch` hands out sets of the pages that changed."""

    def __init__(self, cache: CacheManager) -> None:
        self.cache = cache
        self.total = cache.allocator.num_pages
        self._states = bytearray(FREE.encode()) * self.total
        self._owners: list[str] = [""] * self.total
        self._starts: set[int] = set()
        self._watchers: list[set[int]] = []
        # from here on the allocator and the cache note what moves; what moved before is what is not free
        cache.allocator.moved = set(cache.allocator.owner) | set(cache.cached_pages())

    def watch(self) -> set[int]:
        """A set that each `refresh` adds the pages whose state changed to; its holder empties it."""
        self._watchers.append(set())
        return self._watchers[-1]

    def refresh(self) -> None:
        """Read the state of each page that moved since the last refresh (a page that moved and came back
        to where it was has not changed)."""
        alloc = self.cache.allocator
        moved, alloc.moved = alloc.moved, set()
        changed = []
        for page in moved or ():
            owner = alloc.owner.get(page)
            if owner is not None:
                state = ord(HELD)
            else:
                locked = self.cache.cached_lock(page)
                state, owner = ord(FREE if locked is None else LOCKED if locked else CACHED), ""
            if state != self._states[page] or owner != self._owners[page]:
                self._states[page], self._owners[page] = state, owner
                changed.append(page)
                self._mark_start(page)
                self._mark_start(page + 1)
        for watcher in self._watchers:
            watcher.update(changed)

    def _mark_start(self, page: int) -> None:
        if not 0 < page < self.total:
            return
        if self._states[page] != self._states[page - 1] or self._owners[page] != self._owners[page - 1]:
            self._starts.add(page)
        else:
            self._starts.discard(page)

    def runs(self, pages: Collection[int] | None = None) -> tuple[list[PageRun], list[str]]:
        """Every page as runs in page order (O(runs)), or only `pages` (O(len(pages))), where consecutive
        pages in one state and of one holder make one run; and the request ids their `owner`s index."""
        if pages is None:
            bounds = [0, *sorted(self._starts), self.total]
            spans = [(a, b - a) for a, b in pairwise(bounds)]
        else:
            spans = []
            for page in sorted(pages):
                start, length = spans[-1] if spans else (-2, 0)
                if page == start + length and page not in self._starts:
                    spans[-1] = (start, length + 1)
                else:
                    spans.append((page, 1))
        index: dict[str, int] = {}
        runs = [PageRun(start, length, _STATE_OF[self._states[start]],
                        index.setdefault(self._owners[start], len(index)) if self._owners[start] else -1)
                for start, length in spans]
        return runs, list(index)


REJECTIONS = ("truncated", "corrupt", "foreign", "missing", "unreadable", "late")
"""Why the disk tier refuses a page file (TierUse.rejected): "unreadable" is not a regular file of a page's size
(a link, a FIFO, a directory) or an OS error reading it; "late" took longer than the load deadline."""


class TierUse(msgspec.Struct, kw_only=True):
    """A KV tier below the pool (engine/kv/tiers.py), "host" or "disk": the pages it holds and can hold, their
    bytes, pages `stored` into it and `loaded` back to the pool since start, pages being read now (`loading`) and
    on their way in, not written yet (`writing`: copied into the staging ring, or waiting for room in it);
    the disk's files refused by reason (`rejected`: truncated, corrupt, foreign, missing), writes that failed,
    pages not stored (`skipped`: its queue was full or writing was paused), the seconds spent writing and
    reading, why it does not write now (`degraded`, "" when it does) and its directory (`where`). The prompt
    tokens served from each tier are the scheduler's counters (`hit_tokens_*`)."""

    name: str
    pages: int = 0
    capacity: int = 0
    bytes: int = 0
    capacity_bytes: int = 0
    stored: int = 0
    loaded: int = 0
    loading: int = 0
    writing: int = 0
    rejected: dict[str, int] = msgspec.field(default_factory=dict)
    write_errors: int = 0
    skipped: int = 0
    write_seconds: float = 0.0
    read_seconds: float = 0.0
    degraded: str = ""
    where: str = ""


def paint(total: int, runs: Iterable[PageRun], owners: Sequence[str]) -> tuple[bytearray, list[str]]:
    """A state (a byte of FREE, HELD, CACHED, LOCKED) and a holder ("" if none) per page, from runs that
    paint every page when laid in order, a later one over an earlier one. O(runs) slice writes."""
    states = bytearray(FREE.encode()) * total
    holders = [""] * total
    for run in runs:
        end = min(run.start + run.length, total)
        if run.start >= end:
            continue
        states[run.start:end] = run.state.encode() * (end - run.start)
        holders[run.start:end] = repeat(owners[run.owner] if run.owner >= 0 else "", end - run.start)
    return states, holders


_BUSIEST_FIRST = tuple((s, s.encode()) for s in (HELD, LOCKED, CACHED, FREE))


def cells(states: bytes | bytearray, holders: Sequence[str], per_cell: int) -> list[tuple[str, str]]:
    """(state, holder) for each `per_cell` pages in a row: the state most of them are in (a tie goes to
    the busier state: held, locked, cached, free) and, held, the holder of its first held page. Costs a
    few byte scans of the pages, however many cells."""
    if per_cell == 1:
        return [(chr(state), holder) for state, holder in zip(states, holders, strict=True)]
    out = []
    for first in range(0, len(states), per_cell):
        last = min(first + per_cell, len(states))
        state = max(_BUSIEST_FIRST, key=lambda s: states.count(s[1], first, last))[0]
        out.append((state, holders[states.find(HELD.encode(), first, last)] if state == HELD else ""))
    return out
