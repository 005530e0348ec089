"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed with the batch padded up.

A decode step launches a few kernels per layer, each tiny at small batch sizes, so on a GPU the
launches cost more than the work; replaying a captured graph launches them all at once. The graphs
read fixed (static) buffers: input ids, positions, and the attention metadata (`kv_indptr`,
`kv_indices`, `out_locs`) sized for the largest bucket. Before a replay the step's values are copied
in, and the rows between the batch size and its bucket are padding: one key each, at a scratch KV
slot that no request owns, which is also where their new K/V are written. Buckets are captured
largest first into one shared memory pool, so the smaller graphs reuse the largest one's memory.
Prefill stays eager (its shapes vary too much to capture).

With `capture=False` the same static-buffer, padded path runs eagerly, which is how it is tested on a
CPU (where there are no graphs) and how a capture problem is told apart from a padding one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.kv.pool import KVPool
from engine.model.decoder import CausalLM
from kernels.attention.base import AttentionBackend, AttentionMetadata, RaggedIndices

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE  # what torch.cuda.graph_pool_handle returns (torch's own name for it)


def graph_buckets(max_bs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8 up to `max_bs` (always including it)."""
    sizes = [b for b in (1, 2, 4) if b < max_bs] + list(range(8, max_bs + 1, 8))
    if not sizes or sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class DecodeGraphs:
    """Decode forward passes for every bucket up to `max_bs` requests of at most `max_seq_len` tokens."""

    def __init__(self, model: CausalLM, kv: KVPool, backend: AttentionBackend, max_bs: int, max_seq_len: int,
                 scratch_loc: int, device: torch.device, capture: bool = True) -> None:
        if not backend.supports_cuda_graph:
            raise ValueError(f"{type(backend).__name__} does not support CUDA graphs")
        self.model, self.kv, self.backend = model, kv, backend
        self.buckets = graph_buckets(max_bs)
        self.scratch_loc = scratch_loc
        n = self.buckets[-1]
        i32, i64 = torch.int32, torch.int64
        self.input_ids = torch.zeros(n, dtype=i64, device=device)
        self.positions = torch.zeros(n, dtype=i64, device=device)
        # qo_indptr of every bucket, and the padding's kv_indptr steps
        self.steps = torch.arange(n + 1, dtype=i32, device=device)
        self.logits_index = torch.arange(n, dtype=i64, device=device)  # every row of a decode step is sampled
        self.kv_indptr = torch.arange(n + 1, dtype=i32, device=device)
        self.kv_indices = torch.full((n * max_seq_len,), scratch_loc, dtype=i32, device=device)
        self.out_locs = torch.full((n,), scratch_loc, dtype=i64, device=device)
        self.metas = {bs: self._static_meta(bs) for bs in self.buckets}
        self.states = {bs: backend.capture_state(self.metas[bs]) for bs in self.buckets}
        self.runs: dict[int, Callable[[], torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle() if capture else None
        for bs in reversed(self.buckets):
            self.runs[bs] = self._capture(bs, pool) if capture else self._eager(bs)

    def _static_meta(self, bs: int) -> AttentionMetadata:
        """Metadata whose tensors are views of the static buffers (the host lists give only the shape)."""
        empty = torch.empty(0, dtype=torch.int64, device=self.steps.device)
        indices = RaggedIndices(qo_indptr=self.steps[: bs + 1], kv_indptr=self.kv_indptr[: bs + 1],
                                kv_indices=self.kv_indices, prefix_lens=self.steps[:bs])
        return AttentionMetadata(q_lens=[1] * bs, kv_lens=[1] * bs, out_locs=self.out_locs[:bs], rows=empty,
                                 table=empty, indices=indices)

    def _forward(self, bs: int) -> torch.Tensor:
        return self.model(self.input_ids[:bs], self.positions[:bs], self.logits_index[:bs], self.kv, self.backend,
                          self.states[bs])

    def _eager(self, bs: int) -> Callable[[], torch.Tensor]:
        return lambda: self._forward(bs)

    def _capture(self, bs: int, pool: _POOL_HANDLE | None) -> Callable[[], torch.Tensor]:
        # The static buffers start as an all-padding batch, which is valid to run.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph: Triton compiles, libraries allocate
            self._forward(bs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self._forward(bs)

        def replay() -> torch.Tensor:
            graph.replay()
            return logits

        return replay

    def bucket(self, batch_size: int) -> int | None:
        """The smallest captured batch size that holds `batch_size` requests (None: run eagerly)."""
        return next((b for b in self.buckets if b >= batch_size), None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [bs, vocab] of a decode step of bs <= max_bs requests (the caller checks `bucket`)."""
        bs = len(meta.q_lens)
        bucket = self.bucket(bs)
        assert bucket is not None and meta.is_decode
        num_kv = meta.kv_indices.numel()
        pad = bucket - bs
        self.input_ids[:bs].copy_(input_ids)
        self.positions[:bs].copy_(positions)
        self.out_locs[:bs].copy_(meta.out_locs)
        self.kv_indptr[: bs + 1].copy_(meta.kv_indptr)
        self.kv_indices[:num_kv].copy_(meta.kv_indices)
        if pad:
            self.input_ids[bs:bucket].zero_()
            self.positions[bs:bucket].zero_()
            self.out_locs[bs:bucket].fill_(self.scratch_loc)
            torch.add(self.steps[1 : pad + 1], num_kv, out=self.kv_indptr[bs + 1 : bucket + 1])
            self.kv_indices[num_kv : num_kv + pad].fill_(self.scratch_loc)
        self.backend.replay_prepare(self.states[bucket], self.metas[bucket])
        return self.runs[bucket]()[:bs]
