"""How many drafts each request gets this step: only as many as make the step's tokens per second rise.

A draft token costs a longer step (more query tokens; on a CPU past a few rows the GEMMs stop being
bound by reading the weights) and pays only if it is accepted, which needs every draft before it
accepted too. So the j-th draft of a request whose drafts are each accepted with probability `alpha`
(given the ones before) is worth alpha**j expected tokens, and the step's expected rate is

    (tokens the step emits anyway + the drafts' expected tokens) / (measured time of a step that long
                                                                    + the proposer's own passes)

Drafts are added most valuable first while the rate rises (`allocate`), so a request whose drafts are
rejected gets none (its alpha falls below what one more query token costs), a full batch gets few or
none (its steps grow with every token), and a single stream on a memory-bound device gets several.
`alpha` learns per request from what verification accepted (`SpecState.observe`) and drifts back to
the prior while a request is not speculating, so it tries again later (the text may have turned to
quoting). Step times are measured per token count (`StepCosts`), on this machine, under its load.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

PRIOR = 0.6  # a fresh request's alpha: tried at once where a step of 2 tokens costs under 1.6 of 1 token
LEARN = 0.2  # how far one verified draft moves alpha to 1 (accepted) or 0 (the first rejected)
RECOVER = 0.01  # per step without drafts, alpha moves this share of the way back to PRIOR
TRY = 0.5  # under overlap a request sits out a step to carry drafts in the next only while alpha is at least this
PROBE = 16  # ... and only if its last clean step had drafts, or it has had no clean step for this many steps
COST_LEARN = 0.2  # the step-time average's weight of a new measurement
UNMEASURED_EXTRA = 0.05  # a step longer than any measured: this share of the longest one's time per token more
CATCH_UP = 2  # a draft model feeding a request more tokens than this before its first draft is starting over


@dataclass
class SpecState:
    """One request's speculation: its acceptance estimate and what it proposed and had accepted."""

    alpha: float = PRIOR
    proposed: int = 0  # draft tokens verified
    accepted: int = 0
    verifies: int = 0  # steps that verified drafts of it
    drafting: bool = False  # its last step with nothing in flight carried drafts
    unclean: int = 0  # its steps since the last with nothing in flight (under overlap one is always in flight)

    def observe(self, proposed: int, accepted: int) -> None:
        """A verification: `accepted` of `proposed` drafts; the first rejected one counts against alpha,
        the ones after it say nothing (they were conditioned on a wrong token)."""
        self.proposed += proposed
        self.accepted += accepted
        self.verifies += 1
        for hit in [1.0] * accepted + ([0.0] if accepted < proposed else []):
            self.alpha += LEARN * (hit - self.alpha)

    def rest(self) -> None:
        """A step it decoded without drafts."""
        self.alpha += RECOVER * (PRIOR - self.alpha)

    def sits_out(self, offered: int) -> bool:
        """Under overlap, with a step in flight and `offered` drafts in view: whether it skips this step so that
        the next, with nothing in flight, can carry them (see TRY and PROBE)."""
        self.unclean += 1
        return offered > 0 and self.alpha >= TRY and (self.drafting or self.unclean >= PROBE)



class StepCosts:
    """Seconds a step without prompt tokens takes, by its token count: an average per count measured, between
    measured counts a straight line, beyond the longest measured that plus UNMEASURED_EXTRA per token (so a
    longer step is tried, and then known). Before any measurement a step is `first` (1: only ratios matter to
    the steps' own table; 0 for a draft model's passes, so that they are tried and measured). The first step of
    each count is not learnt from: it builds that shape's kernels (a oneDNN primitive per row count), and a
    count priced out by it would never be tried, so never measured, again. A draft model's passes are measured
    only when it drafts: `fade` lowers every estimate a little at each step without one, so a pass timed on a
    busy moment is tried again later."""

    def __init__(self, first: float = 1.0) -> None:
        self._seconds: dict[int, float] = {}
        self._seen: set[int] = set()  # counts whose first step has run
        self._first = first

    def record(self, tokens: int, seconds: float) -> None:
        if tokens not in self._seen:
            self._seen.add(tokens)
            return
        old = self._seconds.get(tokens)
        self._seconds[tokens] = seconds if old is None else old + COST_LEARN * (seconds - old)

    def estimate(self, tokens: int) -> float:
        known = self._seconds
        if tokens in known:
            return known[tokens]
        below = max((n for n in known if n < tokens), default=None)
        above = min((n for n in known if n > tokens), default=None)
        if below is not None and above is not None:
            share = (tokens - below) / (above - below)
            return known[below] + share * (known[above] - known[below])
        if below is not None:
            return known[below] * (1 + UNMEASURED_EXTRA * (tokens - below))
        return known[above] if above is not None else self._first * (1 + UNMEASURED_EXTRA * (tokens - 1))

    def fade(self, share: float) -> None:
        """Every estimate `share` lower (a step that measured none)."""
        for tokens in self._seconds:
            self._seconds[tokens] *= 1 - share


@dataclass(frozen=True)
class Offer:
    """A request that could verify up to `most` drafts this step, how likely each is accepted, and how many tokens
    a draft model's first pass feeds for it (what it has not seen of the request: 1 or 2 while the request drafts
    every step, its whole prompt the first time; 0 for prompt lookup)."""

    key: int  # the caller's handle for the request
    most: int
    alpha: float
    feeds: int = 1


def allocate(offers: list[Offer], costs: StepCosts, base_tokens: int, emitted: int,
             passes: StepCosts | None = None) -> dict[int, int]:
    """Drafts per offer (by key; absent: none) for a step of `base_tokens` query tokens that emits `emitted`
    tokens without drafts. `passes`: a draft model's pass times by the requests a pass carries (its j-th pass
    carries every request given j drafts or more); None for prompt lookup, which costs nothing.

    A draft model must first catch up on what it has not seen of a request (`Offer.feeds`: its whole prompt the
    first time), which is worth it only if the request then drafts for a while, and whether it does is known
    only once steps that long are measured: so at most one request a step starts over (feeds more than
    CATCH_UP tokens). A single stream is that one; a full batch tries drafting on one request, measures what
    its longer step costs, and goes on only where that pays (32 prompts caught up at once for a few drafts
    cost a batch of 32 a fifth of its throughput)."""
    counts: dict[int, int] = {}
    if not offers or emitted == 0:
        return counts
    tokens, expected, spent = base_tokens, float(emitted), 0.0
    carried: list[int] = []  # requests each draft pass carries so far
    started = False  # a request has been given drafts that make the draft model catch up
    rate = expected / costs.estimate(tokens)
    heap = [(-o.alpha, 1, i) for i, o in enumerate(offers) if o.most > 0 and o.alpha > 0]
    heapq.heapify(heap)
    while heap:
        value, j, i = heapq.heappop(heap)
        offer = offers[i]
        starts = j == 1 and offer.feeds > CATCH_UP
        if starts and started:
            continue
        rows = carried[j - 1] if j <= len(carried) else 0
        extra = 0.0 if passes is None else passes.estimate(rows + 1) - (passes.estimate(rows) if rows else 0.0)
        new_rate = (expected - value) / (costs.estimate(tokens + 1) + spent + extra)
        if new_rate <= rate:
            break
        tokens, expected, spent, rate = tokens + 1, expected - value, spent + extra, new_rate
        if j > len(carried):
            carried.append(0)
        carried[j - 1] += 1
        started = started or starts
        counts[offer.key] = j
        if j < offer.most:
            heapq.heappush(heap, (value * offer.alpha, j + 1, i))
    return counts
