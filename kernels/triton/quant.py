"""Weight-only products on the GPU with weights in GGML's block formats, in their lossless int8 form.

Every format comes down to w = scale * q + offset per 16 values (kernels/quant.py, `DeviceBlockWeight`), so
one kernel serves them all: a program computes a [BLOCK_M, BLOCK_N] tile of x W^T, loading for each step
along k a tile of x, the same columns of int8 q, and their scales and offsets (one per 16 values, gathered),
dequantizing in registers (in float32) and accumulating a `tl.dot` in float32 (ieee for float32
activations, tf32 for half precision, as the attention kernels do). The weights cross the memory bus as
8-bit integers plus a quarter of that in scales: 12 bits a value where bf16 takes 16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant import DeviceBlockWeight


@triton.jit
def _weight_only_kernel(x_ptr, q_ptr, scale_ptr, offset_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_qn,
                        stride_sn, stride_om, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """Program (block of rows of x, block of output columns)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        w_mask = col_ok[:, None] & k_ok[None, :]
        w_rows = cols[:, None].to(tl.int64)
        q = tl.load(q_ptr + w_rows * stride_qn + ks[None, :], mask=w_mask, other=0).to(tl.float32)
        groups = ks[None, :] // 16
        scale = tl.load(scale_ptr + w_rows * stride_sn + groups, mask=w_mask, other=0.0)
        offset = tl.load(offset_ptr + w_rows * stride_sn + groups, mask=w_mask, other=0.0)
        acc += tl.dot(x, tl.trans(scale * q + offset), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def weight_only_linear(x: torch.Tensor, w: DeviceBlockWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ bias) in x's dtype, x [M, K] with unit column stride, W dequantized tile by tile inside the
    product."""
    m, k = x.shape
    if k != w.in_features or x.stride(1) != 1:
        raise ValueError(f"weight_only_linear needs [M, {w.in_features}] with unit column stride; got {tuple(x.shape)}")
    n = w.out_features
    out = x.new_empty(m, n)
    if m == 0:
        return out
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    block_n, block_k = 64, 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _weight_only_kernel[grid](x, w.q, w.scale, w.offset, bias if bias is not None else out, out, m, n, k,
                              x.stride(0), w.q.stride(0), w.scale.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                              BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                              PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4)
    return out
