"""The attention-backend interface and the step metadata every backend reads."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from kernels.attention.int8_kv import is_int8, quantize_keys, quantize_rows

StateT = TypeVar("StateT")
"""A backend's per-step state: what `prepare` (or `capture_state`) builds and every layer's `forward` reads."""


@dataclass
class RaggedIndices:
    """A step's batch in CSR form, for kernels that walk it flat (Triton, FlashInfer, CUDA graphs)."""

    qo_indptr: torch.Tensor  # int32 [B + 1]
    kv_indptr: torch.Tensor  # int32 [B + 1]
    kv_indices: torch.Tensor  # int32 [sum(kv_lens)]
    prefix_lens: torch.Tensor  # int32 [B]


@dataclass
class AttentionMetadata:
    """One step's ragged batch at page size 1, built once per step and read by every layer.

    Request `b` contributes `q_lens[b]` consecutive query tokens to the flat token axis, starting at
    `qo_indptr[b]`. After this step it has `kv_lens[b]` tokens of K/V: the first `prefix_lens[b]`
    were cached before the step, the rest are this step's tokens, so the causal mask is aligned
    bottom-right. `kv_indices[kv_indptr[b] : kv_indptr[b + 1]]` are the KV-pool locations of its
    positions 0..kv_lens[b]-1, as the request table maps them (so kernels never see the page size);
    `out_locs` are where this step's new K/V are written. `rows` and `table` are the request-table
    rows and the table itself, for backends that gather by row.

    The CSR tensors (`RaggedIndices`) are built on first use: the torch and cpu backends read the
    table by row and never need them, and building them is a third of the scheduler's per-step work.
    """

    q_lens: list[int]
    kv_lens: list[int]
    out_locs: torch.Tensor  # int64 [T]
    rows: torch.Tensor  # int64 [B]
    table: torch.Tensor  # int64 [slots, max_len]
    indices: RaggedIndices | None = None  # given (CUDA-graph static buffers) or built by `ragged`

    @property
    def is_decode(self) -> bool:
        return all(q == 1 for q in self.q_lens)

    @property
    def num_tokens(self) -> int:
        return self.out_locs.numel()

    @property
    def ragged(self) -> RaggedIndices:
        if self.indices is None:
            self.indices = ragged_indices(self.q_lens, self.kv_lens, self.rows, self.table)
        return self.indices

    @property
    def qo_indptr(self) -> torch.Tensor:
        return self.ragged.qo_indptr

    @property
    def kv_indptr(self) -> torch.Tensor:
        return self.ragged.kv_indptr

    @property
    def kv_indices(self) -> torch.Tensor:
        return self.ragged.kv_indices

    @property
    def prefix_lens(self) -> torch.Tensor:
        return self.ragged.prefix_lens


def ragged_indices(q_lens: list[int], kv_lens: list[int], rows: torch.Tensor, table: torch.Tensor) -> RaggedIndices:
    device = table.device
    q = torch.tensor(q_lens, dtype=torch.int32, device=device)
    kv = torch.tensor(kv_lens, dtype=torch.int32, device=device)
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    window = table[rows, : max(kv_lens)]
    positions = torch.arange(window.shape[1], device=device)
    return RaggedIndices(qo_indptr=torch.cat((zero, torch.cumsum(q, 0, dtype=torch.int32))),
                         kv_indptr=torch.cat((zero, torch.cumsum(kv, 0, dtype=torch.int32))),
                         kv_indices=window[positions[None, :] < kv[:, None]].to(torch.int32), prefix_lens=kv - q)


def build_metadata(q_lens: list[int], kv_lens: list[int], rows: torch.Tensor, table: torch.Tensor,
                   out_locs: torch.Tensor | None = None) -> AttentionMetadata:
    """The metadata of a batch whose request `b` sits in table row `rows[b]` (all on the table's device).
    `out_locs` may be given by a caller that has them already (the scheduler reads them off the table)."""
    if out_locs is None:
        window = table[rows, : max(kv_lens)]
        q, kv = (torch.tensor(x, device=table.device) for x in (q_lens, kv_lens))
        positions = torch.arange(window.shape[1], device=table.device)
        out_locs = window[(positions[None, :] >= (kv - q)[:, None]) & (positions[None, :] < kv[:, None])]
    return AttentionMetadata(q_lens=q_lens, kv_lens=kv_lens, out_locs=out_locs, rows=rows, table=table)


@dataclass(frozen=True)
class AttentionShape:
    """What a backend that plans ahead (FlashInfer) must know about the model before the first step: its heads,
    dtype and scale, the layers' windows (None: a layer that sees every position) and any score cap."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    scale: float
    windows: frozenset[int | None] = frozenset({None})
    softcap: float | None = None


class AttentionBackend(ABC, Generic[StateT]):
    """Writes new K/V into the paged pool and attends over each request's cached tokens."""

    name: str = ""
    """The registry name (`kernels.attention.BACKENDS`), as reported by a running engine."""

    def setup(self, shape: AttentionShape, device: torch.device) -> None:
        """Called once with the model's attention shape before the first step; most backends need nothing."""

    supports_cuda_graph = False
    """Whether `capture_state` / `replay_prepare` are implemented (decode steps may then be graphed)."""

    def capture_state(self, meta: AttentionMetadata) -> StateT:
        """Capture hook: the state a CUDA graph of decode steps will bake in, for `meta`, whose tensors are
        the graph's static buffers (their contents change before each replay, their addresses never)."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def replay_prepare(self, state: StateT, meta: AttentionMetadata) -> None:
        """Replay hook: the static buffers now hold this step's (padded) batch; redo any host-side planning."""

    @abstractmethod
    def prepare(self, meta: AttentionMetadata) -> StateT:
        """Backend-specific state for this step (masks, plans), built once and reused by every layer."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, state: StateT, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] for the new tokens; caches: [locations, Hkv, D]. Returns [T, Hq, D].

        A query at position p attends to the keys at positions p - window < j <= p (`window` None: j <= p), as
        transformers' sliding-window mask does; `softcap` caps each score s * scale as softcap * tanh(s / softcap)
        (Gemma 2) before the softmax."""


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             out_locs: torch.Tensor) -> None:
    """Scatter this step's K/V into their KV locations (quantized as they go, into int8 pages)."""
    if is_int8(k_cache):
        k, v = quantize_keys(k), quantize_rows(v)
    k_cache.index_copy_(0, out_locs, k)
    v_cache.index_copy_(0, out_locs, v)
