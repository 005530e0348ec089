"""The CPU backend: the torch reference's step layout, with decode attention in minichat's C kernel.

A step's leading one-query requests (decode) attend straight from the paged pool (kernels/cpu/attention.c):
no per-layer gather of their K/V into a padded tensor, no mask, no float32 copies. The rest of a step
(prompt chunks) is the reference's padded SDPA call, which is already efficient for many queries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention.base import AttentionShape
from kernels.attention.torch_ref import TorchRefBackend
from kernels.cpu import CpuKernels, load_cpu_kernels, require_supported


@dataclass
class PoolDecodeMeta:
    """Request b's K/V are its first kv_lens[b] slots in row rows[b] of the request table."""

    table: torch.Tensor  # int64 [slots, max_len]
    rows: torch.Tensor  # int64 [B]
    kv_lens: torch.Tensor  # int64 [B]


class CpuBackend(TorchRefBackend):
    """TorchRefBackend with its decode half replaced by the C kernel."""

    name = "cpu"
    kernels: CpuKernels | None = None

    def setup(self, shape: AttentionShape, device: torch.device) -> None:
        require_supported(device.type, shape.dtype)
        super().setup(shape, device)
        self.kernels = load_cpu_kernels()

    def _prepare_decode(self, kv_lens: list[int], rows: torch.Tensor, table: torch.Tensor) -> PoolDecodeMeta:
        return PoolDecodeMeta(table, rows.contiguous(), torch.tensor(kv_lens, dtype=torch.int64))

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PoolDecodeMeta,
                scale: float) -> torch.Tensor:
        return self.kernels.decode_attention(q, k_cache, v_cache, meta.table, meta.rows, meta.kv_lens, scale)
