"""Compute kernels: attention backends over the paged KV cache (torch reference, minichat's C kernels for the
CPU, Triton, FlashInfer) and the C kernels themselves (kernels/cpu)."""
