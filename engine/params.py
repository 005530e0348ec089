"""SamplingParams: how to pick tokens and when to stop, in process and on the wire alike.

A msgspec Struct without torch, so the engine, the wire protocol and the clients share one definition
and one validation: `__post_init__` runs on construction, on `msgspec.structs.replace` and on decoding,
so an engine refuses what a Python caller would be refused, with the same sentence.
"""

from __future__ import annotations

import math

import msgspec

from engine.structured import GrammarSpec, InvalidGrammar

# Stop strings are checked on every new piece of text; these caps keep one request's list from
# costing every other request time and memory (vLLM has none; OpenAI allows 4 strings).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts
PRIORITY_RANGE = (-(2**31), 2**31)  # vLLM's and the wire's int32
MAX_N = 64  # choices per request: each is a request of its own in the running set
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's cap on top_logprobs; vLLM's default)
MAX_LOGIT_BIAS = 300  # entries (OpenAI's cap)
MAX_STOP_TOKEN_IDS = 64


class InvalidParams(ValueError):
    """Sampling parameters that cannot work; the message says what to change.

    On the wire msgspec wraps it in a ValidationError whose `__cause__` it is (see `invalid_params`)."""


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How to pick tokens and when to stop; the fields and their meaning are vLLM's.

    `temperature == 0` means greedy. `max_tokens == 0` samples nothing: with `prompt_logprobs` it scores
    the prompt (lm-eval's loglikelihood). `n` choices share the prompt's KV pages (computed once, through
    the prefix cache); choice `i` draws with `seed + i`. The logits processors run in vLLM's order:
    `structured` (xgrammar's token mask for JSON, a JSON schema, a regex, a choice or a grammar;
    engine/structured.py), `min_tokens` (EOS and `stop_token_ids` masked until that many tokens),
    `logit_bias`, the penalties
    (repetition over prompt and output, presence and frequency over the output, as OpenAI defines them),
    temperature, `min_p`, `top_k`, `top_p`. `logprobs` (top alternatives per sampled token) and
    `prompt_logprobs` (per prompt token) are the model's raw log-probabilities, before any of those
    processors: vLLM's default ("raw_logprobs"), what scoring needs. `priority`: lower runs first under
    `--schedule-policy priority` (and is retracted last). `reasoning`: a reply's think block (for models
    whose chat template has one, engine/reasoning.py) is split off the text (Delta.reasoning), counted
    (Usage.reasoning_tokens), `structured` applies to the answer after it, and after
    `thinking_token_budget` tokens inside it (vLLM's name; None: the engine's `reasoning_budget`, if any)
    the engine closes the block itself."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: GrammarSpec | None = None
    priority: int = 0
    reasoning: bool = False
    thinking_token_budget: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise InvalidParams saying what to change; also called on submit (the fields are mutable)."""
        self._check_sampling()
        self._check_limits()
        self._check_stop()

    def _check_sampling(self) -> None:
        """The output budget and how each token is picked."""
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise InvalidParams(f"max_tokens must be an integer >= 0; got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidParams(f"temperature must be a finite number >= 0 (0 = greedy); got {self.temperature!r}")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1) or self.top_k >= 2**63:
            raise InvalidParams(f"top_k must be -1 (disabled) or an integer in [1, 2**63); got {self.top_k!r}")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise InvalidParams(f"top_p must be in (0, 1]; got {self.top_p!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidParams(f"min_p must be in [0, 1]; got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise InvalidParams(f"{name} must be in [-2, 2]; got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 100.0:
            raise InvalidParams(f"repetition_penalty must be in (0, 100] (1 = off); got {self.repetition_penalty!r}")
        if self.logit_bias is not None and (
                not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS
                or any(not _is_int(t) or t < 0 or not _is_number(b) or not -100.0 <= b <= 100.0
                       for t, b in self.logit_bias.items())):
            raise InvalidParams(f"logit_bias maps at most {MAX_LOGIT_BIAS} token ids (>= 0) to biases in "
                                f"[-100, 100]; got {_logit_bias_shown(self.logit_bias)}")

    def _check_limits(self) -> None:
        """When EOS may end a request, how many choices and log-probabilities it asks for, its seed and priority."""
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidParams(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}]; "
                                f"got {self.min_tokens!r}")
        if self.stop_token_ids is not None and (
                not isinstance(self.stop_token_ids, list) or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS
                or any(not _is_int(t) or t < 0 for t in self.stop_token_ids)):
            raise InvalidParams(f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids (>= 0); "
                                f"got {self.stop_token_ids!r}"[:300])
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise InvalidParams(f"n must be an integer in [1, {MAX_N}]; got {self.n!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise InvalidParams(f"{name} must be an integer in [0, {MAX_LOGPROBS}] (top alternatives per "
                                    f"token) or null; got {value!r}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            raise InvalidParams(f"seed must be an integer in [-2**63, 2**64); got {self.seed!r}")
        if not _is_int(self.priority) or not PRIORITY_RANGE[0] <= self.priority < PRIORITY_RANGE[1]:
            raise InvalidParams(f"priority must be an integer in [-2**31, 2**31); got {self.priority!r}")
        budget = self.thinking_token_budget
        if budget is not None and (not _is_int(budget) or not 0 <= budget < 2**63):
            raise InvalidParams(f"thinking_token_budget must be an integer >= 0 or null; got {budget!r}")
        if budget is not None and not self.reasoning:
            raise InvalidParams("thinking_token_budget bounds the think block split off the reply: it needs "
                                "reasoning on")

    def _check_stop(self) -> None:
        """Stop strings, within the caps; one string given bare becomes a list of one."""
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

    @property
    def penalized(self) -> bool:
        """Whether a penalty needs the request's token counts."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def token_ids(self) -> set[int]:
        """Every token id the parameters name, to check against the vocabulary."""
        return set(self.logit_bias or ()) | set(self.stop_token_ids or ())


def invalid_params(error: msgspec.DecodeError) -> InvalidParams | None:
    """The InvalidParams behind a message that failed to decode, if that is why it failed (a wrong type
    or an unknown field is a malformed message instead)."""
    cause = error.__cause__
    if isinstance(cause, InvalidGrammar):  # a GrammarSpec's own check, as it decoded
        return InvalidParams(f"structured: {cause}")
    return cause if isinstance(cause, InvalidParams) else None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _logit_bias_shown(bias: object) -> str:
    """A refused logit_bias for its error: the count and the first entry out of bounds, never the whole map
    (300 entries and more would fill the message)."""
    if not isinstance(bias, dict):
        return f"a {type(bias).__name__}"
    bad = next(((t, b) for t, b in bias.items()
                if not _is_int(t) or t < 0 or not _is_number(b) or not -100.0 <= b <= 100.0), None)
    return f"{len(bias)} entries" + (f", among them {bad[0]!r}: {bad[1]!r}" if bad is not None else "")
