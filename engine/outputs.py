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
    """One scheduler step: a prefill batch, a decode batch, or nothing to do.

    `rids` lists the batch members in batch order; `finished` the requests that ended during the
    step (including aborts since the previous step); `deltas` the streamed output.
    """

    kind: str
    rids: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    deltas: list[Delta] = field(default_factory=list)
    num_tokens: int = 0
    duration: float = 0.0


@dataclass
class RequestOutput:
    """A finished request, as `LLM.generate` returns it."""

    rid: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    cached_tokens: int = 0
