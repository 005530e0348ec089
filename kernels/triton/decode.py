"""Decode attention (one query token per request) with split-KV in two stages.

Stage 1 splits each request's KV range into up to `num_splits` slices and runs an online softmax over
each slice independently, writing a partial output and its log-sum-exp; stage 2 merges the slices by
LSE. Splitting gives long requests more parallelism than one program per (request, head) would.
Two stage-1 variants: one program per query head (plain reductions, any group size), and a grouped
one where a program serves a block of query heads that share a KV head, so the scores are a `tl.dot`
(tiles padded to 16 heads, since `tl.dot` needs every dimension >= 16).

The grid depends only on the batch size, head counts and `num_splits`, never on sequence lengths, so
the launch can be captured in a CUDA graph; each request's slice length is computed in the kernel as
max(ceil(keys / num_splits), min_split_len), over the keys it sees: all kv_len of them, or under a sliding
`window` the last `window`. Scores may be capped (`softcap` > 0: softcap * tanh(s / softcap), Gemma 2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP_BLOCK_H = 16  # query heads per grouped program: tl.dot's minimum tile dimension


@triton.jit
def window_start(kv_len, window):
    """The first key a request's last query sees: 0, or under a sliding window (window > 0) kv_len - window."""
    return tl.where(window > 0, tl.maximum(kv_len - window, 0), 0)


@triton.jit
def _split_bounds(kv_len, split, min_split_len, window, NUM_SPLITS: tl.constexpr):
    """[start, end) of slice `split` of the keys a request with `kv_len` keys sees (empty when start >= kv_len)."""
    begin = window_start(kv_len, window)
    split_len = tl.maximum(tl.cdiv(kv_len - begin, NUM_SPLITS), min_split_len)
    start = begin + split * split_len
    return start, tl.minimum(start + split_len, kv_len)


@triton.jit
def capped(qk, softcap):
    """softcap * tanh(qk / softcap), tanh from exp (stable for any magnitude)."""
    x = qk / softcap
    t = tl.exp(-2.0 * tl.abs(x))
    th = (1.0 - t) / (1.0 + t)
    return softcap * tl.where(x >= 0, th, -th)


@triton.jit
def online_softmax_step(qk, m_i, l_i, acc, v, PRECISION: tl.constexpr):
    """Fold one tile of scores qk [rows, keys] (masked ones -inf) and its values v [keys, D] into the running max,
    sum and accumulator; a row whose keys so far are all masked stays at max -inf, sum 0."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(qk - m_safe[:, None])
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def gathered_tile(kv_indices_ptr, kv_start, n0, end, kv_head, stride_ct, stride_ch, d, d_mask, BLOCK_N: tl.constexpr):
    """Where keys `n0..n0+BLOCK_N` (those before `end`) of one request and KV head lie in the pool, read
    through its `kv_indices` locations: (key mask, element offsets [BLOCK_N, BLOCK_D], tile mask)."""
    n = n0 + tl.arange(0, BLOCK_N)
    n_mask = n < end
    locs = tl.load(kv_indices_ptr + kv_start + n, mask=n_mask, other=0).to(tl.int64)
    offs = locs[:, None] * stride_ct + kv_head * stride_ch + d[None, :]
    return n_mask, offs, n_mask[:, None] & d_mask[None, :]


@triton.jit
def load_kv(cache_ptr, offs, tile_mask, d, HEAD_DIM: tl.constexpr, INT8_BLOCK: tl.constexpr):
    """A tile of K or V rows from the pool as float32. With INT8_BLOCK > 0 the pool holds int8 rows (byte offsets):
    head_dim int8 values, then a float32 scale per INT8_BLOCK of them (kernels/attention/int8_kv.py), and a value
    reads as q * s, as the CPU kernels and the torch reference read it."""
    x = tl.load(cache_ptr + offs, mask=tile_mask, other=0).to(tl.float32)
    if INT8_BLOCK > 0:
        scale_at = cache_ptr + offs + (HEAD_DIM - d[None, :] + (d[None, :] // INT8_BLOCK) * 4)
        x = x * tl.load(scale_at.to(tl.pointer_type(tl.float32)), mask=tile_mask, other=0.0)
    return x


@triton.jit
def attend_gathered(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, kv_indices_ptr, kv_start, start, end, low, kv_head,
                    stride_ct, stride_ch, sm_scale, softcap, d, d_mask, BLOCK_N: tl.constexpr,
                    PRECISION: tl.constexpr, CAP: tl.constexpr, HEAD_DIM: tl.constexpr, INT8_BLOCK: tl.constexpr):
    """One online-softmax pass of a query block [rows, BLOCK_D] over keys `start..end` of one request, read
    from the pool through its `kv_indices` locations, row r seeing keys >= low[r] (its sliding window's first;
    0 without one); returns the updated running max, sum and accumulator. Shared by grouped decode and by
    extend's cached prefix. `CAP`: scores capped by `softcap`; `INT8_BLOCK`: int8 pages (`load_kv`)."""
    for n0 in range(start, end, BLOCK_N):
        n_mask, offs, tile_mask = gathered_tile(kv_indices_ptr, kv_start, n0, end, kv_head, stride_ct, stride_ch, d,
                                                d_mask, BLOCK_N)
        k = load_kv(k_cache_ptr, offs, tile_mask, d, HEAD_DIM, INT8_BLOCK)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale
        if CAP:
            qk = capped(qk, softcap)
        n = n0 + tl.arange(0, BLOCK_N)
        qk = tl.where(n_mask[None, :] & (n[None, :] >= low[:, None]), qk, -float("inf"))
        v = load_kv(v_cache_ptr, offs, tile_mask, d, HEAD_DIM, INT8_BLOCK)
        m_i, l_i, acc = online_softmax_step(qk, m_i, l_i, acc, v, PRECISION)
    return m_i, l_i, acc


@triton.jit
def _decode_stage1(q_ptr, k_cache_ptr, v_cache_ptr, kv_indptr_ptr, kv_indices_ptr, part_out_ptr, part_lse_ptr,
                   sm_scale, min_split_len, window, softcap, stride_qt, stride_qh, stride_ct, stride_ch,
                   stride_pb, stride_ph, stride_ps,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, CAP: tl.constexpr, INT8_BLOCK: tl.constexpr):
    """Program (request b, query head h, split): partial attention over one KV slice."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = h // GROUP
    kv_start = tl.load(kv_indptr_ptr + b)
    kv_len = tl.load(kv_indptr_ptr + b + 1) - kv_start
    start, end = _split_bounds(kv_len, split, min_split_len, window, NUM_SPLITS)
    if end > start:
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_DIM
        q = tl.load(q_ptr + b * stride_qt + h * stride_qh + d, mask=d_mask, other=0.0).to(tl.float32)
        m_i = -float("inf")
        l_i = 0.0
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            n_mask, offs, tile_mask = gathered_tile(kv_indices_ptr, kv_start, n0, end, kv_head, stride_ct, stride_ch,
                                                    d, d_mask, BLOCK_N)
            k = load_kv(k_cache_ptr, offs, tile_mask, d, HEAD_DIM, INT8_BLOCK)
            qk = tl.sum(q[None, :] * k, 1) * sm_scale
            if CAP:
                qk = capped(qk, softcap)
            qk = tl.where(n_mask, qk, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(qk - m_new)
            v = load_kv(v_cache_ptr, offs, tile_mask, d, HEAD_DIM, INT8_BLOCK)
            acc = acc * alpha + tl.sum(p[:, None] * v, 0)
            l_i = l_i * alpha + tl.sum(p, 0)
            m_i = m_new
        base = b * stride_pb + h * stride_ph + split * stride_ps
        tl.store(part_out_ptr + base * HEAD_DIM + d, acc / l_i, mask=d_mask)
        tl.store(part_lse_ptr + base, m_i + tl.log(l_i))


@triton.jit
def _decode_grouped_stage1(q_ptr, k_cache_ptr, v_cache_ptr, kv_indptr_ptr, kv_indices_ptr, part_out_ptr,
                           part_lse_ptr, sm_scale, min_split_len, window, softcap, stride_qt, stride_qh, stride_ct,
                           stride_ch, stride_pb, stride_ph, stride_ps,
                           GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, HEAD_DIM: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                           NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, CAP: tl.constexpr,
                           INT8_BLOCK: tl.constexpr):
    """Program (request b, block of BLOCK_H query heads of one KV head, split): each K/V tile is loaded
    once for the whole block and both products are `tl.dot`s."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    in_group = (tl.program_id(1) % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = in_group < GROUP
    heads = kv_head * GROUP + in_group
    split = tl.program_id(2)
    kv_start = tl.load(kv_indptr_ptr + b)
    kv_len = tl.load(kv_indptr_ptr + b + 1) - kv_start
    start, end = _split_bounds(kv_len, split, min_split_len, window, NUM_SPLITS)
    if end > start:
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_DIM
        q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=h_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        m_i = tl.full([BLOCK_H], -float("inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        low = tl.zeros([BLOCK_H], dtype=tl.int32)  # the split's keys are all in the window already
        m_i, l_i, acc = attend_gathered(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, kv_indices_ptr, kv_start, start,
                                        end, low, kv_head, stride_ct, stride_ch, sm_scale, softcap, d, d_mask, BLOCK_N,
                                        PRECISION, CAP, HEAD_DIM, INT8_BLOCK)
        base = b * stride_pb + heads * stride_ph + split * stride_ps
        tl.store(part_out_ptr + base[:, None] * HEAD_DIM + d[None, :], acc / l_i[:, None],
                 mask=h_mask[:, None] & d_mask[None, :])
        tl.store(part_lse_ptr + base, m_i + tl.log(l_i), mask=h_mask)


@triton.jit
def _decode_stage2(part_out_ptr, part_lse_ptr, kv_indptr_ptr, out_ptr, min_split_len, window, stride_ot, stride_oh,
                   stride_pb, stride_ph, stride_ps,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Program (request b, query head h): merge the non-empty slices' partial outputs by their LSE."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    kv_len = tl.load(kv_indptr_ptr + b + 1) - tl.load(kv_indptr_ptr + b)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for split in range(NUM_SPLITS):
        start, end = _split_bounds(kv_len, split, min_split_len, window, NUM_SPLITS)
        if end > start:
            base = b * stride_pb + h * stride_ph + split * stride_ps
            lse = tl.load(part_lse_ptr + base)
            part = tl.load(part_out_ptr + base * HEAD_DIM + d, mask=d_mask, other=0.0)
            m_new = tl.maximum(m_i, lse)
            alpha = tl.exp(m_i - m_new)
            w = tl.exp(lse - m_new)
            acc = acc * alpha + w * part
            l_i = l_i * alpha + w
            m_i = m_new
    tl.store(out_ptr + b * stride_ot + h * stride_oh + d, (acc / l_i).to(out_ptr.dtype.element_ty), mask=d_mask)


def dot_precision(dtype: torch.dtype) -> str:
    """tf32 keeps bf16/fp16 inputs exact (10-bit mantissa) on tensor cores; fp32 models get full ieee."""
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indptr: torch.Tensor,
                     kv_indices: torch.Tensor, sm_scale: float, num_splits: int = 8, min_split_len: int = 64,
                     block_n: int = 32, grouped: bool | None = None, out: torch.Tensor | None = None,
                     partial: tuple[torch.Tensor, torch.Tensor] | None = None, window: int | None = None,
                     softcap: float | None = None, int8_block: int = 0) -> torch.Tensor:
    """q: [B, Hq, D], one token per request; caches: [locations, Hkv, D] (int8 pages, `int8_block` > 0: [locations,
    Hkv, row bytes], a scale per `int8_block` values); kv_indptr [B+1], kv_indices int32.

    `grouped` picks the GQA kernel (default: when several query heads share a KV head). `out` and
    `partial` (fp32 [B, Hq, num_splits, D] and [B, Hq, num_splits]) may be given so a CUDA graph
    replays into fixed buffers. `window`: each request sees its last `window` keys only; `softcap` caps the
    scores. Returns out [B, Hq, D] in q's dtype.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    if grouped is None:
        grouped = group > 1
    if out is None:
        out = torch.empty_like(q)
    if partial is None:
        partial = (torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device),
                   torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device))
    part_out, part_lse = partial
    block_d = max(16, triton.next_power_of_2(head_dim))
    # part_out is addressed as part_lse's flat index * head_dim: both share the [B, Hq, splits] strides.
    pstrides = part_lse.stride()
    win, cap = window or 0, softcap or 0.0
    common = (k_cache, v_cache, kv_indptr, kv_indices, part_out, part_lse, sm_scale, min_split_len, win, cap,
              q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), *pstrides)
    if grouped:
        head_blocks = triton.cdiv(group, GROUP_BLOCK_H)
        _decode_grouped_stage1[(batch, num_kv_heads * head_blocks, num_splits)](
            q, *common, GROUP=group, HEAD_BLOCKS=head_blocks, HEAD_DIM=head_dim, BLOCK_H=GROUP_BLOCK_H,
            BLOCK_D=block_d, BLOCK_N=block_n, NUM_SPLITS=num_splits, PRECISION=dot_precision(q.dtype),
            CAP=softcap is not None, INT8_BLOCK=int8_block)
    else:
        _decode_stage1[(batch, num_heads, num_splits)](
            q, *common, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, NUM_SPLITS=num_splits,
            CAP=softcap is not None, INT8_BLOCK=int8_block)
    _decode_stage2[(batch, num_heads)](part_out, part_lse, kv_indptr, out, min_split_len, win, out.stride(0),
                                       out.stride(1), *pstrides, HEAD_DIM=head_dim, BLOCK_D=block_d,
                                       NUM_SPLITS=num_splits)
    return out
