"""Reference attention in plain torch: gather each request's K/V from the pool and attend.

Exact and portable; it is the CPU path and the oracle the GPU kernels are tested against. A step of
fresh prompts (nothing cached before it) attends over its own new K/V, so it gathers nothing from the
pool, and needs no mask when every prompt has the same length. Requests with one query each (decode,
which a mixed step puts first) gather K/V head-major and attend with two batched matmuls and a
softmax: on the CPU that is about twice as fast as SDPA's flash kernel, which is built for many
queries per request. The rest of a step is padded to its longest request for one SDPA call. On a
CPU without native bf16/fp16 arithmetic, attention runs in float32 (SDPA's half-precision CPU kernel
is ~10x slower there). A layer with a sliding window gathers a decode request's last `window` keys only and
masks the padded part to the window (each built once per step and window); capped scores (Gemma 2), which
SDPA cannot do, take a plain softmax of the capped products.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, replace
from typing import Generic, TypeVar, cast

import torch
import torch.nn.functional as F

from kernels.attention.base import AttentionBackend, AttentionMetadata, AttentionShape, StateT, store_kv
from kernels.attention.int8_kv import dequantize_rows, is_int8, quantize_keys, quantize_rows, rotate_queries
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
    q_pos: torch.Tensor  # [B, max_q] each query's position (keys are positions 0..max_kv-1)
    q_valid: torch.Tensor  # [B, max_q] False on padding rows
    max_kv: int

    def windowed(self, window: int) -> PaddedMeta:
        """The same step for layers that attend to the last `window` positions only (key j > position - window)."""
        j = torch.arange(self.max_kv, device=self.q_pos.device)
        causal = j[None, None, :] <= self.q_pos[:, :, None]
        mask = causal & (j[None, None, :] > self.q_pos[:, :, None] - window) & self.q_valid[:, :, None]
        mask |= ~self.q_valid[:, :, None] & (j[None, None, :] == 0)  # padded rows attend to one key, not none
        return replace(self, mask=mask[:, None], causal=False)


@dataclass
class DecodeMeta:
    """One query per request: request b's K/V rows for KV head h are `head_rows[b, h]` of the pool
    viewed as [locations * kv_heads, head_dim], so one gather lays them out as [B, kv_heads, max_kv, dim]
    (under a window: the request's last `max_kv` positions)."""

    head_rows: torch.Tensor  # [B * kv_heads * max_kv] rows of the head-major pool view
    max_kv: int
    bias: torch.Tensor | None  # [B, 1, 1, max_kv] float32: 0 to attend, -inf past the request's length


DecodeT = TypeVar("DecodeT")
"""The decode half's state: `DecodeMeta` for the torch reference, a subclass's own for its own decode kernel."""


@dataclass
class TorchRefMeta(Generic[DecodeT]):
    """A step: its leading one-query requests (decode, the first `num_decode` tokens), then the rest. Each half's
    state is kept per window (None: full attention), the first layer of each window building it."""

    out_locs: torch.Tensor
    num_decode: int
    decode: dict[int | None, DecodeT]
    padded: dict[int | None, PaddedMeta]
    batch: AttentionMetadata


def gather(x: torch.Tensor, index: torch.Tensor | None, batch_size: int) -> torch.Tensor:
    """Rows `index` [B, n] of `x` as [B, n, ...] (index_select copies whole rows: faster than x[index])."""
    rows = x if index is None else x.index_select(0, index.flatten())
    return rows.unflatten(0, (batch_size, -1))


class ReferenceLayout(AttentionBackend[StateT], Generic[StateT, DecodeT]):
    """The reference's layout of a step (`TorchRefMeta`): its leading decode tokens through the subclass's
    `_decode`, the rest padded for one SDPA call (a manual softmax where scores are capped). `StateT` is the
    subclass's whole step state."""

    @abstractmethod
    def _prepare_decode(self, kv_lens: list[int], rows: torch.Tensor, table: torch.Tensor,
                        window: int | None) -> DecodeT:
        """The decode half's state: requests with one query each, over `kv_lens` keys in table rows `rows`, of which
        they see the last `window` (None: all)."""

    @abstractmethod
    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: DecodeT,
                scale: float, softcap: float | None) -> torch.Tensor:
        """Attention of the decode half's queries q [B, Hq, D] over the pool."""

    def _prepare_layout(self, batch: AttentionMetadata) -> TorchRefMeta[DecodeT]:
        q_lens, kv_lens = batch.q_lens, batch.kv_lens
        n = 0  # leading requests with one query over cached keys (a mixed batch puts its decodes first)
        while n < len(q_lens) and q_lens[n] == 1 < kv_lens[n]:
            n += 1
        decode: dict[int | None, DecodeT] = {}
        padded: dict[int | None, PaddedMeta] = {}
        if n:
            decode[None] = self._prepare_decode(kv_lens[:n], batch.rows[:n], batch.table, None)
        if n < len(q_lens):
            padded[None] = self._prepare_padded(q_lens[n:], kv_lens[n:], batch.rows[n:], batch.table)
        return TorchRefMeta(batch.out_locs, n, decode, padded, batch)

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
        # Query i of request b sits at absolute position kv_len - q_len + i and sees keys j <= that.
        q_pos = (kv_lens - q_lens)[:, None] + i[None, :]
        q_index: torch.Tensor | None = torch.where(q_valid, q_starts[:, None] + i[None, :], q_starts[:, None])
        if min(q_list) == max_q:  # equal lengths: the flat axis is already [B, max_q]
            q_index = unpad_index = None
        else:
            unpad_index = (torch.arange(bsz, device=device)[:, None] * max_q + i[None, :])[q_valid]
        kv_index = None if q_list == kv_list else table[rows, :max_kv]  # fresh prompts: the step's own K/V
        if q_list == kv_list and q_index is None:
            return PaddedMeta(None, None, None, bsz, None, max_q > 1, q_pos, q_valid, max_kv)
        j = torch.arange(max_kv, device=device)
        mask = (j[None, None, :] <= q_pos[:, :, None]) & q_valid[:, :, None]
        mask |= ~q_valid[:, :, None] & (j[None, None, :] == 0)  # padded rows attend to one key, not none
        return PaddedMeta(kv_index, q_index, unpad_index, bsz, mask[:, None], False, q_pos, q_valid, max_kv)

    def _decode_part(self, meta: TorchRefMeta[DecodeT], window: int | None) -> DecodeT:
        if window not in meta.decode:
            n, batch = meta.num_decode, meta.batch
            meta.decode[window] = self._prepare_decode(batch.kv_lens[:n], batch.rows[:n], batch.table, window)
        return meta.decode[window]

    @staticmethod
    def _padded_part(meta: TorchRefMeta[DecodeT], window: int | None) -> PaddedMeta:
        if window not in meta.padded:
            meta.padded[window] = meta.padded[None].windowed(cast(int, window))
        return meta.padded[window]

    def _forward_layout(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, meta: TorchRefMeta[DecodeT], scale: float, window: int | None,
                        softcap: float | None) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.out_locs)
        n = meta.num_decode
        outs = []
        if n:
            outs.append(self._decode(q[:n], k_cache, v_cache, self._decode_part(meta, window), scale, softcap))
        if meta.padded:
            outs.append(self._padded(q[n:], k[n:], v[n:], k_cache, v_cache, self._padded_part(meta, window), scale,
                                     softcap))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @staticmethod
    def _padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: PaddedMeta, scale: float, softcap: float | None) -> torch.Tensor:
        # int8 pages are read as float32 values (q * s), as the C kernel reads them: the product runs in float32, the
        # queries turned as the stored keys are
        dtype, int8 = q.dtype, is_int8(k_cache)
        if int8:
            q = rotate_queries(q)
        if meta.kv_index is not None:
            kp, vp = gather(k_cache, meta.kv_index, meta.batch_size), gather(v_cache, meta.kv_index, meta.batch_size)
            if int8:
                kp, vp = dequantize_rows(kp, q.shape[-1]), dequantize_rows(vp, q.shape[-1])
        else:
            if int8:  # the step's own keys and values as the pool holds them, as every later step reads them
                k, v = dequantize_rows(quantize_keys(k), k.shape[-1]), dequantize_rows(quantize_rows(v), v.shape[-1])
            kp, vp = gather(k, meta.q_index, meta.batch_size), gather(v, meta.q_index, meta.batch_size)
        qp = gather(q, meta.q_index, meta.batch_size)
        if int8 or not has_native_half_gemm(q.device, dtype):
            qp, kp, vp = qp.float(), kp.float(), vp.float()
        qt, kt, vt = qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2)
        if softcap is None:
            out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=meta.mask, is_causal=meta.causal, scale=scale,
                                                 enable_gqa=qp.shape[2] != kp.shape[2])
        else:
            out = capped_attention(qt, kt, vt, meta.mask, meta.causal, scale, softcap)
        bsz, heads, max_q, dim = out.shape
        out = out.transpose(1, 2).reshape(bsz * max_q, heads, dim).to(dtype)
        return out if meta.unpad_index is None else out[meta.unpad_index]


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
                     scale: float, softcap: float) -> torch.Tensor:
    """softmax(softcap * tanh(q k^T * scale / softcap), masked) v over [B, heads, len, dim] (KV heads repeated for
    their query heads), the softmax in float32: Gemma 2's eager attention, which SDPA cannot do."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * scale / softcap) * softcap
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)


class TorchRefBackend(ReferenceLayout[TorchRefMeta[DecodeMeta], DecodeMeta]):
    """Gather each request's K/V by its table row; one attention call per layer for the whole step."""

    name = "torch"
    num_kv_heads: int | None = None

    def setup(self, shape: AttentionShape, device: torch.device) -> None:
        self.num_kv_heads = shape.num_kv_heads

    def prepare(self, batch: AttentionMetadata) -> TorchRefMeta[DecodeMeta]:
        return self._prepare_layout(batch)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: TorchRefMeta[DecodeMeta], scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        return self._forward_layout(q, k, v, k_cache, v_cache, meta, scale, window, softcap)

    def _prepare_decode(self, kv_lens: list[int], rows: torch.Tensor, table: torch.Tensor,
                        window: int | None) -> DecodeMeta:
        """Positions 0..max_kv-1 of each request, masked past its length; under a window each request's last
        min(window, max_kv) positions, masked before its first."""
        heads, device, max_kv = self.num_kv_heads, table.device, max(kv_lens)
        if heads is None:
            raise RuntimeError("TorchRefBackend.setup() must run before the first step")
        lens = torch.tensor(kv_lens, device=device)
        if window is None or window >= max_kv:
            positions = torch.arange(max_kv, device=device)[None, :].expand(len(kv_lens), -1)
            outside = positions >= lens[:, None]
            biased = min(kv_lens) != max_kv
        else:
            max_kv = window
            positions = lens[:, None] - window + torch.arange(window, device=device)[None, :]
            outside = positions < 0
            biased = min(kv_lens) < window
        locs = table[rows[:, None], positions.clamp(min=0)]
        head_rows = (locs[:, None, :] * heads + torch.arange(heads, device=device)[None, :, None]).flatten()
        bias = None
        if biased:
            bias = torch.zeros(outside.shape, device=device).masked_fill_(outside, float("-inf"))[:, None, None]
        return DecodeMeta(head_rows, max_kv, bias)

    @staticmethod
    def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: DecodeMeta,
                scale: float, softcap: float | None) -> torch.Tensor:
        """softmax(q K^T * scale + bias) V per request and KV head group, in float32 (scores capped with `softcap`)."""
        bsz, num_heads, dim = q.shape
        kv_heads, width = k_cache.shape[1], k_cache.shape[2]
        shape = (bsz, kv_heads, meta.max_kv, width)
        kp = k_cache.view(-1, width).index_select(0, meta.head_rows).view(shape)
        vp = v_cache.view(-1, width).index_select(0, meta.head_rows).view(shape)
        if is_int8(k_cache):  # the keys stored rotated: the queries turned alike
            kp, vp, q = dequantize_rows(kp, dim), dequantize_rows(vp, dim), rotate_queries(q)
        else:
            kp, vp = kp.float(), vp.float()
        qg = q.float().reshape(bsz, kv_heads, num_heads // kv_heads, dim) * scale
        scores = torch.matmul(qg, kp.transpose(-1, -2))  # [B, kv_heads, group, max_kv]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if meta.bias is not None:
            scores += meta.bias
        out = torch.matmul(torch.softmax(scores, dim=-1), vp)
        return out.view(bsz, num_heads, dim).to(q.dtype)
