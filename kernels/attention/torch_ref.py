"""Reference attention in plain torch: gather each request's K/V from the pool and attend.

Exact and portable; it is the CPU path and the oracle the GPU kernels are tested against. A step of
fresh prompts (nothing cached before it) attends over its own new K/V, so it gathers nothing from the
pool, and needs no mask when every prompt has the same length. Requests with one query each (decode,
which a mixed step puts first) gather K/V head-major and attend with two batched matmuls and a
softmax: on the CPU that is about twice as fast as SDPA's flash kernel, which is built for many
queries per request. The rest of a step is padded to its longest request for one SDPA call. On a
CPU without native bf16/fp16 arithmetic, attention runs in float32 (SDPA's half-precision CPU kernel
is ~10x slower there).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
import torch.nn.functional as F

from kernels.attention.base import AttentionBackend, AttentionMetadata, AttentionShape, StateT, store_kv
from kernels.gemm import has_native_half_gemm


@dataclass
class PaddedMeta:
    """Requests padded to the longest query and key lengths for one SDPA call."""

    kv_index: torch.Tensor | None  # [B, max_kv] KV locations (padding masked off); None: attend to the new K/V
    q_index: torch.Tensor | None  # [B, max_q] flat token index (padding repeats a valid index); None: no padding
    unpad_index: torch.Tensor | None  # [T] position of each flat token in [B * max_q]; None: no padding
    batch_size: int
    mask: torch.Tensor | None  # [B, 1, max_q, max_kv] bool, True = attend; None when nothing is masked
    causal: bool  # no mask, but queries and keys are the same tokens: SDPA's own causal mask


@dataclass
class DecodeMeta:
    """One query per request: request b's K/V rows for KV head h are `head_rows[b, h]` of the pool
    viewed as [locations * kv_heads, head_dim], so one gather lays them out as [B, kv_heads, max_kv, dim]."""

    head_rows: torch.Tensor  # [B * kv_heads * max_kv] rows of the head-major pool view
    max_kv: int
    bias: torch.Tensor | None  # [B, 1, 1, max_kv] float32: 0 to attend, -inf past the request's length


DecodeT = TypeVar("DecodeT")
"""The decode half's state: `DecodeMeta` for the torch reference, a subclass's own for its own decode kernel."""


@dataclass
class TorchRefMeta(Generic[DecodeT]):
    """A step: its leading one-query requests (decode, the first `num_decode` tokens), then the rest."""

    out_locs: torch.Tensor
    num_decode: int
    decode: DecodeT | None
    padded: PaddedMeta | None


def gather(x: torch.Tensor, index: torch.Tensor | None, batch_size: int) -> torch.Tensor:
    """Rows `index` [B, n] of `x` as [B, n, ...] (index_select copies whole rows: faster than x[index])."""
    rows = x if index is None else x.index_select(0, index.flatten())
    return rows.unflatten(0, (batch_size, -1))


class ReferenceLayout(AttentionBackend[StateT], Generic[StateT, DecodeT]):
    """The reference's layout of a step (`TorchRefMeta`): its leading decode tokens through the subclass's
    `_decode`, the rest padded for one SDPA call. `StateT` is the subclass's whole step state."""

    @abstractmethod
    def _prepare_decode(self, kv_lens: list[int], rows: torch.Tensor, table: torch.Tensor) -> DecodeT:
        """The decode half's state: requests with one query each, over `kv_lens` keys in table rows `rows`."""

    @abstractmethod
    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: DecodeT,
                scale: float) -> torch.Tensor:
        """Attention of the decode half's queries q [B, Hq, D] over the pool."""

    def _prepare_layout(self, batch: AttentionMetadata) -> TorchRefMeta[DecodeT]:
        q_lens, kv_lens = batch.q_lens, batch.kv_lens
        n = 0  # leading requests with one query over cached keys (a mixed batch puts its decodes first)
        while n < len(q_lens) and q_lens[n] == 1 < kv_lens[n]:
            n += 1
        decode = self._prepare_decode(kv_lens[:n], batch.rows[:n], batch.table) if n else None
        padded = self._prepare_padded(q_lens[n:], kv_lens[n:], batch.rows[n:], batch.table) if n < len(q_lens) else None
        return TorchRefMeta(batch.out_locs, n, decode, padded)

    @staticmethod
    def _prepare_padded(q_list: list[int], kv_list: list[int], rows: torch.Tensor, table: torch.Tensor) -> PaddedMeta:
        device = table.device
        q_lens = torch.tensor(q_list, device=device)
        kv_lens = torch.tensor(kv_list, device=device)
        max_q, max_kv = max(q_list), max(kv_list)
        bsz = len(q_list)
        q_starts = torch.cumsum(q_lens, 0) - q_lens
        i = torch.arange(max_q, device=device)
        q_valid = i[None, :] < q_lens[:, None]
        q_index: torch.Tensor | None = torch.where(q_valid, q_starts[:, None] + i[None, :], q_starts[:, None])
        if min(q_list) == max_q:  # equal lengths: the flat axis is already [B, max_q]
            q_index = unpad_index = None
        else:
            unpad_index = (torch.arange(bsz, device=device)[:, None] * max_q + i[None, :])[q_valid]
        if q_list == kv_list:  # fresh prompts: keys are this step's tokens, laid out like the queries
            if q_index is None:
                return PaddedMeta(None, None, None, bsz, None, causal=max_q > 1)
            kv_index, kv_lens, max_kv = None, q_lens, max_q
        else:
            kv_index = table[rows, :max_kv]
        j = torch.arange(max_kv, device=device)
        # Query i of request b sits at absolute position kv_len - q_len + i and sees keys j <= that.
        q_pos = (kv_lens - q_lens)[:, None] + i[None, :]
        mask = (j[None, None, :] <= q_pos[:, :, None]) & q_valid[:, :, None]
        mask |= ~q_valid[:, :, None] & (j[None, None, :] == 0)  # padded rows attend to one key, not none
        return PaddedMeta(kv_index, q_index, unpad_index, bsz, mask[:, None], causal=False)

    def _forward_layout(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, meta: TorchRefMeta[DecodeT], scale: float) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.out_locs)
        n = meta.num_decode
        outs = []
        if meta.decode is not None:
            outs.append(self._decode(q[:n], k_cache, v_cache, meta.decode, scale))
        if meta.padded is not None:
            outs.append(self._padded(q[n:], k[n:], v[n:], k_cache, v_cache, meta.padded, scale))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @staticmethod
    def _padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: PaddedMeta, scale: float) -> torch.Tensor:
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


class TorchRefBackend(ReferenceLayout[TorchRefMeta[DecodeMeta], DecodeMeta]):
    """Gather each request's K/V by its table row; one attention call per layer for the whole step."""

    name = "torch"
    num_kv_heads: int | None = None

    def setup(self, shape: AttentionShape, device: torch.device) -> None:
        self.num_kv_heads = shape.num_kv_heads

    def prepare(self, batch: AttentionMetadata) -> TorchRefMeta[DecodeMeta]:
        return self._prepare_layout(batch)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: TorchRefMeta[DecodeMeta], scale: float) -> torch.Tensor:
        return self._forward_layout(q, k, v, k_cache, v_cache, meta, scale)

    def _prepare_decode(self, kv_lens: list[int], rows: torch.Tensor, table: torch.Tensor) -> DecodeMeta:
        heads, device, max_kv = self.num_kv_heads, table.device, max(kv_lens)
        if heads is None:
            raise RuntimeError("TorchRefBackend.setup() must run before the first step")
        locs = table[rows, :max_kv]
        head_rows = (locs[:, None, :] * heads + torch.arange(heads, device=device)[None, :, None]).flatten()
        bias = None
        if min(kv_lens) != max_kv:
            past_end = torch.arange(max_kv, device=device)[None, :] >= torch.tensor(kv_lens, device=device)[:, None]
            bias = torch.zeros(past_end.shape, device=device).masked_fill_(past_end, float("-inf"))[:, None, None]
        return DecodeMeta(head_rows, max_kv, bias)

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
