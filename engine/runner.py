"""ModelRunner: turns a scheduled batch into flat tensors, runs the model, returns logits."""

from __future__ import annotations

import contextlib

import torch

from engine.distributed import TensorParallel
from engine.distributed.step import StepInputs
from engine.distributed.workers import WorkerPool
from engine.kv.pool import KVPool
from engine.kv.table import RequestTable
from engine.model.llama import CausalLM
from engine.request import Req
from kernels.attention.base import AttentionBackend, build_metadata


class ModelRunner:
    """Rank 0's runner; under tensor parallelism it hands each step to the worker ranks (`workers`)
    before running its own shard, and gets the whole logits back from the model's final gather."""

    def __init__(self, model: CausalLM, kv: KVPool, table: RequestTable, backend: AttentionBackend,
                 device: torch.device, tp: TensorParallel | None = None, workers: WorkerPool | None = None) -> None:
        self.model = model
        self.kv = kv
        self.table = table
        self.backend = backend
        self.device = device
        self.tp = tp if tp is not None else TensorParallel()
        self.workers = workers

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
        input_ids = torch.tensor(tokens, dtype=torch.int64, device=dev)
        logits_index = torch.tensor(logits_at, dtype=torch.int64, device=dev)
        meta = build_metadata(q_lens, kv_lens, rows, self.table.table)
        with self.workers.guard() if self.workers else contextlib.nullcontext():
            if self.workers:
                self.workers.start_step(StepInputs.from_metadata(input_ids, positions_t, logits_index, meta), self.tp)
            return self.model(input_ids, positions_t, logits_index, self.kv, self.backend, self.backend.prepare(meta))
