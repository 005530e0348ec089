"""Who runs this step: a prompt batch whenever one can be formed, else decode the running set.

This is the whole decision, read in a minute. With mixed batches (the default) the running requests ride
along in a prefill step, one decode token each ahead of the prompt tokens, so a request arriving never
stalls the ones already generating (and the weights are read once for both). Without, a step is prefill
only or decode, and `max_consecutive_prefills` bounds the prefill-only steps in a row while requests run.
With speculation, decoding requests may carry drafts to verify: in a mixed step they are proposed before
admission, which then counts their tokens and pages; without mixed batches, only in a decode step.

Who is admitted, and in which order, is the prefill manager's (engine/scheduler/prefill.py: the queue
policy, the token budget, the expected KV use of engine/scheduler/admission.py); making room for the
running set first is retraction.py's. Nothing here touches pages, tensors, models or tiers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.scheduler.budget import next_pages

if TYPE_CHECKING:
    from engine.request import Req
    from engine.scheduler.admission import Admission
    from engine.scheduler.decode import DecodeManager
    from engine.scheduler.prefill import PrefillManager

Propose = Callable[[list["Req"]], tuple[list["Req"], dict["Req", list[int]]]]
"""Drafts for the decoding requests: (those decoding this step, the drafts some of them verify)."""


@dataclass(frozen=True)
class Plan:
    """One step as decided: running requests decoding one token each, running requests verifying drafts
    (`verify`: each with its drafts), then prompt chunks (admitted requests, the chunked one first). Any of
    them may be empty, not all."""

    decode: list[Req]
    prefill: list[Req]
    verify: dict[Req, list[int]] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """The step's kind: "decode" (verifying included), "prefill" or "mixed" (both, the decode tokens first)."""
        decoding = self.decode or self.verify
        return "decode" if not self.prefill else "prefill" if not decoding else "mixed"

    @property
    def reqs(self) -> list[Req]:
        return self.decode + list(self.verify) + self.prefill


class StepPolicy:
    """`prefill_budget`: tokens a step may feed; `page_size`: the KV cache's."""

    def __init__(self, prefill: PrefillManager, decode: DecodeManager, admission: Admission, page_size: int,
                 prefill_budget: int, mixed_batches: bool, max_consecutive_prefills: int) -> None:
        self.prefill, self.decode, self.admission = prefill, decode, admission
        self.page_size = page_size
        self.prefill_budget = prefill_budget
        self.mixed_batches = mixed_batches
        self.max_consecutive_prefills = max_consecutive_prefills
        self._prefill_streak = 0  # prefill-only steps in a row while running requests waited

    def plan(self, step: int, propose: Propose) -> Plan | None:
        """This step's plan (`step`: steps processed so far, for the starvation bound), None with nobody to run."""
        running = list(self.decode.running.values())
        decoding = self.decode.schedule_next_batch() or []  # arrival order, one token each
        drafts: dict[Req, list[int]] = {}
        if self.mixed_batches:
            decoding, drafts = propose(decoding)
            prefill = self._admit(step, running, decoding, drafts)
        else:
            prefill = None if self._decode_due(running) else self._admit(step, running, decoding, drafts)
            if prefill is None:
                decoding, drafts = propose(decoding)
        decode = decoding if prefill is None or self.mixed_batches else []
        if not prefill and not decode:
            return None
        self._prefill_streak = self._prefill_streak + 1 if not decode and running else 0
        return Plan(decode=[r for r in decode if r not in drafts], prefill=prefill or [],
                    verify={r: drafts[r] for r in decode if r in drafts})

    def _decode_due(self, running: list[Req]) -> bool:
        """Without mixed batches, running requests that sat out `max_consecutive_prefills` prefill steps in a
        row decode now, however many requests wait."""
        return bool(running) and self._prefill_streak >= self.max_consecutive_prefills

    def _admit(self, step: int, running: list[Req], decoding: list[Req],
               drafts: dict[Req, list[int]]) -> list[Req] | None:
        """The waiting requests that fit beside the running set (PrefillAdder's three limits); None if none.
        The running set's claims (with this step's drafts) count against the KV estimate, and in a mixed step
        the decoding requests' tokens against the token budget (the prompts get what is left)."""
        if not self.prefill.runnable:
            return None
        budget = self.prefill_budget - (sum(r.extend_len for r in decoding) if self.mixed_batches else 0)
        claimed = sum(max(self.admission.claim(r), next_pages(r, self.page_size, 1 + len(drafts.get(r, ()))))
                      for r in running)
        return self.prefill.schedule_next_batch(budget, claimed, step)
