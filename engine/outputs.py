"""What the engine hands back: per-step results, streamed deltas and finished outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Delta:
    """New tokens and text for one request from one step; the last one carries `finish_reason`."""

    rid: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepResult:
    """One scheduler step: a prefill, decode or mixed batch (`kind`), or nothing to do ("idle").

    `rids` lists the batch members in batch order (decoding ones first); `finished` the requests that
    ended during the step (including aborts since the previous step); `deltas` the streamed output.
    Of `num_tokens`, `num_decode_tokens` were decode tokens (one per running request), the rest prompt.
    """

    kind: str
    rids: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    deltas: list[Delta] = field(default_factory=list)
    num_tokens: int = 0
    duration: float = 0.0
    num_decode_tokens: int = 0

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens


@dataclass
class RequestOutput:
    """A finished request, as `LLM.generate` returns it."""

    rid: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    cached_tokens: int = 0
