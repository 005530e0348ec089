"""SamplingParams: how to pick tokens and when to stop, in process and on the wire alike.

A msgspec Struct without torch, so the engine, the wire protocol and the clients share one definition
and one validation: `__post_init__` runs on construction, on `msgspec.structs.replace` and on decoding,
so an engine refuses what a Python caller would be refused, with the same sentence.
"""

from __future__ import annotations

import math

import msgspec

# Stop strings are checked on every new piece of text; these caps keep one request's list from
# costing every other request time and memory (vLLM has none; OpenAI allows 4 strings).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts
PRIORITY_RANGE = (-(2**31), 2**31)  # vLLM's and the wire's int32


class InvalidParams(ValueError):
    """Sampling parameters that cannot work; the message says what to change.

    On the wire msgspec wraps it in a ValidationError whose `__cause__` it is (see `invalid_params`)."""


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How to pick tokens and when to stop. `temperature == 0` means greedy. `priority`: lower runs
    first under `--schedule-policy priority` (and is retracted last), as in vLLM."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    ignore_eos: bool = False
    stop: list[str] | None = None
    seed: int | None = None
    priority: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise InvalidParams saying what to change; also called on submit (the fields are mutable)."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidParams(f"max_tokens must be an integer >= 1; got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidParams(f"temperature must be a finite number >= 0 (0 = greedy); got {self.temperature!r}")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise InvalidParams(f"top_k must be -1 (disabled) or an integer >= 1; got {self.top_k!r}")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise InvalidParams(f"top_p must be in (0, 1]; got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            raise InvalidParams(f"seed must be an integer in [-2**63, 2**64); got {self.seed!r}")
        if not _is_int(self.priority) or not PRIORITY_RANGE[0] <= self.priority < PRIORITY_RANGE[1]:
            raise InvalidParams(f"priority must be an integer in [-2**31, 2**31); got {self.priority!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
                raise InvalidParams(f"stop must be a list of non-empty strings; got {self.stop!r}"[:300])
            if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
                raise InvalidParams(f"stop allows at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
                                    f"characters each; got {len(self.stop)} (longest {max(map(len, self.stop))})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def invalid_params(error: msgspec.DecodeError) -> InvalidParams | None:
    """The InvalidParams behind a message that failed to decode, if that is why it failed (a wrong type
    or an unknown field is a malformed message instead)."""
    cause = error.__cause__
    return cause if isinstance(cause, InvalidParams) else None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
