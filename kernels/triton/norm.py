"""RMSNorm with the residual add before it, in one pass over each row (the GPU path's layer norms).

Eager, a residual add and the RMSNorm after it are about six kernels (add, square, mean, rsqrt, two
multiplies), each reading or writing a whole [tokens, hidden] tensor. Here one program per token reads
its row and its residual once and writes their sum (the next residual) and the normalised row. It
rounds where transformers' RMSNorm does: the sum in the model dtype, the row normalised in fp32 and
rounded to the model dtype before the weight multiplies it, and the product again (Gemma's norm rounds
once, after its fp32 weight: `round_normed` off).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.rounding import round_to


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, eps, size, stride_x, stride_r,
                         stride_o, stride_s, HAS_RESIDUAL: tl.constexpr, ROUND_NORMED: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = round_to(x + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32), dtype)
        tl.store(sum_ptr + row * stride_s + cols, x.to(dtype), mask=mask)
    inv_rms = 1.0 / tl.sqrt_rn(tl.sum(x * x, 0) / size + eps)
    normed = x * inv_rms
    if ROUND_NORMED:
        normed = round_to(normed, dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, round_to(weight * normed, dtype).to(dtype), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, round_normed: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x + residual) and the sum x + residual, both [T, hidden] in x's dtype (rows of unit column
    stride; weight [hidden], in x's dtype or float32). Without a residual (the first layer's input norm) the sum
    is x."""
    tokens, size = x.shape
    out = x.new_empty(tokens, size)
    total = x if residual is None else x.new_empty(tokens, size)
    if tokens == 0:
        return out, total
    block = triton.next_power_of_2(size)
    r = x if residual is None else residual  # never read without a residual
    _add_rms_norm_kernel[(tokens,)](x, r, weight, out, total, eps, size, x.stride(0), r.stride(0), out.stride(0),
                                    total.stride(0), HAS_RESIDUAL=residual is not None, ROUND_NORMED=round_normed,
                                    BLOCK=block,
                                    num_warps=min(max(block // 256, 1), 8), enable_fp_fusion=False)
    return out, total
