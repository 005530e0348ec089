"""A step's tensors from the scheduler's decision: `build_batch(plan, table, eos_ids) -> ForwardBatch`.

The scheduler decides (engine/scheduler/policy.py): which requests decode, which prefill, how many
tokens each feeds (`extend_len`), and it gives them their pages. This module only turns that into
what the runner reads: the flat token axis (all requests' new tokens concatenated, decoding requests
first), where each sampled token goes, the attention metadata and the sampling rows. It reads the
requests and changes none of them; the scheduler commits the step afterwards (`Scheduler._commit`),
so `sampled` and `cached_len` here are still the values from before this step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from engine.batch import ForwardBatch
from engine.kv.table import RequestTable
from engine.request import Req
from engine.sampling import SamplingBatch
from engine.scheduler.policy import Plan
from kernels.attention.base import build_metadata


@dataclass
class _TokenAxis:
    """The step's flat token axis as host lists, filled one request at a time in batch order."""

    width: int  # the request table's row length: position p of slot s is flat index s * width + p
    slots: list[int] = field(default_factory=list)  # each request's table row
    input_index: list[int] = field(default_factory=list)  # flat token-table index of each token
    input_ids: list[int] = field(default_factory=list)  # prompt tokens only (decode tokens are on the device)
    positions: list[int] = field(default_factory=list)
    q_lens: list[int] = field(default_factory=list)  # tokens each request feeds
    kv_lens: list[int] = field(default_factory=list)  # tokens each request attends to
    sample_rows: list[int] = field(default_factory=list)  # each sampled row's request
    sample_offsets: list[int] = field(default_factory=list)  # each sampled row's position past its `sampled`
    logits_at: list[int] = field(default_factory=list)  # the axis row each of them samples from
    out_index: list[int] = field(default_factory=list)  # flat token-table index its token is written to
    prompt_rows: list[tuple[int, int]] = field(default_factory=list)  # (request, positions scored)
    prompt_at: list[int] = field(default_factory=list)  # the axis rows whose logits score prompt tokens
    prompt_targets: list[int] = field(default_factory=list)  # the prompt tokens they score

    def add(self, row: int, req: Req, feeds_ids: bool, drafts: list[int] | None = None) -> None:
        """Request `row` of the batch: its `extend_len` tokens from `cached_len` on (with `drafts`: its last
        token and the drafts, every position sampled)."""
        start, end = req.cached_len, req.cached_len + req.extend_len
        assert req.kv.slot is not None  # a scheduled request holds a slot
        base = req.kv.slot * self.width
        self.slots.append(req.kv.slot)
        self.input_index += range(base + start, base + end)
        if drafts:
            self.input_ids += req.tokens(start, start + 1) + drafts
        elif feeds_ids:
            self.input_ids += req.tokens(start, end)
        self.positions += range(start, end)
        self.q_lens.append(req.extend_len)
        self.kv_lens.append(end)
        if req.scoring_prompt:
            self._score_prompt(row, req, start, end)
        # A request samples when this step reaches the end of its tokens; mid-chunk ones do not. A verifying
        # one samples after each of its tokens: row i the token after draft i (its last token for i = 0).
        first = end - 1 - len(drafts or ())
        if first == req.input_len + req.sampled - 1:
            count = end - first
            self.sample_rows += [row] * count
            self.sample_offsets += range(count)
            self.logits_at += range(len(self.positions) - count, len(self.positions))
            self.out_index += range(base + first + 1, base + end + 1)

    def _score_prompt(self, row: int, req: Req, start: int, end: int) -> None:
        """The logits rows of the prompt positions in [start, end) not scored yet: position q's logits
        score prompt token q + 1 (the commit adds the count to `req.reply.scored`)."""
        first, last = max(start, req.reply.scored - 1), min(end, req.input_len - 1)
        if last > first:
            offset = len(self.positions) - end
            self.prompt_at += range(offset + first, offset + last)
            self.prompt_rows.append((row, last - first))
            self.prompt_targets += req.input_ids[first + 1 : last + 1]


def _logits_rows(sampled_at: list[int], prompt_at: list[int]) -> tuple[list[int], list[int]]:
    """The logits rows, sampled then prompt ones, put in position order, and where each went.

    The model reads the rows in position order (so that as many rows as tokens are all of them, in
    order); `select` gives each of ours its place: the sampled rows' first, then the prompt rows'."""
    rows_at = sampled_at + prompt_at
    order = sorted(range(len(rows_at)), key=rows_at.__getitem__)
    select = [0] * len(order)
    for place, j in enumerate(order):
        select[j] = place
    return [rows_at[j] for j in order], select


def _to_device(device: torch.device, *lists: list[int]) -> list[torch.Tensor]:
    """One int64 tensor per list, from a single host-to-device copy (a copy per list costs more)."""
    packed = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.int64, device=device)
    return list(packed.split([len(values) for values in lists]))


def build_batch(plan: Plan, table: RequestTable, eos_ids: set[int]) -> ForwardBatch:
    """The ForwardBatch of `plan`, whose requests hold the pages for the positions they write."""
    reqs = plan.reqs
    axis = _TokenAxis(table.max_len)
    for row, req in enumerate(reqs):
        axis.add(row, req, feeds_ids=row >= len(plan.decode), drafts=plan.verify.get(req))
    logits_at, select = _logits_rows(axis.logits_at, axis.prompt_at) if axis.prompt_rows else (axis.logits_at, [])
    device = table.table.device
    input_index, positions, logits_index, out_index, rows, input_ids, select_t = _to_device(
        device, axis.input_index, axis.positions, logits_at, axis.out_index, axis.slots, axis.input_ids, select)
    # the KV location of each new token is its entry in the request table, where input_index points
    out_locs = table.table.view(-1).index_select(0, input_index)
    prompt_top = max((reqs[i].params.prompt_logprobs or 0 for i, _ in axis.prompt_rows), default=0)
    return ForwardBatch(
        kind=plan.kind, reqs=reqs, sample_rows=axis.sample_rows, num_decode=len(plan.decode),
        input_ids=input_ids if axis.input_ids else None, input_index=input_index, positions=positions,
        logits_index=logits_index, out_index=out_index,
        attn=build_metadata(axis.q_lens, axis.kv_lens, rows, table.table, out_locs),
        sampling=SamplingBatch.build([reqs[i] for i in axis.sample_rows], eos_ids, device, axis.prompt_targets,
                                     prompt_top, axis.sample_offsets),
        num_tokens=len(axis.positions), logits_select=select_t if axis.prompt_rows else None,
        prompt_rows=axis.prompt_rows, drafts={row: plan.verify[req] for row, req in enumerate(reqs)
                                              if req in plan.verify})
