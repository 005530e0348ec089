"""PrefillManager (the waiting queue) and PrefillAdder (admission under three separate limits)."""

from __future__ import annotations

import time
from collections import deque

from engine.kv.cache import CacheManager
from engine.kv.table import RequestTable
from engine.request import Req, ReqState
from engine.scheduler.budget import pages_for, reserved_pages


class PrefillAdder:
    """Builds one prefill batch. A request enters only if all three limits hold:

    1. a free request slot (`table.available_size`),
    2. the step's prefill token budget (what is left goes to the next request; a prompt longer
       than that is chunked),
    3. the KV capacity estimate: pages for prompt + whole output budget, plus everything already
       reserved by running requests and this batch, must fit in free + evictable pages.
    """

    def __init__(self, token_budget: int, reserved: int, table: RequestTable, cache: CacheManager) -> None:
        self.token_budget = token_budget
        self.reserved = reserved
        self.table = table
        self.cache = cache
        self.page_size = cache.page_size

    def _take_chunk(self, req: Req) -> None:
        req.extend_len = min(self.token_budget, req.remaining_prompt)
        self.token_budget -= req.extend_len

    def continue_chunked(self, req: Req) -> None:
        """A chunked request was admitted earlier; it only needs budget, and goes first."""
        self._take_chunk(req)
        self.reserved += reserved_pages(req, self.page_size)

    def try_add_one(self, req: Req) -> bool:
        if self.token_budget <= 0 or self.table.available_size == 0:
            return False
        # Match at most input_len - 1 tokens: the last prompt token must be computed to get logits.
        match = self.cache.match_prefix(req.input_ids[: req.input_len - 1])
        self.cache.lock(match.handle)  # locking can make cached pages unevictable, so check after it
        need = pages_for(req.kv_budget, self.page_size) - len(match.pages)
        if need + self.reserved > self.cache.available_size:
            self.cache.unlock(match.handle)
            return False
        req.prefix = match
        req.pages = list(match.pages)
        req.cached_len = req.prefix_len = len(match.pages) * self.page_size
        req.slot = self.table.allocate(req.rid)
        self.table.write_pages(req.slot, 0, req.pages, self.page_size)
        req.admit_time = time.monotonic()
        self.reserved += need
        self._take_chunk(req)
        return True


class PrefillManager:
    """The waiting queue, in arrival order, plus the one request whose prompt is mid-chunk."""

    def __init__(self, table: RequestTable, cache: CacheManager) -> None:
        self.table = table
        self.cache = cache
        self.waiting: deque[Req] = deque()
        self.chunked: Req | None = None

    @property
    def runnable(self) -> bool:
        return bool(self.waiting) or self.chunked is not None

    def add_one_req(self, req: Req) -> None:
        self.waiting.append(req)

    def remove_req(self, req: Req) -> None:
        if self.chunked is req:
            self.chunked = None
        elif req in self.waiting:
            self.waiting.remove(req)

    def schedule_next_batch(self, token_budget: int, reserved: int) -> list[Req] | None:
        """Admit waiting requests in order until the first one that does not fit."""
        adder = PrefillAdder(token_budget, reserved, self.table, self.cache)
        reqs: list[Req] = []
        if self.chunked is not None:
            adder.continue_chunked(self.chunked)
            reqs.append(self.chunked)
            self.chunked = None
        while self.waiting and adder.try_add_one(self.waiting[0]):
            reqs.append(self.waiting.popleft())
        if not reqs:
            return None
        for req in reqs:
            req.state = ReqState.PREFILLING
        if reqs[-1].extend_len < reqs[-1].remaining_prompt:
            self.chunked = reqs[-1]
        return reqs
