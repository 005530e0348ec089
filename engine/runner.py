"""ModelRunner: runs a scheduled ForwardBatch through the model and samples its next tokens."""

from __future__ import annotations

import contextlib
import time

import torch

from engine.batch import ForwardBatch, ForwardOutput
from engine.cuda_graph import DecodeGraphs
from engine.distributed import TensorParallel
from engine.distributed.step import StepInputs
from engine.distributed.workers import WorkerPool
from engine.kv.pool import KVPool
from engine.kv.table import RequestTable
from engine.model.llama import CausalLM
from engine.sampling import logprobs, sample
from engine.threads import ThreadGovernor
from kernels.attention.base import AttentionBackend


class ModelRunner:
    """Owns the model, the KV pool and the attention backend; touches no scheduler state, so `run`
    may execute in a worker thread while the scheduler prepares the next batch.

    Under tensor parallelism this is rank 0's runner: it hands each step to the worker ranks
    (`workers`) before running its own shard, and the model's final gather brings it whole logits.
    """

    def __init__(self, model: CausalLM, kv: KVPool, table: RequestTable, backend: AttentionBackend,
                 device: torch.device, *, tp: TensorParallel | None = None, workers: WorkerPool | None = None,
                 graphs: DecodeGraphs | None = None, governor: ThreadGovernor | None = None) -> None:
        self.model = model
        self.governor = governor  # CPU: the thread team for each step (engine/threads.py)
        self.graphs = graphs
        self.kv = kv
        self.table = table
        self.backend = backend
        self.device = device
        self.tp = tp if tp is not None else TensorParallel()
        self.workers = workers
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits [S, vocab] for the batch's sampled rows (intermediate prefill chunks get none)."""
        input_ids = batch.input_ids
        if input_ids is not None:  # the prompt tokens join the token table, where penalties count them
            self.table.token_ids.view(-1)[batch.input_index[batch.num_decode :]] = input_ids
        if batch.num_decode:  # decode tokens: what the previous step's sampler wrote to the token table
            sampled = self.table.token_ids.view(-1)[batch.input_index[: batch.num_decode]]
            input_ids = sampled if input_ids is None else torch.cat((sampled, input_ids))
        assert input_ids is not None  # a batch without decode tokens has prompt tokens
        graphs = self.graphs  # never set under tensor parallelism
        if graphs is not None and batch.num_decode == batch.num_tokens and graphs.bucket(batch.num_tokens) is not None:
            return graphs.run(input_ids, batch.positions, batch.attn)
        with self.workers.guard() if self.workers else contextlib.nullcontext():
            if self.workers:
                step = StepInputs.from_metadata(input_ids, batch.positions, batch.logits_index, batch.attn)
                self.workers.start_step(step, self.tp)
            state = self.backend.prepare(batch.attn)
            return self.model(input_ids, batch.positions, batch.logits_index, self.kv, self.backend, state)

    def run(self, batch: ForwardBatch) -> ForwardOutput:
        """Forward, sample, and write each sampled token into the token table where the next step reads it.

        On CUDA this only launches: the work is queued on the runner's stream behind the previous step,
        the next step reads its input ids from the token table on the device, and the host copy of the
        sampled ids is waited for by `ForwardOutput.tokens()` alone, so the host never blocks here.
        """
        start = time.perf_counter()
        if self.stream is None:
            if self.governor is None:
                output = self._forward_and_sample(batch)
            else:  # set here: torch's thread count is the calling thread's (the model's)
                shape = (batch.kind, batch.num_tokens.bit_length())
                torch.set_num_threads(self.governor.threads(shape))
                output = self._forward_and_sample(batch)
                seconds = time.perf_counter() - start
                self.governor.record(shape, seconds / batch.num_tokens, seconds)
            output.run_time = time.perf_counter() - start
            return output
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the batch was built on the default stream
        with torch.cuda.stream(self.stream):
            output = self._forward_and_sample(batch)
            output.next_tokens = output.next_tokens.to("cpu", non_blocking=True)
            output.logprobs = output.logprobs and output.logprobs.to_host()
            output.prompt_logprobs = output.prompt_logprobs and output.prompt_logprobs.to_host()
            output.ready = torch.cuda.Event()
            output.ready.record()
        output.run_time = time.perf_counter() - start
        return output

    def _forward_and_sample(self, batch: ForwardBatch) -> ForwardOutput:
        """Sample the sampled rows; log-probabilities (of the raw logits) for the rows that asked."""
        logits = self.forward(batch)
        prompt: torch.Tensor | None = None
        if batch.logits_select is not None:  # rows in position order: ours first, then the prompt's
            rows = logits[batch.logits_select]
            logits, prompt = rows[: len(batch.sample_rows)], rows[len(batch.sample_rows) :]
        sampling = batch.sampling
        next_tokens = sample(logits, sampling, self.table.token_ids)
        self.table.token_ids.view(-1)[batch.out_index] = next_tokens
        output = ForwardOutput(next_tokens=next_tokens)
        if sampling.logprobs is not None:
            rows_t, top = sampling.logprobs
            output.logprobs = logprobs(logits[rows_t], next_tokens[rows_t], top)
        if sampling.prompt_logprobs is not None and prompt is not None:
            output.prompt_logprobs = logprobs(prompt, sampling.prompt_logprobs.targets, sampling.prompt_logprobs.top)
        return output
