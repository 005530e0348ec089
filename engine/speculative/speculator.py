"""The scheduler's speculation: each step's drafts for the running requests, and what verification kept.

Verification is the target model's ordinary step with a request's drafts as extra query tokens: row i
of its 1 + k logits rows is sampled exactly as a plain decode step would sample that position (same
processors, same seeded draw, penalties over the tokens before it), and the drafts are accepted up to
the first row whose sample differs from the draft (`accepted`); that row's sample is the step's last
token for the request. With a one-hot proposal (both proposers here propose greedily), this is the
standard rejection scheme (accept draft d with probability p(d), else sample the residual p without
d): the sample equals d with probability p(d), and otherwise is a draw from exactly that residual. So
the output's distribution is the model's, and since the draws are the seeded ones of non-speculative
decoding, a seeded or greedy request emits the tokens it would have without speculation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from engine.speculative.policy import Offer, SpecState, StepCosts, allocate

if TYPE_CHECKING:
    from engine.request import Req


class Proposer(Protocol):
    """Where drafts come from (engine/speculative/ngram.py, draft.py). `pass_costs`: its own time per draft
    position, by the requests it carries (None for prompt lookup, which runs no model)."""

    @property
    def pass_costs(self) -> StepCosts | None: ...

    def lookahead(self, req: Req, most: int) -> int:
        """How many drafts (at most `most`) it could propose for `req` now."""

    def feeds(self, req: Req) -> int:
        """Tokens its first pass would feed for `req` (what it has not seen of it; prompt lookup: none)."""

    def propose(self, counts: dict[Req, int]) -> dict[Req, list[int]]:
        """The drafts, `counts[req]` or fewer for each request."""

    def keep(self, req: Req, count: int) -> None:
        """Only the first `count` of `req`'s drafts are verified (the rest were cut)."""

    def verified(self, req: Req) -> None:
        """`req`'s drafts were verified: its `cached_len` says how far they were right."""

    def release(self, req: Req) -> None:
        """`req` gives up its request slot."""


def accepted(drafts: list[int], sampled: list[int]) -> int:
    """How many drafts verification accepts: the leading ones each equal to the sample of the row before
    them (row i predicts the token after draft i - 1; row 0 the token after the last accepted one)."""
    count = 0
    for draft, token in zip(drafts, sampled, strict=False):
        if draft != token:
            break
        count += 1
    return count


class Speculator:
    """Drafts for the running requests each step (`plan`), at most `most` each and only as many as pay
    (engine/speculative/policy.py); `verified` learns from what verification accepted."""

    def __init__(self, proposer: Proposer, most: int, adaptive: bool = True) -> None:
        self.proposer = proposer
        self.most = most
        self.adaptive = adaptive  # off: every request drafts as many as the proposer offers (a fixed k, measured)
        self.costs = StepCosts()

    def plan(self, decoding: list[Req], base_tokens: int) -> tuple[dict[Req, list[int]], set[Req]]:
        """Drafts for `decoding` (the requests about to decode, one token each without drafts) in a step of
        `base_tokens` query tokens, and the requests to leave out of it: a request whose last step is still in
        flight (overlap) gets no drafts, since they would follow tokens the host has not seen, so where drafts
        are in view it sits this step out (`SpecState.sits_out`) and drafts in the next."""
        offers: list[Offer] = []
        by_key: list[Req] = []  # an offer's key: its request's place here
        resting: set[Req] = set()
        for req in decoding:
            state = self.state(req)
            most = min(self.most, req.max_output - req.sampled - 1)
            offered = self.proposer.lookahead(req, most) if most > 0 else 0
            if req.inflight:
                if state.sits_out(offered):
                    resting.add(req)
            elif offered:
                offers.append(Offer(len(by_key), offered, state.alpha, self.proposer.feeds(req)))
                by_key.append(req)
        counts = allocate(offers, self.costs, base_tokens - len(resting), len(decoding) - len(resting),
                          self.proposer.pass_costs) if self.adaptive else {o.key: o.most for o in offers}
        drafts = self.proposer.propose({by_key[key]: n for key, n in counts.items()})
        for req in decoding:
            state = self.state(req)
            if not req.inflight:
                state.unclean, state.drafting = 0, req in drafts
            if req not in drafts and req not in resting:
                state.rest()
        return drafts, resting

    def cut(self, req: Req, drafts: list[int], count: int) -> list[int]:
        """`req`'s drafts limited to the first `count` (the grammar or the free pages allow no more)."""
        if count < len(drafts):
            self.proposer.keep(req, count)
        return drafts[:count]

    def verified(self, req: Req, proposed: int, kept: int) -> None:
        """`kept` of `req`'s `proposed` drafts were accepted (its `cached_len` is rolled back already)."""
        self.state(req).observe(proposed, kept)
        self.proposer.verified(req)

    def record_step(self, tokens: int, seconds: float) -> None:
        """A step without prompt tokens took `seconds` for `tokens` query tokens (the proposer's own time
        left out)."""
        self.costs.record(tokens, seconds)

    def release(self, req: Req) -> None:
        self.proposer.release(req)

    @staticmethod
    def state(req: Req) -> SpecState:
        if req.spec is None:
            req.spec = SpecState()
        return req.spec
