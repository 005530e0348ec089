"""FlashInfer paged attention over the existing per-layer pool, viewed as pages of one token.

`flashinfer-python` is an optional extra: this module is imported only when the backend is asked for.
Decode steps use `BatchDecodeWithPagedKVCacheWrapper`, others `BatchPrefillWithPagedKVCacheWrapper`
(its causal mask is aligned bottom-right, as ours is); either is planned once per step in `prepare`
and run per layer. RoPE is applied by the model, so every backend sees the same cache contents.
CUDA graphs get one decode wrapper per captured batch size, bound to the graph's static index buffers
and re-planned (outside the graph) before every replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

import flashinfer
import torch

from kernels.attention.base import AttentionBackend, AttentionMetadata, AttentionShape, store_kv

WORKSPACE_BYTES = 128 * 2**20

Wrapper: TypeAlias = "flashinfer.BatchDecodeWithPagedKVCacheWrapper | flashinfer.BatchPrefillWithPagedKVCacheWrapper"


@dataclass
class FlashInferStep:
    """The planned wrapper every layer of this step runs, and where the step's new K/V go."""

    wrapper: Wrapper
    out_locs: torch.Tensor
    last_page_len: torch.Tensor  # all ones (page size 1); fixed for a CUDA-graph wrapper


class FlashInferBackend(AttentionBackend[FlashInferStep]):
    """Needs `setup()` (head counts, dtype, scale) before the first `prepare()`."""

    name = "flashinfer"
    supports_cuda_graph = True

    def __init__(self) -> None:
        self.shape: AttentionShape | None = None

    def setup(self, shape: AttentionShape, device: torch.device) -> None:
        if shape.windows != {None} or shape.softcap is not None:
            raise ValueError("the flashinfer backend runs full attention without capped scores; this model has "
                             "sliding windows or capped scores: use attention_backend='triton'")
        self.shape = shape
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.use_tensor_cores = shape.num_qo_heads // shape.num_kv_heads >= 4
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                    use_tensor_cores=self.use_tensor_cores)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")

    def _plan(self, wrapper: Wrapper, meta: AttentionMetadata, last_page_len: torch.Tensor, decode: bool) -> None:
        shape = self.shape
        if shape is None:
            raise RuntimeError("FlashInferBackend.setup() must run before the first step")
        dims = (shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, 1)  # page size 1
        options = dict(pos_encoding_mode="NONE", sm_scale=shape.scale, q_data_type=shape.dtype,
                       kv_data_type=shape.dtype)
        if decode:
            wrapper.plan(meta.kv_indptr, meta.kv_indices, last_page_len, *dims, **options)
        else:
            wrapper.plan(meta.qo_indptr, meta.kv_indptr, meta.kv_indices, last_page_len, *dims, causal=True,
                         **options)

    def prepare(self, meta: AttentionMetadata) -> FlashInferStep:
        decode = meta.is_decode
        wrapper = self.decode if decode else self.prefill
        last_page_len = torch.ones(len(meta.q_lens), dtype=torch.int32, device=meta.kv_indptr.device)
        self._plan(wrapper, meta, last_page_len, decode)
        return FlashInferStep(wrapper, meta.out_locs, last_page_len)

    def capture_state(self, meta: AttentionMetadata) -> FlashInferStep:
        last_page_len = torch.ones(len(meta.q_lens), dtype=torch.int32, device=meta.kv_indptr.device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
            paged_kv_indptr_buffer=meta.kv_indptr, paged_kv_indices_buffer=meta.kv_indices,
            paged_kv_last_page_len_buffer=last_page_len)
        self._plan(wrapper, meta, last_page_len, decode=True)
        return FlashInferStep(wrapper, meta.out_locs, last_page_len)

    def replay_prepare(self, state: FlashInferStep, meta: AttentionMetadata) -> None:
        self._plan(state.wrapper, meta, state.last_page_len, decode=True)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, state: FlashInferStep, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, state.out_locs)
        paged = (k_cache.unsqueeze(1), v_cache.unsqueeze(1))  # [locations, page_size=1, Hkv, D]
        return state.wrapper.run(q.contiguous(), paged)
