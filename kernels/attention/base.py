"""The attention-backend interface shared by every implementation."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionBatch:
    """One step's ragged batch, as the runner describes it to a backend.

    Request `b` contributes `q_lens[b]` consecutive query tokens to the flat token axis; after this
    step it has `kv_lens[b]` tokens of K/V (its queries are the last `q_lens[b]` of them, so the
    causal mask is aligned bottom-right). `rows` are the request-table rows and `out_slots` the KV
    token slots where this step's new K/V are written.
    """

    q_lens: list[int]
    kv_lens: list[int]
    rows: torch.Tensor
    out_slots: torch.Tensor
    table: torch.Tensor

    @property
    def is_decode(self) -> bool:
        return all(q == 1 for q in self.q_lens)


class AttentionBackend(ABC):
    """Writes new K/V into the paged pool and attends over each request's cached tokens."""

    @abstractmethod
    def prepare(self, batch: AttentionBatch) -> object:
        """Build per-step metadata once; it is reused by every layer."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: object, scale: float) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] for the new tokens; caches: [slots, Hkv, D]. Returns [T, Hq, D]."""


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             out_slots: torch.Tensor) -> None:
    """Scatter this step's K/V into their token slots."""
    k_cache.index_copy_(0, out_slots, k)
    v_cache.index_copy_(0, out_slots, v)
