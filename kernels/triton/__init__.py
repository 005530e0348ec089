"""Triton kernels for paged attention at page size 1: KV store, split-KV decode, extend.

Every kernel reads K/V through flat token-slot indices (`kv_indices`), accumulates in fp32 and
casts loaded bf16/fp16 tiles to fp32 before any arithmetic (the interpreter computes bf16 wrongly).
Nothing here autotunes or queries the GPU at import time, so importing works on a CPU under
`TRITON_INTERPRET=1`, which must be set before this package is imported.
"""
