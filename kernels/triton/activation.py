"""The MLP's act(gate) * up in one pass over the gate/up projection's output: SiLU, or GELU's tanh form (Gemma).

Eager, the activation is a chunk, the activation and a multiply: two kernels, and a [tokens, intermediate]
tensor written and read back between them. Here each program reads a block of gate and up, and
writes the product once. Rounded as transformers rounds: the activation computed in fp32 as torch computes it
(SiLU: x / (1 + exp(-x)); GELU: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))), rounded to the model dtype,
then the product rounded again.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.triton.rounding import round_to

MAX_BLOCK = 1024
ACTIVATIONS = ("silu", "gelu_tanh")


@triton.jit
def _gated_kernel(gate_up_ptr, out_ptr, size, stride_in, stride_out, GELU: tl.constexpr, BLOCK: tl.constexpr):
    """Program (token, block of the intermediate size)."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + token * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + token * stride_in + size + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        inner = math.sqrt(2.0 / math.pi) * (gate + 0.044715 * gate * gate * gate)
        t = tl.exp(-2.0 * tl.abs(inner))
        tanh = tl.where(inner >= 0, (1.0 - t) / (1.0 + t), (t - 1.0) / (1.0 + t))
        act = round_to(0.5 * gate * (1.0 + tanh), dtype)
    else:
        act = round_to(gate / (1.0 + tl.exp(-gate)), dtype)
    tl.store(out_ptr + token * stride_out + cols, round_to(act * up, dtype).to(dtype), mask=mask)


def gated_activation(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """gate_up: [T, 2 * I], gate then up (the fused projection's output; unit column stride).
    Returns act(gate) * up, [T, I] in gate_up's dtype; `activation` is one of ACTIVATIONS."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; the Triton kernel computes {', '.join(ACTIVATIONS)}")
    tokens, size = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(tokens, size)
    if tokens == 0:
        return out
    block = min(MAX_BLOCK, triton.next_power_of_2(size))
    _gated_kernel[(tokens, triton.cdiv(size, block))](gate_up, out, size, gate_up.stride(0), out.stride(0),
                                                      GELU=activation == "gelu_tanh", BLOCK=block, num_warps=4,
                                                      enable_fp_fusion=False)
    return out
