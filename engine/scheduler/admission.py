"""How admission counts a request's KV need: a reservation, or an expectation.

`reserve` counts every admitted request for its prompt plus its whole output budget, so a step
always gets its pages and nothing is ever retracted. It is exact, and the worst case for clients that
send no max_tokens (the budget is then the rest of the context): 32 such requests on a
Qwen2.5-0.5B-shaped model with the default CPU pool ran 2 at a time.

`optimistic` counts a request for its prompt plus `ratio` of what is left of its output budget (at
most CLIP tokens of it). The ratio starts at INIT and learns what requests really use: each request
that ends (EOS, a stop string or its length) moves it a step LEARN towards the share of its budget it
used, and every decode step lowers it by DECAY (down to FLOOR), so a stream of long requests that
never end does not keep it high. Over-promising is safe because a step that cannot get its pages
retracts running requests (engine/scheduler/scheduler.py); each retraction raises the ratio by BUMP,
so admission backs off when it was wrong. SGLang's `new_token_ratio` decays and bumps the same way;
learning from finished requests is ours, and the ratio is visible in the stats (`Admission.describe`).
"""

from __future__ import annotations

import math

from engine.pages import pages_for
from engine.request import Req

CLIP = 4096  # at most this many output tokens are expected of one request (SGLang's clip)
INIT = 0.7
FLOOR = 0.03
DECAY = 0.0015  # per decode step: from INIT to FLOOR in about 450 steps
LEARN = 0.2  # how far one finished request moves the ratio towards the share of its budget it used
BUMP = 0.2  # added after each retraction (at most 1)


class Admission:
    """The KV pages a request is counted for beyond those it holds (`claim`), under `mode`."""

    def __init__(self, mode: str, page_size: int) -> None:
        if mode not in ("reserve", "optimistic"):
            raise ValueError(f"admission must be reserve or optimistic; got {mode!r}")
        self.mode = mode
        self.page_size = page_size
        self.ratio = 1.0 if mode == "reserve" else INIT

    @property
    def optimistic(self) -> bool:
        return self.mode == "optimistic"

    def claim(self, req: Req, held: int | None = None) -> int:
        """Pages `req` may still claim as admission counts it, beyond the `held` it has (None: its own pages): its
        whole budget under reserve, its prompt (or what is left of it) and the expected output under optimistic."""
        held = len(req.kv.pages) if held is None else held
        if not self.optimistic:
            return pages_for(req.kv_budget, self.page_size) - held
        expected = math.ceil(min(req.max_output - req.sampled, CLIP) * self.ratio)
        return max(0, pages_for(min(req.kv_budget, req.fill_len + expected), self.page_size) - held)

    def decoded(self) -> None:
        if self.optimistic:
            self.ratio = max(FLOOR, self.ratio - DECAY)

    def finished(self, req: Req) -> None:
        """A request ended by EOS, stop string or length (not abort): learn from what it used."""
        if self.optimistic:
            used = len(req.output_ids) / max(1, min(req.max_output, CLIP))
            self.ratio = min(1.0, max(FLOOR, self.ratio + LEARN * (min(used, 1.0) - self.ratio)))

    def retracted(self) -> None:
        if self.optimistic:
            self.ratio = min(1.0, self.ratio + BUMP)

    def describe(self) -> str:
        return "reserve" if not self.optimistic else f"optimistic (expects {self.ratio:.0%} of remaining output)"
