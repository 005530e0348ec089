"""Which half-precision GEMMs a device runs natively: the fact both the attention reference (which
upcasts where they are slow) and the model's linear layers (which then run in float32) decide by."""

from __future__ import annotations

import functools

import torch


@functools.cache
def has_native_half_gemm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `dtype` matmuls run natively on `device` (always on GPUs; on CPUs only with bf16/fp16 ISA)."""
    if device.type != "cpu" or dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
