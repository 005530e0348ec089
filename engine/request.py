"""Requests: the unit the scheduler moves between queues."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.kv.request_kv import RequestKV
from engine.outputs import Final, Timings, TokenLogprob, Usage
from engine.params import SamplingParams
from engine.reasoning import ThinkBlock
from engine.speculative.policy import SpecState
from engine.structured import GrammarMatcher
from engine.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from engine.kv.cache import CacheManager
    from engine.kv.table import RequestTable


class PromptTooLong(ValueError):
    """The prompt alone does not fit the context (or the KV pool): the caller must shorten it."""


class ReqState(enum.Enum):
    """Where a request is in its life: waiting queue, mid-chunk, running set, or done."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Group:
    """The `n` choices of one submitted request. They share its rid on the wire (each output names its
    choice's `index`); the first choice leads: the others wait until its prompt is in the prefix cache
    (`shared`), then match it instead of computing it again. A choice that ends before the others ends
    in a Delta with its `finish_reason`; the last one's Final ends the request, with the usage of all."""

    rid: str
    members: list[Req] = field(default_factory=list)
    shared: bool = False

    @property
    def open(self) -> list[Req]:
        return [r for r in self.members if r.state is not ReqState.FINISHED]

    def share(self, req: Req, cache: CacheManager) -> None:
        """Once the leader `req` has its prompt cached, share it: the other choices, held until then
        (`Req.held`), match it instead of computing it again."""
        if req.index == 0 and not self.shared and req.cached_len >= req.input_len:
            req.kv.share(cache, req.input_ids)
            self.shared = True


@dataclass
class Times:
    """When a request arrived, was first admitted, sampled its first token and finished (`time.monotonic()`), and
    the scheduler step it arrived at (the starvation bound counts from it)."""

    arrival: float = field(default_factory=time.monotonic)
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    arrival_step: int = 0


@dataclass(eq=False)
class Reply:
    """What a request's reply is made of besides its token ids, built as its tokens are processed
    (engine/scheduler/output.py): text, log-probabilities and think block."""

    detokenizer: IncrementalDetokenizer | None = None  # text, stop strings
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the sampled tokens', when asked for
    prompt_logprobs: list[TokenLogprob] | None = None  # the prompt's, chunk by chunk, when asked for
    scored: int = 1  # prompt positions whose log-probabilities are done (the first needs none)
    think: ThinkBlock | None = None  # its think block, with params.reasoning on a model that has one


@dataclass(eq=False)
class Req:
    """One request's scheduler-visible state.

    Two lengths move, and the invariant `Scheduler.check_requests` checks ties them to the rest: `cached_len` counts
    tokens whose K/V are in the paged cache once every scheduled step has run (prefix hits plus everything scheduled
    so far); the next forward feeds tokens from there. `sampled` counts output tokens scheduled to be sampled, which
    may run ahead of `output_ids` (the ones the host has seen) while steps are in flight. `extend_len` is what the
    step being scheduled feeds; `inflight` counts scheduled batches not yet processed, and a finished request keeps
    its KV until it drops to 0.

    A request retracted to the waiting queue (`retractions` counts it) keeps its output and is prefilled
    again up to `fill_len`, prompt and output alike, before it samples its next token; its draws depend
    on `seed` and the position only (engine/sampling.py), so it samples what it would have.
    `spec` is its speculation (engine/speculative): acceptance so far, created when it first decodes with a
    proposer on; a step verifying its drafts counts them in `sampled` and `cached_len` until processed.
    """

    rid: str
    uid: int
    input_ids: list[int]
    params: SamplingParams
    max_output: int
    seed: int = 0
    group: Group | None = None  # n > 1: the choices this one belongs to (in order: `index`)
    client: str = ""  # who sent it, in a few words ("bench", "client 3"): what an operator sees it by
    state: ReqState = ReqState.WAITING
    finish_reason: str | None = None
    output_ids: list[int] = field(default_factory=list)
    cached_len: int = 0
    sampled: int = 0
    extend_len: int = 0
    inflight: int = 0
    retractions: int = 0
    kv: RequestKV = field(default_factory=RequestKV)  # its slot, pages, cached prefix, tier load
    reply: Reply = field(default_factory=Reply)
    times: Times = field(default_factory=Times)
    grammar: GrammarMatcher | None = None  # params.structured's matcher: what may come next
    spec: SpecState | None = None

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first output token; None before it."""
        return None if self.times.first_token is None else self.times.first_token - self.times.arrival

    @property
    def index(self) -> int:
        """Which of its group's choices this is (0 without a group)."""
        return 0 if self.group is None else self.group.members.index(self)

    @property
    def client_rid(self) -> str:
        """The rid the client gave (a group's choices have rids of their own inside the engine)."""
        return self.group.rid if self.group is not None else self.rid

    @property
    def held(self) -> bool:
        """A choice that waits for its group's leader to put the prompt in the prefix cache."""
        return self.group is not None and self.index > 0 and not self.group.shared

    @property
    def scoring_prompt(self) -> bool:
        """Prompt log-probabilities are asked for and some are still to compute (the prefix cache is
        skipped for such a prompt: its cached part has no logits)."""
        return self.params.prompt_logprobs is not None and self.reply.scored < self.input_len

    @property
    def input_len(self) -> int:
        return len(self.input_ids)

    @property
    def total_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def fill_len(self) -> int:
        """Tokens to have in the cache before the next sample: the prompt, and after a retraction the
        output so far (a waiting request has nothing in flight, so `sampled` is its output's length)."""
        return self.input_len + self.sampled

    @property
    def remaining_prompt(self) -> int:
        """Tokens still to prefill (the prompt, or after a retraction prompt and output)."""
        return self.fill_len - self.cached_len

    @property
    def kv_budget(self) -> int:
        """Tokens whose K/V this request may ever store: the prompt plus every output token but the last."""
        return self.input_len + self.max_output - 1

    @property
    def can_decode(self) -> bool:
        """True while the length budget allows scheduling another token (EOS is checked at processing)."""
        return self.sampled < self.max_output

    def check(self, table: RequestTable, page_size: int) -> None:
        """Raise AssertionError unless the invariant holds (with no batch of it in flight): the host has seen every
        token it scheduled, nothing is cached past what it will feed, and its KV is exactly what that holds."""
        assert len(self.output_ids) == self.sampled, f"{self.rid}: {self.sampled} sampled, {len(self.output_ids)} seen"
        assert self.cached_len <= self.fill_len, f"{self.rid}: {self.cached_len} cached of {self.fill_len}"
        self.kv.check(table, page_size, self.cached_len)

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output."""
        n = self.input_len
        if end <= n:
            return self.input_ids[start:end]
        if start >= n:  # decode: only output tokens, without copying the prompt every step
            return self.output_ids[start - n : end - n]
        return self.input_ids[start:] + self.output_ids[: end - n]

    def final(self, token_ids: list[int], text: str, choices: Sequence[Req] = (), reasoning: str = "") -> Final:
        """The request's last output (it has finished): new tokens, answer and thinking text, usage and
        timings. `choices`: a group's, whose tokens its usage counts together."""
        arrival = self.times.arrival
        counted = choices or (self,)
        spec = [r.spec for r in counted if r.spec is not None]
        completion = sum(len(r.output_ids) for r in counted)
        usage = Usage(prompt_tokens=self.input_len, completion_tokens=completion, cached_tokens=self.kv.cached_tokens,
                      draft_tokens=sum(s.proposed for s in spec), accepted_tokens=sum(s.accepted for s in spec),
                      reasoning_tokens=sum(r.reply.think.tokens for r in counted if r.reply.think is not None))
        return Final(rid=self.client_rid, index=self.index, text=text, token_ids=token_ids,
                     finish_reason=self.finish_reason or "", usage=usage, reasoning=reasoning,
                     stop_string=self.reply.detokenizer.matched if self.reply.detokenizer is not None else None,
                     timings=Timings(queue=None if self.times.admitted is None else self.times.admitted - arrival,
                                     ttft=self.ttft,
                                     total=(self.times.finished or time.monotonic()) - arrival))
