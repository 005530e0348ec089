"""Triton paged attention: one KV-store launch and one attention launch per layer.

A pure-decode step uses the split-KV decode kernels (the grouped one when query heads share a KV
head); any step with a multi-token request runs the extend kernel for the whole ragged batch, since a
decode request is just an extend of one token. The model's fused path (kernels/triton/rope.py) writes
K/V into the pool itself and calls `attend`, the attention alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.attention.base import AttentionBackend, AttentionMetadata, AttentionShape
from kernels.attention.int8_kv import blocks, dequantize_rows, is_int8, quantize_keys, quantize_rows, rotate_queries
from kernels.triton.decode import decode_attention
from kernels.triton.extend import extend_attention
from kernels.triton.kv_store import store_kv


@dataclass
class TritonStep:
    """One step's index tensors, plus the decode scratch that every layer reuses."""

    meta: AttentionMetadata
    max_q_len: int
    decode: bool
    partial: tuple[torch.Tensor, torch.Tensor] | None = field(default=None)


class TritonBackend(AttentionBackend[TritonStep]):
    """`num_splits` KV slices per decode request, each at least `min_split_len` keys long."""

    name = "triton"
    supports_cuda_graph = True

    def __init__(self, num_splits: int = 8, min_split_len: int = 64) -> None:
        self.num_splits = num_splits
        self.min_split_len = min_split_len
        self.shape: AttentionShape | None = None

    def setup(self, shape: AttentionShape, device: torch.device) -> None:
        self.shape = shape

    def prepare(self, meta: AttentionMetadata) -> TritonStep:
        return TritonStep(meta, max(meta.q_lens), meta.is_decode)

    def capture_state(self, meta: AttentionMetadata) -> TritonStep:
        """The kernels read only device tensors and their grids depend only on the batch size, so the
        graph needs nothing beyond scratch that outlives the capture."""
        shape = self.shape
        if shape is None:
            raise RuntimeError("TritonBackend.setup() must run before capturing CUDA graphs")
        batch, device = len(meta.q_lens), meta.kv_indptr.device
        partial = (torch.empty(batch, shape.num_qo_heads, self.num_splits, shape.head_dim, dtype=torch.float32,
                               device=device),
                   torch.empty(batch, shape.num_qo_heads, self.num_splits, dtype=torch.float32, device=device))
        return TritonStep(meta, 1, True, partial)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, state: TritonStep, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        """Store this step's K/V (int8 pages: quantized once, here) and attend. On int8 pages this step's own keys
        and values are attended as they were stored (read back from their rows), as the other backends do."""
        k, v = k.contiguous(), v.contiguous()
        if is_int8(k_cache):
            head_dim = k.shape[-1]
            k_rows, v_rows = quantize_keys(k), quantize_rows(v)
            store_kv(k_rows, v_rows, k_cache, v_cache, state.meta.out_locs)
            k, v = dequantize_rows(k_rows, head_dim), dequantize_rows(v_rows, head_dim)
        else:
            store_kv(k, v, k_cache, v_cache, state.meta.out_locs)
        return self.attend(q, k, v, k_cache, v_cache, state, scale, window, softcap)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, state: TritonStep, scale: float, window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
        """`forward` without the store, for K/V already in the pool at `out_locs`; this step's k and v are
        still read (by the extend kernel) and may be strided views (unit stride along head_dim); on int8 pages they
        must be the values as stored (`forward` does that)."""
        meta = state.meta
        head_dim = q.shape[-1]
        int8_block = head_dim // blocks(head_dim) if is_int8(k_cache) else 0  # values per scale
        if int8_block:  # the keys stored rotated: the queries turned alike
            q = rotate_queries(q).to(q.dtype)
        if not state.decode:
            return extend_attention(q, k, v, k_cache, v_cache, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                                    state.max_q_len, scale, window=window, softcap=softcap, int8_block=int8_block)
        if state.partial is None:
            batch, heads, dim = q.shape
            state.partial = (q.new_empty(batch, heads, self.num_splits, dim, dtype=torch.float32),
                             q.new_empty(batch, heads, self.num_splits, dtype=torch.float32))
        return decode_attention(q, k_cache, v_cache, meta.kv_indptr, meta.kv_indices, scale,
                                num_splits=self.num_splits, min_split_len=self.min_split_len, partial=state.partial,
                                window=window, softcap=softcap, int8_block=int8_block)
