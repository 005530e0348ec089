"""What the engine hands back: per-step results, streamed outputs and finished requests.

`Delta` and `Final` are msgspec Structs tagged by "type" because they are also the wire's messages
(engine/service/protocol.py carries them in `Outputs` unchanged); nothing here imports torch, so the
clients share these definitions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec


class Usage(msgspec.Struct, kw_only=True):
    """A request's tokens: `draft_tokens` were proposed for it and verified (speculative decoding), and
    `accepted_tokens` of them accepted (they are among its completion tokens); `reasoning_tokens` are the
    completion's think block's (engine/reasoning.py), markers included."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    draft_tokens: int = 0
    accepted_tokens: int = 0
    reasoning_tokens: int = 0


class Timings(msgspec.Struct, kw_only=True):
    """Seconds since the engine received the request; None for a stage the request never reached."""

    queue: float | None
    ttft: float | None
    total: float


class TokenLogprob(msgspec.Struct, array_like=True):
    """One token's log-probability under the model (None for a prompt's first token, which nothing
    predicts), its text, and the `top` most likely alternatives at that position as (id, text, logprob)."""

    token_id: int
    text: str
    logprob: float | None
    top: list[tuple[int, str, float]]


class Delta(msgspec.Struct, tag_field="type", tag="delta", kw_only=True):
    """New output of a running request from one step: token ids and the text they completed (may be empty).

    `index` is the choice among a request's `n`; `logprobs` has one entry per token when asked for;
    `prompt_logprobs` comes once, with a request's first output, one entry per prompt token. A choice
    that ends while others go on ends with a Delta carrying its `finish_reason`. `reasoning` is new text
    of the reply's think block when the request splits it off (`SamplingParams.reasoning`); `text` is
    then the answer's only."""

    rid: str
    text: str
    token_ids: list[int]
    index: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    reasoning: str = ""

    @property
    def finished(self) -> bool:
        return False


class _Ended(msgspec.Struct, kw_only=True):
    """What a finished request reports: why it ended ("stop", "length", "abort"; `stop_string`: the stop
    string that ended it, if one did), usage and timings."""

    rid: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    timings: Timings
    index: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    reasoning: str = ""
    stop_string: str | None = None


class Final(_Ended, tag_field="type", tag="final"):
    """The last output of a request: its last new tokens and text (like a Delta's), and how it ended."""

    @property
    def finished(self) -> bool:
        return True


Output = Delta | Final


@dataclass
class StepResult:
    """One scheduler step: a prefill, decode or mixed batch (`kind`), or nothing to do ("idle").

    `rids` lists the batch members in batch order (decoding ones first); `finished` the requests that
    ended during the step (including aborts since the previous step); `outputs` the streamed output,
    a request's Final last. Of its `num_tokens` query tokens, `num_prefill_tokens` were prompt tokens;
    `num_decode_tokens` is what its decoding requests generated (one each, and a verifying request its
    accepted drafts too).
    """

    kind: str
    rids: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    outputs: list[Output] = field(default_factory=list)
    num_tokens: int = 0
    duration: float = 0.0
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    num_draft_tokens: int = 0  # drafts it verified
    num_accepted_tokens: int = 0  # of them accepted


class RequestOutput(_Ended):
    """A whole finished request, all its tokens and text: what `LLM.generate` and the clients'
    `complete` return. `prompt_token_ids` is None where the prompt was tokenized elsewhere (a client
    over the wire)."""

    prompt_token_ids: list[int] | None = None

    @classmethod
    def collect(cls, outputs: list[Output]) -> RequestOutput:
        """Join one request's outputs, which end with its Final."""
        final = outputs[-1]
        if not isinstance(final, Final):
            raise ValueError(f"request {final.rid!r} has not finished: its outputs end without a Final")
        logprobs = [lp for o in outputs for lp in o.logprobs or ()]
        prompt_logprobs = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None)
        return cls(rid=final.rid, text="".join(o.text for o in outputs),
                   token_ids=[t for o in outputs for t in o.token_ids], finish_reason=final.finish_reason,
                   usage=final.usage, timings=final.timings, index=final.index,
                   logprobs=logprobs if any(o.logprobs is not None for o in outputs) else None,
                   prompt_logprobs=prompt_logprobs, reasoning="".join(o.reasoning for o in outputs),
                   stop_string=final.stop_string)
