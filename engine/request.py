"""Requests and their sampling parameters: the unit the scheduler moves between queues."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

import torch

from engine.kv.cache import PrefixMatch
from engine.tokenizer import IncrementalDetokenizer

# Stop strings are checked on every new piece of text; these caps keep one request's list from
# costing every other request time and memory (vLLM has none; OpenAI allows 4 strings).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts



class PromptTooLong(ValueError):
    """The prompt alone does not fit the context (or the KV pool): the caller must shorten it."""

@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. `temperature == 0` means greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    ignore_eos: bool = False
    stop: list[str] | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError saying what to change; called on construction and again on submit."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1; got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy); got {self.temperature!r}")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (disabled) or an integer >= 1; got {self.top_k!r}")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64); got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
                raise ValueError(f"stop must be a list of non-empty strings; got {self.stop!r}"[:300])
            if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
                raise ValueError(f"stop allows at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
                                 f"characters each; got {len(self.stop)} (longest {max(map(len, self.stop))})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class ReqState(enum.Enum):
    """Where a request is in its life: waiting queue, mid-chunk, running set, or done."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    """One request's scheduler-visible state.

    `cached_len` counts tokens whose K/V are in the paged cache once every scheduled step has run
    (prefix hits plus everything scheduled so far); the next forward feeds tokens from there.
    `sampled` counts output tokens scheduled to be sampled, which may run ahead of `output_ids`
    (the ones the host has seen) while steps are in flight; `inflight` counts scheduled batches
    not yet processed, and a finished request keeps its slot and pages until it drops to 0.
    `pages` lists the KV pages the request reads, in position order; `slot` is its request-table row.
    """

    rid: str
    uid: int
    input_ids: list[int]
    params: SamplingParams
    max_output: int
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    cached_len: int = 0
    prefix_len: int = 0
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    prefix: PrefixMatch = field(default_factory=PrefixMatch)
    detokenizer: IncrementalDetokenizer | None = None
    state: ReqState = ReqState.WAITING
    finish_reason: str | None = None
    extend_len: int = 0
    sampled: int = 0
    inflight: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    admit_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def input_len(self) -> int:
        return len(self.input_ids)

    @property
    def total_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def remaining_prompt(self) -> int:
        """Prompt tokens still to prefill."""
        return self.input_len - self.cached_len

    @property
    def kv_budget(self) -> int:
        """Tokens whose K/V this request may ever store: the prompt plus every output token but the last."""
        return self.input_len + self.max_output - 1

    @property
    def can_decode(self) -> bool:
        """True while the length budget allows scheduling another token (EOS is checked at processing)."""
        return self.sampled < self.max_output

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output."""
        n = self.input_len
        if end <= n:
            return self.input_ids[start:end]
        if start >= n:  # decode: only output tokens, without copying the prompt every step
            return self.output_ids[start - n : end - n]
        return self.input_ids[start:] + self.output_ids[: end - n]
