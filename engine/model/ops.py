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

oneDNN builds (JIT-compiles) a matmul primitive for every row count it meets, and two caches keep
each one alive: oneDNN's primitive cache and ideep's computation cache (LRU_CACHE_CAPACITY), both 1,024
entries by default. Steps have any row count, so a server fed varied prompt lengths grew without
bound (demo model: 425 -> 680 MiB over 30 rounds of 40 requests, about 8 MiB a round; flat only with
both caches capped, and each cached (rows, threads) pair costs about 1.3 MiB). Prepacked GEMMs
therefore run on row counts rounded up to a bucket (`row_bucket`), 68 of them up to 4,096 rows; the
padding rows are zeros and are dropped from the output. Buckets times team sizes still took hours to fill
1,024 entries, so the server caps both caches (engine/onednn.py). Up to 64 rows a GEMM is bound by reading the
weights, so coarse buckets cost next to nothing there; above, eight buckets per power of two keep
the padding of a prefill under 12.5%.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.config import LINEAR_DTYPES
from kernels.cpu import load_cpu_kernels
from kernels.gemm import has_native_half_gemm
from kernels.quant import BlockMatrix, DeviceBlockWeight

Weight = torch.Tensor | BlockMatrix | DeviceBlockWeight
"""A projection's weight: a tensor (maybe oneDNN-packed), or GGML block formats as the CPU kernels (BlockMatrix)
or the GPU kernels (DeviceBlockWeight) read them (kernels/quant.py)."""


def resolve_linear_dtype(choice: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """`auto` is float32 exactly when the device has no native GEMM for the (half) model dtype."""
    if choice not in LINEAR_DTYPES:
        raise ValueError(f"linear_dtype must be one of {', '.join(LINEAR_DTYPES)}; got {choice!r}")
    if choice == "float32" or (choice == "auto" and not has_native_half_gemm(device, model_dtype)):
        return torch.float32
    return model_dtype


PACK_ROWS_HINT = 32
"""The row count oneDNN picks a weight layout for; the packed weight serves any row count."""

EXACT_ROWS = 8  # the smallest steps run at their own row count


def row_bucket(rows: int) -> int:
    """The row count a prepacked GEMM runs at for `rows` rows: `rows` up to EXACT_ROWS; above, rows
    in (p, 2p] round up to the next multiple of p/4 while 2p <= 64, of p/8 beyond
    (9 -> 10, 17 -> 20, 65 -> 72, 2,049 -> 2,304)."""
    if rows <= EXACT_ROWS:
        return rows
    low = 1 << ((rows - 1).bit_length() - 1)  # rows is in (low, 2 * low]
    step = low // (4 if low < 64 else 8)
    return low + -(-(rows - low) // step) * step


def _bucketed(op: Callable[..., torch.Tensor], x: torch.Tensor, *args: object,
              other: torch.Tensor | None = None) -> torch.Tensor:
    """`op(x, [other,] *args)` with `x` (and `other`) padded with zero rows up to their bucket, and the
    padding rows dropped from the result; no padding, no copy, no slice for a row count that is one."""
    rows = x.shape[0]
    extra = row_bucket(rows) - rows
    if not extra:
        return op(x, *args) if other is None else op(x, other, *args)
    x = F.pad(x, (0, 0, 0, extra))
    out = op(x, *args) if other is None else op(x, F.pad(other, (0, 0, 0, extra)), *args)
    return out[:rows]


def can_prepack(weight: torch.Tensor) -> bool:
    """oneDNN prepacking is used for float32 weights on the CPU (bf16 packing needs a CPU with native
    bf16, which this project cannot measure)."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """A float32 [out, in] weight reordered into oneDNN's blocked layout (an opaque mkldnn tensor that
    only `linear` reads)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)


def gemm_dtype(weight: Weight) -> torch.dtype:
    """What the GEMM with `weight` computes in: its storage dtype, float32 for block formats."""
    return weight.dtype if isinstance(weight, torch.Tensor) else torch.float32


def fuses_add(weight: Weight) -> bool:
    """Whether `linear_add` can add inside the GEMM with this weight (oneDNN-packed, or block formats on the CPU)."""
    return isinstance(weight, BlockMatrix) or (isinstance(weight, torch.Tensor) and weight.is_mkldnn)


def linear_add(x: torch.Tensor, other: torch.Tensor, weight: torch.Tensor | BlockMatrix) -> torch.Tensor:
    """x W^T + other in one call: a binary post-op of oneDNN's GEMM on a packed weight, or added by the block
    kernels as they write (float32 activations); the residual adds use it."""
    if isinstance(weight, BlockMatrix):
        return load_cpu_kernels().q_linear(x, weight, add=other)
    return _bucketed(torch.ops.mkldnn._linear_pointwise.binary, x, weight, None, "add", other=other)


def embedding(ids: torch.Tensor, weight: Weight) -> torch.Tensor:
    """Rows `ids` of an embedding table (block formats: dequantized, as float32)."""
    if isinstance(weight, DeviceBlockWeight):
        return weight.dequantize(ids)
    if isinstance(weight, BlockMatrix):
        if len(weight.segments) != 1:
            raise ValueError("an embedding table in block formats must be one segment")
        return load_cpu_kernels().dequantize(weight.segments[0], weight.in_features, ids)
    return F.embedding(ids, weight)


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x W^T + b in the weight's storage dtype (through oneDNN for a prepacked weight, minichat's kernels for
    block formats), returned in `out_dtype` (default: `x`'s dtype)."""
    out_dtype = out_dtype or x.dtype
    if isinstance(weight, BlockMatrix):
        b = None if bias is None else bias.float()
        out = load_cpu_kernels().q_linear(x.float().contiguous(), weight, b)
        return out if out_dtype == torch.float32 else out.to(out_dtype)
    if isinstance(weight, DeviceBlockWeight):
        from kernels.triton.quant import weight_only_linear  # Triton: only where a GPU runs block formats

        return weight_only_linear(x.contiguous(), weight, bias).to(out_dtype)
    if weight.is_mkldnn:
        out = _bucketed(torch.ops.mkldnn._linear_pointwise, x.to(weight.dtype), weight, bias, "none", [], "")
        return out.to(out_dtype)
    if weight.dtype == x.dtype == out_dtype:
        return F.linear(x, weight, bias)
    return F.linear(x.to(weight.dtype), weight, bias).to(out_dtype)
