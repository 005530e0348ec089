"""Compute kernels: attention backends over the paged KV cache (torch reference, Triton, FlashInfer)."""
