"""Scatter this step's new K/V rows into their KV locations of the per-layer pool."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, locs_ptr, row_size, BLOCK: tl.constexpr):
    """One program per new token: copy its [Hkv * D] K and V rows to `locs[token]`."""
    token = tl.program_id(0)
    loc = tl.load(locs_ptr + token).to(tl.int64)
    src = token.to(tl.int64) * row_size
    dst = loc * row_size
    for start in range(0, row_size, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < row_size
        tl.store(k_cache_ptr + dst + offs, tl.load(k_ptr + src + offs, mask=mask), mask=mask)
        tl.store(v_cache_ptr + dst + offs, tl.load(v_ptr + src + offs, mask=mask), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             out_locs: torch.Tensor) -> None:
    """k, v: [T, Hkv, D] (contiguous); caches: [locations, Hkv, D] (contiguous); out_locs: [T] int."""
    tokens = k.shape[0]
    if tokens == 0:
        return
    row_size = k.shape[1] * k.shape[2]
    block = min(triton.next_power_of_2(row_size), 1024)
    _store_kv_kernel[(tokens,)](k.contiguous(), v.contiguous(), k_cache, v_cache, out_locs, row_size, BLOCK=block)
