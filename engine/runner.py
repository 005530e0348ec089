"""ModelRunner: turns a scheduled batch into flat tensors, runs the model, returns logits."""

from __future__ import annotations

import torch

from engine.cuda_graph import DecodeGraphs
from engine.kv.pool import KVPool
from engine.kv.table import RequestTable
from engine.model.llama import CausalLM
from engine.request import Req
from kernels.attention.base import AttentionBackend, build_metadata


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KVPool, table: RequestTable, backend: AttentionBackend,
                 device: torch.device, graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.graphs = graphs
        self.kv = kv
        self.table = table
        self.backend = backend
        self.device = device

    def forward(self, reqs: list[Req], wants_logits: list[bool]) -> torch.Tensor:
        """Feed each request's `extend_len` tokens starting at `cached_len` (positions are absolute).

        Returns float32 logits for the last token of each request whose flag in `wants_logits` is set;
        intermediate prefill chunks get none.
        """
        tokens: list[int] = []
        positions: list[int] = []
        q_lens, kv_lens, logits_at = [], [], []
        for req, wants in zip(reqs, wants_logits, strict=True):
            start, end = req.cached_len, req.cached_len + req.extend_len
            tokens += req.tokens(start, end)
            positions += range(start, end)
            q_lens.append(req.extend_len)
            kv_lens.append(end)
            if wants:
                logits_at.append(len(tokens) - 1)
        dev = self.device
        positions_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        rows = torch.tensor([r.slot for r in reqs], dtype=torch.int64, device=dev)
        attn = build_metadata(q_lens, kv_lens, rows, self.table.table)
        input_ids = torch.tensor(tokens, dtype=torch.int64, device=dev)
        if self.graphs is not None and attn.is_decode and self.graphs.bucket(len(reqs)) is not None:
            return self.graphs.run(input_ids, positions_t, attn)
        return self.model(input_ids, positions_t, torch.tensor(logits_at, dtype=torch.int64, device=dev), self.kv,
                          self.backend, self.backend.prepare(attn))
