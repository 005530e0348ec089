"""Reference attention in plain torch: gather each request's K/V from the pool, pad, and run SDPA.

Slow for long ragged batches but exact and portable; it is the CPU path and the oracle the GPU
kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention.base import AttentionBackend, AttentionMetadata, store_kv


@dataclass
class TorchRefMeta:
    out_slots: torch.Tensor
    kv_index: torch.Tensor  # [B, max_kv] token slots (padding points at a valid slot, masked off)
    q_index: torch.Tensor  # [B, max_q] flat token index (padding repeats a valid index)
    unpad_index: torch.Tensor  # [T] position of each flat token in the [B * max_q] padded layout
    mask: torch.Tensor | None  # [B, 1, max_q, max_kv] bool, True = attend; None when nothing is masked


class TorchRefBackend(AttentionBackend):
    """Gather each request's K/V by its table row into a padded batch; one SDPA call for the step."""

    def prepare(self, batch: AttentionMetadata) -> TorchRefMeta:
        device = batch.out_slots.device
        q_lens = torch.tensor(batch.q_lens, device=device)
        kv_lens = torch.tensor(batch.kv_lens, device=device)
        max_q, max_kv = max(batch.q_lens), max(batch.kv_lens)
        bsz = len(batch.q_lens)
        q_starts = torch.cumsum(q_lens, 0) - q_lens
        i = torch.arange(max_q, device=device)
        j = torch.arange(max_kv, device=device)
        q_valid = i[None, :] < q_lens[:, None]
        q_index = torch.where(q_valid, q_starts[:, None] + i[None, :], q_starts[:, None])
        unpad_index = (torch.arange(bsz, device=device)[:, None] * max_q + i[None, :])[q_valid]
        kv_index = batch.table[batch.rows, :max_kv]
        # Query i of request b sits at absolute position kv_len - q_len + i and sees keys j <= that.
        q_pos = (kv_lens - q_lens)[:, None] + i[None, :]
        mask = (j[None, None, :] <= q_pos[:, :, None]) & q_valid[:, :, None]
        mask |= ~q_valid[:, :, None] & (j[None, None, :] == 0)  # padded rows attend to one key, not none
        all_visible = max_q == 1 and bool((kv_lens == max_kv).all())
        return TorchRefMeta(batch.out_slots, kv_index, q_index, unpad_index,
                            None if all_visible else mask[:, None])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: TorchRefMeta, scale: float) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.out_slots)
        qp = q[meta.q_index].transpose(1, 2)  # [B, Hq, max_q, D]
        kp = k_cache[meta.kv_index].transpose(1, 2)  # [B, Hkv, max_kv, D]
        vp = v_cache[meta.kv_index].transpose(1, 2)
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=meta.mask, scale=scale,
                                             enable_gqa=qp.shape[1] != kp.shape[1])
        bsz, heads, max_q, dim = out.shape
        return out.transpose(1, 2).reshape(bsz * max_q, heads, dim)[meta.unpad_index]
