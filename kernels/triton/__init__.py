"""Triton kernels for paged attention at page size 1: KV store, split-KV decode, extend; and the
model's fused kernels around attention on the GPU path: residual add + RMSNorm, q/k norm + RoPE + KV
store, SiLU * up.

Every attention kernel reads K/V through flat KV-location indices (`kv_indices`). Every kernel computes
in fp32 and casts loaded bf16/fp16 tiles to fp32 before any arithmetic (the interpreter computes bf16
wrongly); the fused ones round back where transformers rounds (`rounding.py`).
Nothing here autotunes or queries the GPU at import time, so importing works on a CPU under
`TRITON_INTERPRET=1`, which must be set before this package is imported.
"""
