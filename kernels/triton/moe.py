"""Mixture-of-experts products in one launch each, for every expert at once (the GPU path of engine/model/moe.py).

The step's (token, expert) pairs are sorted by expert and each expert's run is padded to whole blocks of BLOCK_M
rows (`sort_by_expert`, all in fixed-size tensor ops, so a decode step can be graphed); one program multiplies one
block of rows, all of one expert, by a tile of that expert's stacked weight. The gate/up product reads each pair's
token row, the activation runs over the pairs (kernels/triton/activation.py), the down product scales each pair by
its routing weight, and each token's top-k rows are summed. Weights are the experts' float tensors stacked:
gate/up [E, 2 * inter, hidden], down [E, hidden, inter].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.activation import gated_activation
from kernels.triton.decode import dot_precision
from kernels.triton.rounding import round_to

BLOCK_M = 16  # rows of one expert per program (tl.dot's smallest tile)


def sort_by_expert(experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs of `experts` ([tokens, top_k] expert ids; pair p is token p // top_k's p % top_k-th) sorted by
    expert and padded per expert to a multiple of `block_m` rows: (pair of each row, padding rows holding
    tokens * top_k; the expert of each block of rows; the number of rows in use, as a 1-element tensor). Sizes
    depend only on the number of pairs and experts."""
    flat = experts.flatten().long()
    pairs = flat.numel()
    # not bincount: on CUDA it reads the largest id back to size its output, which a CUDA graph cannot capture
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat,
                                                                                           torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[expert_of]
    max_rows = triton.cdiv(pairs + num_experts * (block_m - 1), block_m) * block_m
    rows = torch.full((max_rows,), pairs, dtype=torch.int64, device=flat.device)
    rows[(ends - padded)[expert_of] + rank] = order
    starts = torch.arange(0, max_rows, block_m, device=flat.device)
    block_experts = torch.searchsorted(ends, starts, right=True).clamp(max=num_experts - 1)
    return rows, block_experts, ends[-1:]


@triton.jit
def _moe_gemm_kernel(a_ptr, b_ptr, c_ptr, rows_ptr, block_experts_ptr, used_ptr, weights_ptr, num_pairs, N, K,
                     stride_am, stride_be, stride_bn, stride_cm, TOP_K: tl.constexpr, SCALE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """Program (block of sorted rows, tile of N): C[pair] = A[pair // TOP_K] @ B[expert]^T (times the pair's
    routing weight with SCALE, rounded first to C's dtype as transformers rounds the expert's output)."""
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M < tl.load(used_ptr):
        expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
        pairs = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pairs < num_pairs
        a_rows = (pairs // TOP_K).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_mask = kk < K
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + kk[None, :], mask=valid[:, None] & k_mask[None, :],
                        other=0.0).to(tl.float32)
            b = tl.load(b_ptr + expert * stride_be + n[None, :] * stride_bn + kk[:, None],
                        mask=n_mask[None, :] & k_mask[:, None], other=0.0).to(tl.float32)
            acc += tl.dot(a, b, input_precision=PRECISION)
        dtype = c_ptr.dtype.element_ty
        if SCALE:
            weight = tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
            acc = round_to(acc, dtype) * weight[:, None]
        tl.store(c_ptr + pairs[:, None].to(tl.int64) * stride_cm + n[None, :], acc.to(dtype),
                 mask=valid[:, None] & n_mask[None, :])


def moe_gemm(a: torch.Tensor, b: torch.Tensor, sorted_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
             num_pairs: int, top_k: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Rows [num_pairs, N] (in a's dtype): row p = a[p // top_k] @ b[expert of p]^T, scaled by weights[p] if given.
    a: [rows, K] (unit column stride); b: [E, N, K] contiguous per expert."""
    rows, block_experts, used = sorted_rows
    n, k = b.shape[1], b.shape[2]
    out = a.new_empty(num_pairs, n)
    if num_pairs == 0:
        return out
    block_n, block_k = min(64, max(16, triton.next_power_of_2(n))), min(64, max(16, triton.next_power_of_2(k)))
    grid = (rows.numel() // BLOCK_M, triton.cdiv(n, block_n))
    w = weights if weights is not None else out  # never read without SCALE
    _moe_gemm_kernel[grid](a, b, out, rows, block_experts, used, w, num_pairs, n, k, a.stride(0), b.stride(0),
                           b.stride(1), out.stride(0), TOP_K=top_k, SCALE=weights is not None, BLOCK_M=BLOCK_M,
                           BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=dot_precision(a.dtype))
    return out


def fused_moe(h: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
              activation: str = "silu") -> torch.Tensor:
    """Each row of h [tokens, hidden]: sum over its top-k experts e (`experts` [tokens, top_k], routing `weights`
    alike) of weight * down_e(act(gate_e(h)) * up_e(h)), with w1 [E, 2 * inter, hidden] and w2 [E, hidden, inter].
    Returns [tokens, hidden] in h's dtype."""
    tokens, top_k = experts.shape
    sorted_rows = sort_by_expert(experts, w1.shape[0])
    pairs = tokens * top_k
    gate_up = moe_gemm(h, w1, sorted_rows, pairs, top_k)
    down = moe_gemm(gated_activation(gate_up, activation), w2, sorted_rows, pairs, 1, weights.flatten().contiguous())
    return down.view(tokens, top_k, -1).sum(dim=1)
