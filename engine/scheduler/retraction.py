"""Room for the running set's next tokens, made before anyone is admitted: by dropping waiting requests'
tier loads, else by retracting running requests; then the pages each scheduled request writes, claimed.

Retraction (optimistic admission, engine/scheduler/admission.py): when the running set's next tokens need
more pages than are free or evictable, running requests go back to the front of the waiting queue in
`PrefillManager.retraction_order` (admission's order reversed: latest arrival first, under the priority
policy lowest priority first). Their written pages go to the prefix cache, so their next admission
recomputes only what was evicted meanwhile, and they keep their output and sampling seed: a retracted
request samples exactly the tokens it would have. A retraction happens only with no batch in flight (a
batch in flight still writes the victims' pages); until then the scheduler schedules nothing and the step
loop processes the batch in flight first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from engine.request import Req, ReqState
from engine.scheduler.budget import next_pages

if TYPE_CHECKING:
    from engine.kv.cache import CacheManager
    from engine.kv.table import RequestTable
    from engine.scheduler.admission import Admission
    from engine.scheduler.decode import DecodeManager
    from engine.scheduler.prefill import PrefillManager


class Retraction:
    """`release`: the scheduler's one cleanup path (slot back, pages to the cache); `counters`: the
    scheduler's, whose "retractions" this counts."""

    def __init__(self, cache: CacheManager, prefill: PrefillManager, decode: DecodeManager, admission: Admission,
                 release: Callable[[Req], None], counters: dict[str, int]) -> None:
        self.cache, self.prefill, self.decode, self.admission = cache, prefill, decode, admission
        self.release = release
        self.counters = counters

    def make_room(self, live: Iterable[Req], inflight: bool) -> bool:
        """Free or evictable pages for every running request's next token, retracting `live` requests until
        there are; False (and nothing changed) while a batch is `inflight` and pages are short."""
        page_size = self.cache.page_size
        need = sum(next_pages(r, page_size) for r in self.decode.running.values())
        if need <= self.cache.available_size:
            return True
        live = list(live)
        self._drop_loads(live)
        if need <= self.cache.available_size:
            return True
        if inflight:
            return False
        victims = self.prefill.retraction_order(r for r in live if r.kv.slot is not None
                                                and r.state is not ReqState.FINISHED)
        while need > self.cache.available_size:
            if len(victims) <= 1:  # cannot happen: a prompt that fits the pool alone is refused at submission
                raise RuntimeError(f"KV pool of {self.cache.allocator.num_pages} pages cannot hold one request")
            victim = victims.pop(0)
            if victim.rid in self.decode.running:
                need -= next_pages(victim, page_size)
            self.retract(victim)
        return True

    def claim(self, reqs: list[Req], table: RequestTable, window: int | None) -> None:
        """Claim pages for the positions this step writes (room was made for them, so this cannot fail), after
        giving back those every layer's sliding `window` has passed: this step's first query (position cached_len)
        reads keys from cached_len - window + 1 on. A batch in flight may still write those, but runs before any
        step that could reuse them."""
        page_size = self.cache.page_size
        for req in reqs:
            if window is not None:
                passed = max(0, min(req.cached_len - window + 1, req.total_len)) // page_size
                req.kv.trim_front(self.cache, passed, req.tokens)
            req.kv.grow(self.cache, table, req.rid, req.cached_len + req.extend_len)

    def retract(self, req: Req) -> None:
        """Back to the front of the waiting queue, holding nothing; its written pages go to the cache."""
        self.decode.remove_req(req)
        self.prefill.remove_req(req)
        self.release(req)
        req.cached_len, req.extend_len = 0, 0
        req.state = ReqState.WAITING
        req.retractions += 1
        self.counters["retractions"] += 1
        self.admission.retracted()
        self.prefill.put_back(req)

    def _drop_loads(self, live: list[Req]) -> None:
        """Waiting requests' KV loads from the tiers give their pages back (a request loads again when it is next
        considered): running requests' next tokens come before a waiting prefix, and retracting a running request
        for pages a waiting one holds would retract the last one in a tight pool."""
        for req in live:
            if req.kv.slot is None:
                req.kv.drop_load(self.cache)
