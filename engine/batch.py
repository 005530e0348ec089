"""What one step hands from the scheduler to the model runner, and back.

`Scheduler.schedule()` decides a step and has `build_batch` (engine/scheduler/batch_builder.py) make
its `ForwardBatch`; `ModelRunner.run(batch)` returns a `ForwardOutput`;
`Scheduler.process(batch, output)` turns it into a `StepResult`. The batch is a plain dataclass of
tensors and small host lists, so it can be built while the previous step still runs (overlap) and
sent to other ranks (tensor parallelism): `run` reads only the tensors, the sampling lists and the
attention metadata, never `reqs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.request import Req
from engine.sampling import Logprobs, SamplingBatch
from kernels.attention.base import AttentionMetadata


@dataclass
class ForwardBatch:
    """One step's flat token axis (all requests' new tokens concatenated) and where its outputs go.

    The first `num_decode` requests decode (one token each); the rest feed tokens the host knows: first
    the requests verifying drafts (`drafts`: their last token and drafts, one sampled row per position),
    then prompt chunks. Known tokens travel in `input_ids`. A decode token is the one the previous step
    sampled, which the host may not have seen yet (overlap), so `run` reads it from the token table at
    `input_index` (flat `slot * max_len + position`), where that step's sampler wrote it. Either way the
    batch carries all a runner needs besides the token table its own `run` fills.
    """

    kind: str  # "prefill", "decode" or "mixed" (decode requests first, then prompt chunks)
    reqs: list[Req] = field(repr=False)  # host side, read by `process` only
    sample_rows: list[int]  # for each sampled row, its request's index into `reqs` (a verifying one has 1 + k)
    num_decode: int  # leading requests (and tokens) that decode
    input_ids: torch.Tensor | None  # int64 [T - num_decode]: the known tokens; None when there are none
    input_index: torch.Tensor  # int64 [T]: flat token-table index of each input token
    positions: torch.Tensor  # int64 [T]
    logits_index: torch.Tensor  # int64 [S]: flat token rows whose logits are sampled
    out_index: torch.Tensor  # int64 [S]: flat token-table index each sampled token is written to
    attn: AttentionMetadata
    sampling: SamplingBatch
    num_tokens: int
    schedule_time: float = 0.0  # seconds spent building this batch (host)
    # With prompt log-probabilities the logits rows are the sampled ones and the prompt positions, in
    # position order: `logits_select` lists the sampled rows' places, then the prompt rows'.
    logits_select: torch.Tensor | None = None
    prompt_rows: list[tuple[int, int]] = field(default_factory=list)  # (index in reqs, positions scored)
    drafts: dict[int, list[int]] = field(default_factory=dict)  # index in reqs -> the drafts it verifies
    propose_time: float = 0.0  # of schedule_time, seconds the proposer spent on the drafts

    @property
    def num_verify_tokens(self) -> int:
        """Query tokens of the requests verifying drafts (their last token and the drafts)."""
        return sum(1 + len(d) for d in self.drafts.values())

    @property
    def sampled_reqs(self) -> list[Req]:
        """The request of each sampled row, in row order (host side; a verifying request once per row)."""
        return [self.reqs[i] for i in self.sample_rows]


@dataclass
class ForwardOutput:
    """Sampled next-token ids, one per sampled row.

    On CUDA the step runs on the runner's stream and `next_tokens` is a pinned host copy still in
    flight until `ready` fires; `tokens()` waits for it, so only `process` ever waits for the GPU.
    """

    next_tokens: torch.Tensor  # int64 [S]
    run_time: float = 0.0  # host seconds to launch (CUDA) or run (CPU) the step
    ready: torch.cuda.Event | None = None
    logprobs: Logprobs | None = None  # the sampled tokens', for the rows that asked
    prompt_logprobs: Logprobs | None = None  # the prompt positions' (`ForwardBatch.prompt_rows`)

    def tokens(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.next_tokens.tolist()
