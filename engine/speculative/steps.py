"""A step's drafts, as the scheduler takes them: proposed within the free pages and what grammars allow
(`propose`), then cut back to what verification accepted (`verify`, a batch's with `verify_batch`). speculator.py says
why that is exact."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.scheduler.budget import next_pages
from engine.speculative.speculator import Speculator, accepted

if TYPE_CHECKING:
    from engine.batch import ForwardBatch
    from engine.kv.cache import CacheManager
    from engine.request import Req


def propose(speculator: Speculator, decoding: list[Req], running: Iterable[Req], free_pages: int,
            page_size: int) -> tuple[list[Req], dict[Req, list[int]]]:
    """The requests decoding this step and the drafts some of them verify, each cut where its grammar forbids a
    draft or the `free_pages` (after every `running` request's next token) end; requests sitting this step out
    (overlap: see `Speculator.plan`) are left out. A verifying request's `extend_len` counts its drafts."""
    if not decoding:
        return decoding, {}
    drafts, resting = speculator.plan(decoding, len(decoding))
    room = free_pages - sum(next_pages(r, page_size) for r in running)
    kept: dict[Req, list[int]] = {}
    for req, proposal in drafts.items():
        count = _draftable(req, proposal)
        while count and next_pages(req, page_size, 1 + count) - next_pages(req, page_size) > room:
            count -= 1
        room -= next_pages(req, page_size, 1 + count) - next_pages(req, page_size)
        if count:
            kept[req] = speculator.cut(req, proposal, count)
            req.extend_len = 1 + count
        else:
            speculator.cut(req, proposal, 0)
    return [r for r in decoding if r not in resting], kept


@dataclass
class Proposer:
    """The drafts of one scheduling, as the step policy asks for them (`propose` within the pages `cache` has free
    after the `running` set's next tokens), and the seconds that took; without a `speculator`, none."""

    speculator: Speculator | None
    running: Iterable[Req]
    cache: CacheManager
    seconds: float = 0.0

    def __call__(self, decoding: list[Req]) -> tuple[list[Req], dict[Req, list[int]]]:
        if self.speculator is None or not decoding:
            return decoding, {}
        start = time.perf_counter()
        proposed = propose(self.speculator, decoding, self.running, self.cache.available_size, self.cache.page_size)
        self.seconds = time.perf_counter() - start
        return proposed


def verify_batch(speculator: Speculator, batch: ForwardBatch, runs: list[tuple[int, list[int]]], tokens: list[int],
                 cache: CacheManager, counters: dict[str, int]) -> tuple[list[tuple[int, list[int]]], int]:
    """Each request's sampled rows (`runs`: its index in the batch and its rows), a verifying request's cut to the
    drafts its samples accept (`verify`); and how many drafts were accepted. Counts them in the scheduler's
    `counters`."""
    kept_runs, accepted = [], 0
    for index, rows in runs:
        drafts = batch.drafts.get(index)
        if drafts is not None:
            kept = verify(speculator, batch.reqs[index], drafts, [tokens[r] for r in rows], cache)
            counters["spec_drafts"] += 1
            counters["spec_draft_tokens"] += len(drafts)
            counters["spec_accepted_tokens"] += kept
            accepted += kept
            rows = rows[: kept + 1]
        kept_runs.append((index, rows))
    return kept_runs, accepted


def verify(speculator: Speculator, req: Req, drafts: list[int], sampled: list[int], cache: CacheManager) -> int:
    """How many of `req`'s drafts its rows' samples accept; the rest are rolled back: their positions leave
    `cached_len` and `sampled`, and pages holding only them go back to the `cache`."""
    kept = accepted(drafts, sampled)
    rejected = len(drafts) - kept
    req.cached_len -= rejected
    req.sampled -= rejected
    req.kv.truncate(cache, req.cached_len)
    speculator.verified(req, len(drafts), kept)
    return kept


def _draftable(req: Req, proposal: list[int]) -> int:
    """How many of `proposal` a request may verify: what its grammar accepts; none while its think block
    is not over and its masks depend on the block (a budget that may force its close along the drafts, or
    a grammar that starts after it): those are known only token by token (engine/reasoning.py)."""
    block = req.reply.think
    if block is not None and not block.answering and \
            (req.grammar is not None or block.may_force(req.sampled + len(proposal))):
        return 0
    return len(proposal) if req.grammar is None else req.grammar.allowed(proposal)
