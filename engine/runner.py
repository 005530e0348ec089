"""ModelRunner: runs a scheduled ForwardBatch through the model and samples its next tokens."""

from __future__ import annotations

import contextlib
import time

import torch

from engine.batch import ForwardBatch, ForwardOutput
from engine.distributed import TensorParallel
from engine.distributed.step import StepInputs
from engine.distributed.workers import WorkerPool
from engine.kv.pool import KVPool
from engine.kv.table import RequestTable
from engine.model.llama import CausalLM
from engine.sampling import sample
from kernels.attention.base import AttentionBackend


class ModelRunner:
    """Owns the model, the KV pool and the attention backend; touches no scheduler state, so `run`
    may execute in a worker thread while the scheduler prepares the next batch.

    Under tensor parallelism this is rank 0's runner: it hands each step to the worker ranks
    (`workers`) before running its own shard, and the model's final gather brings it whole logits.
    """

    def __init__(self, model: CausalLM, kv: KVPool, table: RequestTable, backend: AttentionBackend,
                 device: torch.device, tp: TensorParallel | None = None, workers: WorkerPool | None = None) -> None:
        self.model = model
        self.kv = kv
        self.table = table
        self.backend = backend
        self.device = device
        self.tp = tp if tp is not None else TensorParallel()
        self.workers = workers

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits [S, vocab] for the batch's sampled rows (intermediate prefill chunks get none)."""
        input_ids = self.table.token_ids.view(-1)[batch.input_index]
        with self.workers.guard() if self.workers else contextlib.nullcontext():
            if self.workers:
                step = StepInputs.from_metadata(input_ids, batch.positions, batch.logits_index, batch.attn)
                self.workers.start_step(step, self.tp)
            state = self.backend.prepare(batch.attn)
            return self.model(input_ids, batch.positions, batch.logits_index, self.kv, self.backend, state)

    def run(self, batch: ForwardBatch) -> ForwardOutput:
        """Forward, sample, and write each sampled token into the token table where the next step reads it."""
        start = time.perf_counter()
        logits = self.forward(batch)
        next_tokens = sample(logits, batch.sampling.params, batch.sampling.generators)
        self.table.token_ids.view(-1)[batch.out_index] = next_tokens
        return ForwardOutput(next_tokens=next_tokens, run_time=time.perf_counter() - start)
