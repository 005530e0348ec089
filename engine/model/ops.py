"""Where the model's GEMMs run: in the model dtype, or in float32 on CPUs without native bf16/fp16 GEMM;
and on the CPU, through oneDNN on weights prepacked once at load.

On an x86 CPU without AVX512-BF16 / AMX (e.g. plain AVX2), torch's bf16 and fp16 matmuls fall back
to a slow path that converts inside the inner loop: 3-12x slower than MKL's float32 GEMM on the same
numbers. Upcasting a bf16 weight to float32 is exact, a float32 GEMM accumulates in float32 as the
bf16 kernel does, and the output is rounded back to the model dtype, so activations keep the model
dtype's rounding; only the summation order differs (about 1 output element in 5,000 moves by one
bf16 ulp). Weights then take twice the memory.

`F.linear` on the CPU hands the dense weight to MKL's sgemm, which packs panels of it into its own
blocked layout inside every call. oneDNN's matmul on a weight reordered once into its layout
(`prepack`) measured faster: on this AVX2 CPU, with 2 threads, the Qwen2.5-0.5B layer shapes
ran 1.5x faster at 32 rows (decode), 1.9x at 1 row and 1.1x at 2,048 (prefill); the demo
model's 1.4x at 32 rows. It is the path Inductor takes for frozen CPU linears. Only the
summation order differs from `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.config import LINEAR_DTYPES
from kernels.gemm import has_native_half_gemm


def resolve_linear_dtype(choice: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """`auto` is float32 exactly when the device has no native GEMM for the (half) model dtype."""
    if choice not in LINEAR_DTYPES:
        raise ValueError(f"linear_dtype must be one of {', '.join(LINEAR_DTYPES)}; got {choice!r}")
    if choice == "float32" or (choice == "auto" and not has_native_half_gemm(device, model_dtype)):
        return torch.float32
    return model_dtype


PACK_ROWS_HINT = 32
"""The row count oneDNN picks a weight layout for; the packed weight serves any row count."""


def can_prepack(weight: torch.Tensor) -> bool:
    """oneDNN prepacking is used for float32 weights on the CPU (bf16 packing needs a CPU with native
    bf16, which this project cannot measure)."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """A float32 [out, in] weight reordered into oneDNN's blocked layout (an opaque mkldnn tensor that
    only `linear` reads)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)


def linear_binary(x: torch.Tensor, other: torch.Tensor, packed: torch.Tensor, op: str) -> torch.Tensor:
    """(x W^T) `op` other, op "add" or "mul", in one oneDNN call (a binary post-op on the GEMM's output);
    the residual adds use it."""
    return torch.ops.mkldnn._linear_pointwise.binary(x, other, packed, None, op)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x W^T + b in the weight's storage dtype (through oneDNN for a prepacked weight), returned in
    `out_dtype` (default: `x`'s dtype)."""
    out_dtype = out_dtype or x.dtype
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.to(weight.dtype), weight, bias, "none", [], "").to(out_dtype)
    if weight.dtype == x.dtype == out_dtype:
        return F.linear(x, weight, bias)
    return F.linear(x.to(weight.dtype), weight, bias).to(out_dtype)
