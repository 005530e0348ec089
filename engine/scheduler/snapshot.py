"""A read-only picture of the scheduler (`Scheduler.snapshot()`), for LLM.stats(), the server and its
stats publisher, and the one definition of the rows it is made of.

Everything outside the scheduler reads queues, slots and pages through this, never through the
managers' internals, so the scheduler can change how it keeps them; why a request waits is the
scheduler's own verdict from its last admission (`WaitReason`), not recomputed outside. Taking one
copies only small host lists (O(requests)) and the pages as runs: every page (O(runs)), or only those
in a set from `Scheduler.watch_pages` (what changed since its holder emptied it); the server takes one
only when someone is listening.

The rows (`WaitingEntry`, `RunningEntry`, `RequestDetail`) are msgspec Structs because the wire carries
them as they are (engine/service/protocol.py's stats and `Description`), as it carries the engine's
Delta and Final: one definition for the scheduler, the server and the clients. This module imports no
torch, since the clients use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Literal, TypeVar, get_args

import msgspec

from engine.pages import PageRun, TierUse
from engine.params import SamplingParams

WaitReason = Literal["slot", "token_budget", "kv_pages", "queue", "sibling", "loading_kv"]
"""Why a waiting request waits: the limit that stopped the scheduler's last admission at it
(engine/scheduler/prefill.py), "slot" (no request slot free), "token_budget" (the step's token budget was
spent: admitted at the next prefill step) or "kv_pages" (its prompt and the output admission counts it
for do not fit the free and evictable pages); "queue" (admission stopped at a request ahead of it, or has
not looked since it arrived); "sibling" (one of a request's n choices, waiting for the first to put the
prompt in the prefix cache); or "loading_kv" (its prefix was found below the pool, in host memory or on disk,
and its pages are being loaded back: engine/kv/tiers.py; admission goes on past it meanwhile). docs/protocol.md
lists these; a request the server is still preparing waits ahead of them with its stage as the reason
("tokenizing", "compiling grammar": engine/service/registry.py)."""
WAIT_REASONS: tuple[WaitReason, ...] = get_args(WaitReason)

PROMPT_ENDS = 48  # prompt tokens a RequestDetail keeps from each end

Prompt = TypeVar("Prompt")


class WaitingEntry(msgspec.Struct, kw_only=True):
    """A waiting request, in admission order: `waited` seconds since it arrived, `reason` why it still
    waits (a `WaitReason`; on the wire, a request the server still prepares has its stage). A retracted
    request has `retractions` > 0 and its `generated` tokens kept. `client` says who sent it (a label,
    not an identity)."""

    rid: str
    prompt_tokens: int
    waited: float
    reason: str = ""
    client: str = ""
    priority: int = 0
    retractions: int = 0
    generated: int = 0


class Speculation(msgspec.Struct, kw_only=True):
    """A request's speculative decoding so far: `draft_tokens` proposed and verified in `verifications`
    steps, `accepted_tokens` of them accepted."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    verifications: int = 0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification emitted on average (vLLM's mean acceptance length): its accepted drafts and
        the target's own token; 0 before any."""
        return 1.0 + self.accepted_tokens / self.verifications if self.verifications else 0.0


class RunningEntry(msgspec.Struct, kw_only=True):
    """An admitted, unfinished request in its request slot: `state` is "prefilling" (prompt mid-chunk) or
    "running" (decoding); `spec` its speculation, if any."""

    rid: str
    slot: int
    state: str
    prompt_tokens: int
    prefilled: int
    generated: int
    max_tokens: int
    pages: int
    claimed_pages: int = 0  # further pages admission counts it for (see engine/scheduler/admission.py)
    priority: int = 0
    retractions: int = 0
    client: str = ""  # as WaitingEntry.client
    spec: Speculation | None = None


class RequestDetail(msgspec.Struct, Generic[Prompt], kw_only=True):
    """Everything about one live request, for an operator looking at it (`Scheduler.describe`). Built on
    demand for one request, never for the periodic snapshot, and still small: of the prompt only its
    first and last PROMPT_ENDS tokens (`prompt_tail` empty when the head is the whole prompt), of the
    output only the text from the asker's `text_from` on. The scheduler gives the prompt's ends as token
    ids (`RequestDetail[tuple[int, ...]]`); the wire's `Description` is this with their text, which takes
    the tokenizer. Times are seconds: `age` since arrival, `queue` from arrival to admission and `ttft` to
    the first output token (None until then)."""

    rid: str
    state: str  # "waiting", "prefilling" or "running" (the wire adds the server's: see protocol.Description)
    prompt_head: Prompt
    prompt_tail: Prompt
    client: str = ""
    reason: str = ""  # why it waits (WaitingEntry.reason); "" once admitted
    params: SamplingParams | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    host_tokens: int = 0  # of those, the ones loaded from host memory ...
    disk_tokens: int = 0  # ... and from disk (the rest were in the pool)
    slot: int | None = None
    pages: int = 0
    claimed_pages: int = 0
    generated: int = 0
    max_tokens: int = 0
    retractions: int = 0
    choices: int = 1  # params.n; the detail is of the first choice still open
    age: float = 0.0
    queue: float | None = None
    ttft: float | None = None
    output: str = ""  # the text sent to its client so far, from `text_from` on
    output_chars: int = 0  # the length of all of that text
    spec: Speculation | None = None  # its speculative decoding, if the engine speculates


@dataclass(frozen=True)
class PageSnapshot:
    """Every KV page is exactly one of free, held by a request, or cached (`locked` while a running
    request reads it). `claimed` is what admission counts the admitted requests for beyond what they hold
    (it admits no one into those pages). `runs` (engine/pages.py) list every page in order when
    `complete`, else only the pages asked about; a held run's `owner` indexes `owners`. `tiers` are the tiers
    below the pool (host memory, disk; engine/kv/tiers.py) the engine has."""

    page_size: int
    total: int
    free: int
    held: int
    cached: int
    locked: int
    claimed: int
    runs: tuple[PageRun, ...]
    owners: tuple[str, ...]
    complete: bool
    tiers: tuple[TierUse, ...] = ()
    dtype: str = ""  # what the pages hold: "int8" or a float dtype's name
    page_bytes: int = 0  # one page's bytes, every layer's K and V


@dataclass(frozen=True)
class SchedulerCounters:
    """Totals since the engine started. `decode_tokens` are what decoding generated (accepted drafts
    included); a verification of drafts is a `spec_drafts`, with its `spec_draft_tokens` proposed and
    `spec_accepted_tokens` accepted (vLLM's spec_decode counters). `hit_tokens_*` are the prompt tokens first
    admissions found cached, in the pool, in host memory and on disk (the tokens usage reports as cached)."""

    steps: int
    prefill_tokens: int
    decode_tokens: int
    finished: int
    aborted: int
    retractions: int
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    hit_tokens_pool: int = 0
    hit_tokens_host: int = 0
    hit_tokens_disk: int = 0


@dataclass(frozen=True)
class SchedulerSnapshot:
    waiting: tuple[WaitingEntry, ...]  # admission order
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
