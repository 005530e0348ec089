"""RoPE on q and k, Qwen3's per-head q/k RMSNorm before it, and the KV store, in one kernel.

After the fused q/k/v projection (its bias included), eager attention prep is a per-head norm (about
five kernels each for q and k), RoPE (four each) and the store of k and v into the paged pool: a
dozen launches, each a pass over the heads. Here one program per (token, q or k head) reads the head
once, normalises it (when the model has q/k norms), rotates it in place in the projection's output
(neox style: the two halves of the head pair up) and, for a k head, writes it and the matching v head
to the token's KV location in the pool, so the attention backend attends without storing
(`TritonBackend.attend`). Rounded where transformers rounds: the norm as its RMSNorm, and each RoPE
product and their sum in the model dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.rounding import round_to


@triton.jit
def _rope_store_kernel(qkv_ptr, positions_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr, k_cache_ptr, v_cache_ptr,
                       locs_ptr, eps, stride_t, stride_table, stride_pos, stride_ct, stride_ch, STORE: tl.constexpr,
                       NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       QK_NORM: tl.constexpr, ROUND_NORMED: tl.constexpr, BLOCK: tl.constexpr):
    """Program (token, head): heads 0..NUM_HEADS-1 are q's, the next NUM_KV_HEADS k's (q's and k's heads lie
    back to back in a row of qkv, so head h starts at h * HEAD_DIM either way); `STORE`: k and v to the pool too."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dtype = qkv_ptr.dtype.element_ty
    half: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, BLOCK)
    mask = d < half
    x_ptr = qkv_ptr + token * stride_t + head * HEAD_DIM
    x1 = tl.load(x_ptr + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + half + d, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        if head < NUM_HEADS:
            w1 = tl.load(q_weight_ptr + d, mask=mask, other=0.0).to(tl.float32)
            w2 = tl.load(q_weight_ptr + half + d, mask=mask, other=0.0).to(tl.float32)
        else:
            w1 = tl.load(k_weight_ptr + d, mask=mask, other=0.0).to(tl.float32)
            w2 = tl.load(k_weight_ptr + half + d, mask=mask, other=0.0).to(tl.float32)
        inv_rms = 1.0 / tl.sqrt_rn((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / HEAD_DIM + eps)
        if ROUND_NORMED:
            x1 = round_to(w1 * round_to(x1 * inv_rms, dtype), dtype)
            x2 = round_to(w2 * round_to(x2 * inv_rms, dtype), dtype)
        else:  # Gemma 3's norm: one rounding, after its float32 weight
            x1 = round_to(w1 * (x1 * inv_rms), dtype)
            x2 = round_to(w2 * (x2 * inv_rms), dtype)
    # The table holds cos and the signed sin ([-sin, sin] by halves), so both halves rotate as x * cos + x_other * sin.
    cos_ptr = cos_sin_ptr + tl.load(positions_ptr + token).to(tl.int64) * stride_pos
    sin_ptr = cos_ptr + stride_table
    cos1 = tl.load(cos_ptr + d, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + half + d, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + d, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + half + d, mask=mask, other=0.0).to(tl.float32)
    out1 = round_to(round_to(x1 * cos1, dtype) + round_to(x2 * sin1, dtype), dtype).to(dtype)
    out2 = round_to(round_to(x2 * cos2, dtype) + round_to(x1 * sin2, dtype), dtype).to(dtype)
    tl.store(x_ptr + d, out1, mask=mask)
    tl.store(x_ptr + half + d, out2, mask=mask)
    if STORE and head >= NUM_HEADS:  # a k head: it and its v head go to the token's KV location in the pool
        kv_head = head - NUM_HEADS
        dst = tl.load(locs_ptr + token).to(tl.int64) * stride_ct + kv_head * stride_ch
        tl.store(k_cache_ptr + dst + d, out1, mask=mask)
        tl.store(k_cache_ptr + dst + half + d, out2, mask=mask)
        v_ptr = x_ptr + NUM_KV_HEADS * HEAD_DIM
        tl.store(v_cache_ptr + dst + d, tl.load(v_ptr + d, mask=mask), mask=mask)
        tl.store(v_cache_ptr + dst + half + d, tl.load(v_ptr + half + d, mask=mask), mask=mask)


def rope_store_kv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, positions: torch.Tensor,
                  cos_sin: torch.Tensor, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None,
                  out_locs: torch.Tensor,
                  qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None, eps: float = 1e-6,
                  round_normed: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prepare a step's q/k/v for attention, in place.

    qkv: [T, (Hq + 2 Hkv) * D], q's heads then k's then v's (the fused projection's output; unit column
    stride); positions: [T]; cos_sin: [2, positions, D], cos and the signed sin (see the model's
    `apply_rope`) in qkv's dtype; caches: [locations, Hkv, D] (unit stride along D); out_locs: [T], each
    token's KV location in the pool. `qk_norm` are the (q, k) RMSNorm weights [D] (Qwen3; Gemma 3's 1 + weight in
    float32, with `round_normed` off: one rounding) and `eps` their epsilon.
    q and k are rotated in qkv (after the norm when given); k and v are written to the pool at `out_locs` (not
    with no caches: int8 pages, which the backend quantizes as it stores).
    Returns q [T, Hq, D], k and v [T, Hkv, D], views of qkv.
    """
    tokens = qkv.shape[0]
    head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    views = (qkv[:, :q_size].view(tokens, num_heads, head_dim),
             qkv[:, q_size : q_size + kv_size].view(tokens, num_kv_heads, head_dim),
             qkv[:, q_size + kv_size :].view(tokens, num_kv_heads, head_dim))
    if tokens == 0:
        return views
    q_weight, k_weight = qk_norm if qk_norm is not None else (qkv, qkv)  # never read without the norm
    store = k_cache is not None and v_cache is not None
    k_pool = k_cache if k_cache is not None else views[1]  # never written without the caches
    v_pool = v_cache if v_cache is not None else views[2]
    _rope_store_kernel[(tokens, num_heads + num_kv_heads)](
        qkv, positions, cos_sin, q_weight, k_weight, k_pool, v_pool, out_locs, eps, qkv.stride(0),
        cos_sin.stride(0), cos_sin.stride(1), k_pool.stride(0), k_pool.stride(1), STORE=store, NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, QK_NORM=qk_norm is not None, ROUND_NORMED=round_normed,
        BLOCK=triton.next_power_of_2(head_dim // 2), num_warps=1, enable_fp_fusion=False)
    return views
