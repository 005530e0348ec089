"""Rounding to the model dtype inside a fused kernel, where transformers' eager ops round.

A fused kernel computes in fp32, but wherever the eager model stores an intermediate in bf16/fp16 (a
residual sum, a normalised row before its weight, each RoPE product) the kernel must round it the
same way, or greedy output drifts from transformers. fp16 rounds by its cast. bf16 rounds its bits to
nearest-even by hand: compiled Triton's cast rounds the same way, but the interpreter truncates, and
one code path keeps the kernels exact, and testable, on both.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 `x` rounded to nearest-even in `dtype` (fp32, fp16 or bf16), returned as fp32 (so a store in
    `dtype` is exact)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        out = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)  # a NaN's low bits could carry into inf
    elif dtype == tl.float16:
        out = x.to(tl.float16).to(tl.float32)
    else:
        out = x
    return out
