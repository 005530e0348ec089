"""A read-only picture of the scheduler (`Scheduler.snapshot()`), for LLM.stats(), the server and its
stats publisher.

Everything outside the scheduler reads queues, slots and pages through this, never through the
managers' internals, so the scheduler can change how it keeps them; why a request waits is the
scheduler's own verdict from its last admission, not recomputed outside. Taking one copies only small
host lists (O(requests)) and the pages as runs: every page (O(runs)), or only those in a set from
`Scheduler.watch_pages` (what changed since its holder emptied it); the server takes one only when
someone is listening.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.pages import PageRun
from engine.params import SamplingParams


@dataclass(frozen=True)
class WaitingEntry:
    """A waiting request, in admission order. `reason` is why the last admission left it waiting:
    "slot" (none free), "token_budget" (the step's budget was spent), "kv_pages" (its pages do not fit)
    or "queue" (admission stopped at a request ahead of it) or "sibling" (one of n choices, waiting for
    the first to put the prompt in the prefix cache). A retracted request has `retractions` > 0
    and its `generated` tokens kept. `client` says who sent it (a label, not an identity)."""

    rid: str
    client: str
    prompt_tokens: int
    arrival_time: float  # time.monotonic() at submission
    reason: str
    priority: int
    retractions: int
    generated: int


@dataclass(frozen=True)
class RunningEntry:
    """An admitted, unfinished request: `state` is "prefilling" (prompt mid-chunk) or "running"."""

    rid: str
    client: str
    slot: int
    state: str
    prompt_tokens: int
    prefilled: int
    generated: int
    max_tokens: int
    pages: int
    claimed_pages: int  # further pages admission counts it for (see engine/scheduler/admission.py)
    priority: int
    retractions: int


@dataclass(frozen=True)
class RequestDetail:
    """Everything about one live request (`Scheduler.describe`), for an operator looking at it. Built on
    demand for one request, never for the periodic snapshot, and still small: of the prompt only its
    first and last PROMPT_ENDS token ids, of the output only the text from `text_from` on."""

    rid: str
    client: str
    state: str  # "waiting", "prefilling" or "running"
    reason: str  # why it waits (WaitingEntry.reason); "" once admitted
    params: SamplingParams
    prompt_tokens: int
    prompt_head: tuple[int, ...]
    prompt_tail: tuple[int, ...]  # empty when the head is the whole prompt
    cached_tokens: int  # prompt tokens found in the prefix cache at admission
    slot: int | None
    pages: int
    claimed_pages: int
    generated: int
    max_tokens: int
    retractions: int
    choices: int  # params.n; the detail is of the first choice still open
    arrival_time: float  # time.monotonic() at submission
    admit_time: float | None
    first_token_time: float | None
    output: str  # the text sent to its client so far, from `text_from` on
    output_chars: int  # the length of all of that text


PROMPT_ENDS = 48  # prompt tokens a RequestDetail keeps from each end


@dataclass(frozen=True)
class PageSnapshot:
    """Every KV page is exactly one of free, used (held by a request) or cached (`locked` while a running
    request reads it). `claimed` is what admission counts the admitted requests for beyond what they hold
    (it admits no one into those pages). `runs` (engine/pages.py) list every page in order when
    `complete`, else only the pages asked about; a held run's `owner` indexes `owners`."""

    page_size: int
    total: int
    free: int
    used: int
    cached: int
    locked: int
    claimed: int
    runs: tuple[PageRun, ...]
    owners: tuple[str, ...]
    complete: bool


@dataclass(frozen=True)
class SchedulerCounters:
    steps: int
    prefill_tokens: int
    decode_tokens: int
    finished: int
    aborted: int
    retractions: int


@dataclass(frozen=True)
class SchedulerSnapshot:
    waiting: tuple[WaitingEntry, ...]  # arrival order
    running: tuple[RunningEntry, ...]  # arrival order
    slots: tuple[str | None, ...]  # request id holding each request slot
    pages: PageSnapshot
    counters: SchedulerCounters
    inflight_batches: int  # scheduled but not yet processed (overlap keeps up to two)
    admission: str  # the admission rule and its current estimate (Admission.describe)
    policy: str  # the waiting queue's order: fcfs, priority or lpm

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and not self.inflight_batches
