"""Extend attention: each request's new tokens attend to its cached prefix and, causally, to each other.

One program handles BLOCK_M consecutive new tokens of one request and one query head. It first walks
the cached prefix through `kv_indices` (every prefix key is visible to every new token), then the new
tokens' own K/V straight from this step's contiguous k/v (key j visible to query i when j <= i), in a
single online softmax. Decode requests are the q_len == 1 case, so one launch serves a mixed batch.
Under a sliding window of W a query at position p sees keys p - W < j <= p only: the walk starts at the
block's first visible key and masks the rest per row. Scores may be capped (Gemma 2's softcap).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.decode import attend_gathered, capped, dot_precision, online_softmax_step


@triton.jit
def _extend_kernel(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, out_ptr, qo_indptr_ptr, kv_indptr_ptr,
                   kv_indices_ptr, sm_scale, window, softcap, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                   stride_vh, stride_ct, stride_ch, stride_ot, stride_oh,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, CAP: tl.constexpr, INT8_BLOCK: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    m_block = tl.program_id(2)
    q_start = tl.load(qo_indptr_ptr + b)
    q_len = tl.load(qo_indptr_ptr + b + 1) - q_start
    if m_block * BLOCK_M < q_len:
        kv_start = tl.load(kv_indptr_ptr + b)
        prefix_len = tl.load(kv_indptr_ptr + b + 1) - kv_start - q_len
        kv_head = h // GROUP
        rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < q_len
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_DIM
        tokens = (q_start + rows).to(tl.int64)
        q = tl.load(q_ptr + tokens[:, None] * stride_qt + h * stride_qh + d[None, :],
                    mask=row_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        # Row r (position prefix_len + r) sees keys from `low` on: 0, or its window's first.
        low = tl.where(window > 0, prefix_len + rows - window + 1, 0)
        first = tl.maximum(tl.where(window > 0, prefix_len + m_block * BLOCK_M - window + 1, 0), 0)

        # Cached prefix, gathered by KV location, from the block's first visible key.
        m_i, l_i, acc = attend_gathered(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, kv_indices_ptr, kv_start,
                                        tl.minimum(first, prefix_len), prefix_len, low, kv_head, stride_ct, stride_ch,
                                        sm_scale, softcap, d, d_mask, BLOCK_N, PRECISION, CAP, HEAD_DIM, INT8_BLOCK)

        # This step's tokens, causal; keys past the block's last row are invisible to all its rows.
        new_end = tl.minimum(q_len, (m_block + 1) * BLOCK_M)
        for n0 in range(tl.maximum(first - prefix_len, 0) // BLOCK_N * BLOCK_N, new_end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_mask = n < q_len
            keys = (q_start + n).to(tl.int64)
            tile_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(k_ptr + keys[:, None] * stride_kt + kv_head * stride_kh + d[None, :], mask=tile_mask,
                        other=0.0).to(tl.float32)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale
            if CAP:
                qk = capped(qk, softcap)
            visible = n_mask[None, :] & (n[None, :] <= rows[:, None]) & (prefix_len + n[None, :] >= low[:, None])
            qk = tl.where(visible, qk, -float("inf"))
            v = tl.load(v_ptr + keys[:, None] * stride_vt + kv_head * stride_vh + d[None, :], mask=tile_mask,
                        other=0.0).to(tl.float32)
            m_i, l_i, acc = online_softmax_step(qk, m_i, l_i, acc, v, PRECISION)

        tl.store(out_ptr + tokens[:, None] * stride_ot + h * stride_oh + d[None, :],
                 (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                     kv_indices: torch.Tensor, max_q_len: int, sm_scale: float, block_m: int = 16,
                     block_n: int = 16, window: int | None = None, softcap: float | None = None,
                     int8_block: int = 0) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] this step's tokens; caches [locations, Hkv, D] (int8 pages, `int8_block` > 0:
    [locations, Hkv, row bytes], as decode_attention reads them); int32 indptrs/indices.

    Request b's queries are q[qo_indptr[b]:qo_indptr[b+1]]; its KV positions are
    kv_indices[kv_indptr[b]:kv_indptr[b+1]], of which the last q_len are this step's tokens (read from
    k/v, so they need not be stored first). `window`: a query sees the last `window` positions only; `softcap`
    caps the scores. Returns [T, Hq, D] in q's dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    batch = qo_indptr.numel() - 1
    group = num_heads // k_cache.shape[1]
    grid = (batch, num_heads, triton.cdiv(max_q_len, block_m))
    _extend_kernel[grid](q, k, v, k_cache, v_cache, out, qo_indptr, kv_indptr, kv_indices, sm_scale, window or 0,
                         softcap or 0.0, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                         k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
                         GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
                         BLOCK_D=max(16, triton.next_power_of_2(head_dim)), PRECISION=dot_precision(q.dtype),
                         CAP=softcap is not None, INT8_BLOCK=int8_block)
    return out
