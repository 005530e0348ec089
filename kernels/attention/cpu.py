"""The CPU backend: attention straight from the paged pool in minichat's C kernel (kernels/cpu/attention.c).

Every query token is one item of the kernel: token i of a request whose step ends with kv_len keys
attends to that request's first kv_len - q_len + 1 + i keys, read through its request-table row (a
layer with a sliding window of W reads only the last W of them). That one rule covers decode tokens,
fresh prompts, chunks continuing over a cached prefix and mixed steps, with no gather into padded
tensors, no mask and no float32 copies.

The kernel scores one query at a time, so a long prompt chunk re-reads its keys once per token; past
`max_per_token_queries` queries in one request SDPA's tiled kernel wins (a 1,024-token prompt: 32 vs
26 ms per layer, 0.5B shape; 512 tokens: 7.2 vs 8.2 ms; 32 x 64 tokens: 1.8 vs 2.9 ms). Such a step
takes the torch reference's layout instead: its leading decode tokens still through the C kernel,
the prompt chunks through one padded SDPA call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.attention.base import AttentionMetadata, AttentionShape
from kernels.attention.torch_ref import ReferenceLayout, TorchRefMeta
from kernels.cpu import CpuKernels, load_cpu_kernels, require_supported


@dataclass
class PagedMeta:
    """Query token t attends to the first kv_lens[t] KV locations of request-table row rows[t] (the last `window`
    of them, for the layers of that window)."""

    table: torch.Tensor  # int64 [slots, max_len]
    rows: torch.Tensor  # int64 [T]
    kv_lens: torch.Tensor  # int64 [T]
    window: int | None = field(default=None, kw_only=True)


@dataclass
class PagedStep(PagedMeta):
    """A step all through the C kernel (inside a `TorchRefMeta`, a plain PagedMeta: the layout stores the K/V)."""

    out_locs: torch.Tensor  # where this step's K/V go


class CpuBackend(ReferenceLayout[PagedStep | TorchRefMeta[PagedMeta], PagedMeta]):
    """Every token through the C kernel; steps with a long prompt chunk in the reference's layout."""

    name = "cpu"
    kernels: CpuKernels  # set by setup()
    max_per_token_queries = 512  # the most queries of one request a step may have to run per token

    def setup(self, shape: AttentionShape, device: torch.device) -> None:
        require_supported(device.type, shape.dtype)
        self.kernels = load_cpu_kernels()

    def prepare(self, batch: AttentionMetadata) -> PagedStep | TorchRefMeta[PagedMeta]:
        if max(batch.q_lens) > self.max_per_token_queries:
            return self._prepare_layout(batch)
        if len(batch.q_lens) == batch.num_tokens:  # one token per request: a decode step
            kv_lens = torch.tensor(batch.kv_lens, dtype=torch.int64)
            return PagedStep(batch.table, batch.rows.contiguous(), kv_lens, batch.out_locs)
        tokens, q_lens = batch.num_tokens, torch.tensor(batch.q_lens, dtype=torch.int64)
        first = torch.tensor(batch.kv_lens, dtype=torch.int64) - q_lens + 1  # keys seen by a request's first query
        starts = torch.cumsum(q_lens, 0) - q_lens
        kv_lens = torch.arange(tokens) + (first - starts).repeat_interleave(q_lens, output_size=tokens)
        rows = batch.rows.repeat_interleave(q_lens, output_size=tokens)
        return PagedStep(batch.table, rows, kv_lens, batch.out_locs)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: PagedStep | TorchRefMeta[PagedMeta], scale: float,
                window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        if isinstance(meta, TorchRefMeta):
            return self._forward_layout(q, k, v, k_cache, v_cache, meta, scale, window, softcap)
        return self.kernels.paged_attention(q, k_cache, v_cache, meta.table, meta.rows, meta.kv_lens, scale,
                                            new=(k, v, meta.out_locs), window=window, softcap=softcap)

    def _prepare_decode(self, kv_lens: list[int], rows: torch.Tensor, table: torch.Tensor,
                        window: int | None) -> PagedMeta:
        return PagedMeta(table, rows.contiguous(), torch.tensor(kv_lens, dtype=torch.int64), window=window)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMeta,
                scale: float, softcap: float | None) -> torch.Tensor:
        return self.kernels.paged_attention(q, k_cache, v_cache, meta.table, meta.rows, meta.kv_lens, scale,
                                            window=meta.window, softcap=softcap)
