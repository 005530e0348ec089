"""Reference attention in plain torch: gather each request's K/V from the pool and attend.

Exact and portable; it is the CPU path and the oracle the GPU kernels are tested against. A step of
fresh prompts (nothing cached before it) attends over its own new K/V, so it gathers nothing from the
pool, and needs no mask when every prompt has the same length. A decode step (one query per request)
gathers K/V head-major and attends with two batched matmuls and a softmax: on the CPU that is about
twice as fast as SDPA's flash kernel, which is built for many queries per request. Other steps pad
to the longest request and run SDPA. On a CPU without native bf16/fp16 arithmetic, attention runs in
float32 (SDPA's half-precision CPU kernel is ~10x slower there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model.ops import has_native_half_gemm
from kernels.attention.base import AttentionBackend, AttentionMetadata, AttentionShape, store_kv


@dataclass
class TorchRefMeta:
    out_slots: torch.Tensor
    kv_index: torch.Tensor | None  # [B, max_kv] pool slots (padding masked off); None: attend to the new K/V
    q_index: torch.Tensor | None  # [B, max_q] flat token index (padding repeats a valid index); None: no padding
    unpad_index: torch.Tensor | None  # [T] position of each flat token in [B * max_q]; None: no padding
    batch_size: int
    mask: torch.Tensor | None  # [B, 1, max_q, max_kv] bool, True = attend; None when nothing is masked
    causal: bool  # no mask, but queries and keys are the same tokens: SDPA's own causal mask


@dataclass
class DecodeMeta:
    """A decode step: request b's K/V rows for head h are `head_rows[b, h]` of the pool viewed as
    [slots * kv_heads, head_dim], so one gather lays them out as [B, kv_heads, max_kv, head_dim]."""

    out_slots: torch.Tensor
    head_rows: torch.Tensor  # [B * kv_heads * max_kv] rows of the head-major pool view
    max_kv: int
    bias: torch.Tensor | None  # [B, 1, 1, max_kv] float32: 0 to attend, -inf past the request's length


def gather(x: torch.Tensor, index: torch.Tensor | None, batch_size: int) -> torch.Tensor:
    """Rows `index` [B, n] of `x` as [B, n, ...] (index_select copies whole rows: faster than x[index])."""
    rows = x if index is None else x.index_select(0, index.flatten())
    return rows.unflatten(0, (batch_size, -1))


class TorchRefBackend(AttentionBackend):
    """Gather each request's K/V by its table row; one attention call per layer for the whole step."""

    num_kv_heads: int | None = None

    def setup(self, shape: AttentionShape, device: torch.device) -> None:
        self.num_kv_heads = shape.num_kv_heads

    def prepare(self, batch: AttentionMetadata) -> TorchRefMeta | DecodeMeta:
        if self.num_kv_heads is None:
            raise RuntimeError("TorchRefBackend.setup() must run before the first step")
        device = batch.out_slots.device
        max_q, max_kv = max(batch.q_lens), max(batch.kv_lens)
        if max_q == 1 and batch.q_lens != batch.kv_lens:
            return self._prepare_decode(batch, max_kv)
        q_lens = torch.tensor(batch.q_lens, device=device)
        kv_lens = torch.tensor(batch.kv_lens, device=device)
        bsz = len(batch.q_lens)
        q_starts = torch.cumsum(q_lens, 0) - q_lens
        i = torch.arange(max_q, device=device)
        q_valid = i[None, :] < q_lens[:, None]
        q_index = torch.where(q_valid, q_starts[:, None] + i[None, :], q_starts[:, None])
        if min(batch.q_lens) == max_q:  # equal lengths: the flat axis is already [B, max_q]
            q_index = unpad_index = None
        else:
            unpad_index = (torch.arange(bsz, device=device)[:, None] * max_q + i[None, :])[q_valid]
        if batch.q_lens == batch.kv_lens:  # fresh prompts: keys are this step's tokens, laid out like the queries
            if q_index is None:
                return TorchRefMeta(batch.out_slots, None, None, None, bsz, None, causal=max_q > 1)
            kv_index, kv_lens, max_kv = None, q_lens, max_q
        else:
            kv_index = batch.table[batch.rows, :max_kv]
        j = torch.arange(max_kv, device=device)
        # Query i of request b sits at absolute position kv_len - q_len + i and sees keys j <= that.
        q_pos = (kv_lens - q_lens)[:, None] + i[None, :]
        mask = (j[None, None, :] <= q_pos[:, :, None]) & q_valid[:, :, None]
        mask |= ~q_valid[:, :, None] & (j[None, None, :] == 0)  # padded rows attend to one key, not none
        return TorchRefMeta(batch.out_slots, kv_index, q_index, unpad_index, bsz, mask[:, None], causal=False)

    def _prepare_decode(self, batch: AttentionMetadata, max_kv: int) -> DecodeMeta:
        heads = self.num_kv_heads
        device = batch.out_slots.device
        slots = batch.table[batch.rows, :max_kv]
        head_rows = (slots[:, None, :] * heads + torch.arange(heads, device=device)[None, :, None]).flatten()
        bias = None
        if min(batch.kv_lens) != max_kv:
            kv_lens = torch.tensor(batch.kv_lens, device=device)
            past_end = torch.arange(max_kv, device=device)[None, :] >= kv_lens[:, None]
            bias = torch.zeros(past_end.shape, device=device).masked_fill_(past_end, float("-inf"))[:, None, None]
        return DecodeMeta(batch.out_slots, head_rows, max_kv, bias)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: TorchRefMeta | DecodeMeta, scale: float) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.out_slots)
        if isinstance(meta, DecodeMeta):
            return self._decode(q, k_cache, v_cache, meta, scale)
        qp, kp, vp = (gather(x, meta.q_index, meta.batch_size) for x in (q, k, v))
        if meta.kv_index is not None:
            kp, vp = gather(k_cache, meta.kv_index, meta.batch_size), gather(v_cache, meta.kv_index, meta.batch_size)
        dtype = q.dtype
        if not has_native_half_gemm(q.device, dtype):
            qp, kp, vp = qp.float(), kp.float(), vp.float()
        out = F.scaled_dot_product_attention(qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2),
                                             attn_mask=meta.mask, is_causal=meta.causal, scale=scale,
                                             enable_gqa=qp.shape[2] != kp.shape[2])
        bsz, heads, max_q, dim = out.shape
        out = out.transpose(1, 2).reshape(bsz * max_q, heads, dim).to(dtype)
        return out if meta.unpad_index is None else out[meta.unpad_index]

    @staticmethod
    def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: DecodeMeta,
                scale: float) -> torch.Tensor:
        """softmax(q K^T * scale + bias) V per request and KV head group, in float32."""
        bsz, num_heads, dim = q.shape
        kv_heads = k_cache.shape[1]
        shape = (bsz, kv_heads, meta.max_kv, dim)
        kp = k_cache.view(-1, dim).index_select(0, meta.head_rows).view(shape).float()
        vp = v_cache.view(-1, dim).index_select(0, meta.head_rows).view(shape).float()
        qg = q.float().reshape(bsz, kv_heads, num_heads // kv_heads, dim) * scale
        scores = torch.matmul(qg, kp.transpose(-1, -2))  # [B, kv_heads, group, max_kv]
        if meta.bias is not None:
            scores += meta.bias
        out = torch.matmul(torch.softmax(scores, dim=-1), vp)
        return out.view(bsz, num_heads, dim).to(q.dtype)
