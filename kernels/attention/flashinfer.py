"""FlashInfer paged attention over the existing per-layer pool, viewed as pages of one token.

`flashinfer-python` is an optional extra: this module is imported only when the backend is asked for.
Decode steps use `BatchDecodeWithPagedKVCacheWrapper`, others `BatchPrefillWithPagedKVCacheWrapper`
(its causal mask is aligned bottom-right, as ours is); either is planned once per step in `prepare`
and run per layer. RoPE is applied by the model, so every backend sees the same cache contents.
"""

from __future__ import annotations

import flashinfer
import torch

from kernels.attention.base import AttentionBackend, AttentionMetadata, AttentionShape, store_kv

WORKSPACE_BYTES = 128 * 2**20


class FlashInferBackend(AttentionBackend):
    """Needs `setup()` (head counts, dtype, scale) before the first `prepare()`."""

    def __init__(self) -> None:
        self.shape: AttentionShape | None = None

    def setup(self, shape: AttentionShape, device: torch.device) -> None:
        self.shape = shape
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        group = shape.num_qo_heads // shape.num_kv_heads
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=group >= 4)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        shape = self.shape
        if shape is None:
            raise RuntimeError("FlashInferBackend.setup() must run before the first step")
        last_page_len = torch.ones(len(meta.q_lens), dtype=torch.int32, device=meta.kv_indptr.device)
        dims = (shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, 1)
        options = dict(pos_encoding_mode="NONE", sm_scale=shape.scale, q_data_type=shape.dtype,
                       kv_data_type=shape.dtype)
        if meta.is_decode:
            self.decode.plan(meta.kv_indptr, meta.kv_indices, last_page_len, *dims, **options)
        else:
            self.prefill.plan(meta.qo_indptr, meta.kv_indptr, meta.kv_indices, last_page_len, *dims, causal=True,
                              **options)
        return meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.out_slots)
        paged = (k_cache.unsqueeze(1), v_cache.unsqueeze(1))  # [slots, page_size=1, Hkv, D]
        wrapper = self.decode if meta.is_decode else self.prefill
        return wrapper.run(q.contiguous(), paged)
