"""What one step hands from the scheduler to the model runner, and back.

`Scheduler.schedule()` builds a `ForwardBatch`; `ModelRunner.run(batch)` returns a `ForwardOutput`;
`Scheduler.process(batch, output)` turns it into a `StepResult`. The batch is a plain dataclass of
tensors and small host lists, so it can be built while the previous step still runs (overlap) and
sent to other ranks (tensor parallelism): `run` reads only the tensors, the sampling lists and the
attention metadata, never `reqs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.request import Req, SamplingParams
from kernels.attention.base import AttentionMetadata


@dataclass
class SamplingBatch:
    """How to pick each sampled row's token: one SamplingParams and generator per row."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]

    @property
    def all_greedy(self) -> bool:
        return all(p.greedy for p in self.params)


@dataclass
class ForwardBatch:
    """One step's flat token axis (all requests' new tokens concatenated) and where its outputs go.

    Input ids are not here: `run` reads them from the request table's token ids at `input_index`
    (flat `slot * max_len + position`), where admission put the prompt and the sampler puts every
    sampled token. So a step can be scheduled before the host has seen the previous step's tokens.
    """

    kind: str  # "prefill" or "decode"
    reqs: list[Req] = field(repr=False)  # host side, read by `process` only
    sample_rows: list[int]  # indices into `reqs` of the requests that sample this step
    input_index: torch.Tensor  # int64 [T]: flat token-table index of each input token
    positions: torch.Tensor  # int64 [T]
    logits_index: torch.Tensor  # int64 [S]: flat token rows whose logits are sampled
    out_index: torch.Tensor  # int64 [S]: flat token-table index each sampled token is written to
    attn: AttentionMetadata
    sampling: SamplingBatch
    num_tokens: int
    schedule_time: float = 0.0  # seconds spent building this batch (host)


@dataclass
class ForwardOutput:
    """Sampled next-token ids, one per sampled row (on the model's device; `process` copies them)."""

    next_tokens: torch.Tensor  # int64 [S]
    run_time: float = 0.0
