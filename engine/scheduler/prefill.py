"""PrefillManager (the waiting queue and its order) and PrefillAdder (admission under three limits)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence

from engine.kv.cache import CacheManager, PrefixMatch
from engine.kv.table import RequestTable
from engine.request import Req, ReqState
from engine.scheduler.admission import Admission
from engine.scheduler.snapshot import WaitReason

LPM_MAX_WAITING = 128  # beyond this many waiting requests, lpm matches no prefixes and orders as fcfs


class PrefillAdder:
    """Builds one prefill batch. A request enters only if all three limits hold:

    1. a free request slot (`table.available_size`),
    2. the step's token budget (what is left goes to the next request; a prompt longer than that is
       chunked),
    3. the KV estimate: the pages admission counts the request for (`Admission.claim`), plus what it
       counts everyone already admitted for (`claimed`), fit in free + evictable pages.

    `try_add_one` names the limit a request does not fit ("slot", "token_budget", "kv_pages": a WaitReason).
    """

    def __init__(self, token_budget: int, claimed: int, table: RequestTable, cache: CacheManager,
                 admission: Admission, hit_tokens: dict[str, int]) -> None:
        self.hit_tokens = hit_tokens  # prompt tokens first admissions found cached, by tier (pool, host, disk)
        self.token_budget = token_budget
        self.claimed = claimed
        self.table = table
        self.cache = cache
        self.admission = admission

    def _take_chunk(self, req: Req) -> None:
        req.extend_len = min(self.token_budget, req.remaining_prompt)
        self.token_budget -= req.extend_len

    def continue_chunked(self, req: Req) -> None:
        """A chunked request was admitted earlier; it only needs budget, and goes first."""
        self._take_chunk(req)
        self.claimed += self.admission.claim(req)

    def try_add_one(self, req: Req) -> WaitReason | None:
        """Admit `req` (None), or name the limit it does not fit; "loading_kv" when pages of its prefix are found
        below the pool and must be loaded first (PrefillManager then passes it over until they are in). The load
        starts once its KV estimate fits, also while it waits for a slot or the next step's budget."""
        # Match at most fill_len - 1 tokens: the last one must be computed to get logits. A prompt to
        # score is computed whole: its cached part would have no logits.
        match = PrefixMatch() if req.scoring_prompt else self.cache.match_prefix(req.tokens(0, req.fill_len - 1))
        self.cache.lock(match.handle)  # locking can make cached pages unevictable, so check after it
        need = self.admission.claim(req, held=len(match.pages))
        limit: WaitReason | None = "kv_pages" if need + self.claimed > self.cache.available_size else None
        if limit is None and (below := self._load_below(req, match)) is not None:
            if below == "loaded":  # from host memory, in the tree already: match again
                self.cache.unlock(match.handle)
                return self.try_add_one(req)
            limit = "loading_kv"
        limit = limit or ("slot" if self.table.available_size == 0 else
                          "token_budget" if self.token_budget <= 0 else None)
        if limit is not None:
            self.cache.unlock(match.handle)
            return limit
        first = not req.retractions
        req.cached_len = req.kv.admit(self.cache, self.table, req.rid, match, first)
        if first:  # the prompt tokens first admissions found cached, by where they were
            kv = req.kv
            self.hit_tokens["pool"] += kv.cached_tokens - kv.host_tokens - kv.disk_tokens
            self.hit_tokens["host"] += kv.host_tokens
            self.hit_tokens["disk"] += kv.disk_tokens
        if req.times.admitted is None:
            req.times.admitted = time.monotonic()
        self.claimed += need
        self._take_chunk(req)
        return None

    def _load_below(self, req: Req, match: PrefixMatch) -> str | None:
        """Pages of the prompt past `match` that the tiers below the pool hold: start loading them ("loading"),
        or wait for another request's load of them ("loading" too); "loaded" when they came from host memory and
        are in already (admission then matches again); None when there are none (or it loaded already)."""
        if req.scoring_prompt or req.kv.loading is not None:
            return None
        tokens = req.tokens(0, req.fill_len - 1)
        below = self.cache.find_below(tokens, match)
        if below.busy:
            return "loading"
        if not below.pages:
            return None
        req.kv.start_load(self.cache, req.rid, tokens, match, below)
        return "loading" if req.kv.waits_for_load else "loaded"


class PrefillManager:
    """The waiting queue plus the one request whose prompt is mid-chunk.

    `policy` orders admission: "fcfs" (arrival; retracted requests go back to the front), "priority"
    (SamplingParams.priority, lower first, then arrival) or "lpm" (longest cached prefix first). Under
    the last two, a request that has waited `max_wait_steps` steps is admitted next (fcfs already
    admits the longest-waiting first). Admission walks that order and stops at the first request that
    does not fit; `blocked` remembers which and why (`reason`): everyone after it waits for its turn.
    A choice waiting for its group's leader to cache the prompt (`Req.held`, reason "sibling") is passed
    over meanwhile, and so is a request whose prefix's pages load from the tiers below the pool ("loading_kv").
    `hit_tokens` counts the prompt tokens first admissions found cached, in the pool, host memory or on disk.
    """

    def __init__(self, table: RequestTable, cache: CacheManager, admission: Admission, policy: str = "fcfs",
                 max_wait_steps: int = 1000) -> None:
        self.table = table
        self.cache = cache
        self.admission = admission
        self.policy = policy
        self.max_wait_steps = max_wait_steps
        self.waiting: deque[Req] = deque()
        self.chunked: Req | None = None
        self.blocked: tuple[str, WaitReason] | None = None  # (rid, limit) where the last admission stopped
        self.awaiting: set[str] = set()  # requests the last admission found waiting for another's load
        self.hit_tokens = {"pool": 0, "host": 0, "disk": 0}

    @property
    def runnable(self) -> bool:
        return bool(self.waiting) or self.chunked is not None

    def add_one_req(self, req: Req) -> None:
        self.waiting.append(req)

    def put_back(self, req: Req) -> None:
        """A retracted request: first in line again (it was admitted before everyone waiting)."""
        self.waiting.appendleft(req)

    def remove_req(self, req: Req) -> None:
        if self.chunked is req:
            self.chunked = None
        elif req in self.waiting:
            self.waiting.remove(req)

    def reason(self, req: Req) -> WaitReason:
        """Why a waiting request waits, as the last admission found: the limit that stopped it, or
        "queue" (admission stopped at a request ahead of it, or has not looked since it arrived)."""
        if req.held:
            return "sibling"
        if req.kv.waits_for_load or req.rid in self.awaiting:
            return "loading_kv"
        return self.blocked[1] if self.blocked is not None and self.blocked[0] == req.rid else "queue"

    def rank(self, req: Req) -> int:
        """Where the policy puts `req` before arrival breaks ties, lower first: its priority under
        "priority", the same for everyone under the others. Admission takes the lowest rank first,
        retraction gives up the highest first (`retraction_order`)."""
        return req.params.priority if self.policy == "priority" else 0

    def retraction_order(self, reqs: Iterable[Req]) -> list[Req]:
        """Admitted requests in the order they give up their place when the pool runs dry: admission's
        order reversed, the highest rank first, then the latest arrival."""
        return sorted(reqs, key=lambda r: (self.rank(r), r.uid), reverse=True)

    def ordered(self, step: int) -> Sequence[Req]:
        """The waiting queue in admission order at scheduler step `step` (fcfs: the queue itself)."""
        if self.policy == "fcfs":
            return self.waiting
        order = sorted(self.waiting, key=self.rank)  # stable: arrival order (retracted first) within one rank
        if self.policy == "lpm" and len(order) <= LPM_MAX_WAITING:
            cached = {r.rid: len(self.cache.match_prefix(r.tokens(0, r.fill_len - 1)).pages) for r in order}
            order.sort(key=lambda r: -cached[r.rid])
        starved = [r for r in order if step - r.times.arrival_step >= self.max_wait_steps]
        return starved + [r for r in order if r not in starved] if starved else order

    def schedule_next_batch(self, token_budget: int, claimed: int, step: int) -> list[Req] | None:
        """Admit waiting requests in policy order until the first one that does not fit."""
        adder = PrefillAdder(token_budget, claimed, self.table, self.cache, self.admission, self.hit_tokens)
        reqs: list[Req] = []
        if self.chunked is not None:
            adder.continue_chunked(self.chunked)
            reqs.append(self.chunked)
            self.chunked = None
        self.blocked = None
        self.awaiting = set()
        admitted: list[Req] = []
        for req in self.ordered(step):
            if req.held or req.kv.waits_for_load:
                continue
            if (limit := adder.try_add_one(req)) == "loading_kv":
                if not req.kv.waits_for_load:
                    self.awaiting.add(req.rid)
                continue
            if limit is not None:
                self.blocked = (req.rid, limit)
                break
            admitted.append(req)
        for req in admitted:  # fcfs: each is at the front, found at once
            self.waiting.remove(req)
        reqs += admitted
        if not reqs:
            return None
        for req in reqs:
            req.state = ReqState.PREFILLING
        if reqs[-1].extend_len < reqs[-1].remaining_prompt:
            self.chunked = reqs[-1]
        return reqs
