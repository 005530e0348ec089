"""The MLP's SiLU(gate) * up in one pass over the gate/up projection's output.

Eager, the activation is a chunk, a SiLU and a multiply: two kernels, and a [tokens, intermediate]
tensor written and read back between them. Here each program reads a block of gate and up, and
writes the product once. Rounded as transformers rounds: SiLU computed in fp32 as torch computes it,
x / (1 + exp(-x)), rounded to the model dtype, then the product rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.rounding import round_to

MAX_BLOCK = 1024


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, size, stride_in, stride_out, BLOCK: tl.constexpr):
    """Program (token, block of the intermediate size)."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + token * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + token * stride_in + size + cols, mask=mask, other=0.0).to(tl.float32)
    act = round_to(gate / (1.0 + tl.exp(-gate)), dtype)
    tl.store(out_ptr + token * stride_out + cols, round_to(act * up, dtype).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2 * I], gate then up (the fused projection's output; unit column stride).
    Returns SiLU(gate) * up, [T, I] in gate_up's dtype."""
    tokens, size = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(tokens, size)
    if tokens == 0:
        return out
    block = min(MAX_BLOCK, triton.next_power_of_2(size))
    _silu_mul_kernel[(tokens, triton.cdiv(size, block))](gate_up, out, size, gate_up.stride(0), out.stride(0),
                                                         BLOCK=block, num_warps=4, enable_fp_fusion=False)
    return out
