"""The minichat backend of `minichat bench`: the engine's ZeroMQ protocol, timing every streamed output."""

from __future__ import annotations

import time

from engine.outputs import Final
from engine.service.client import AsyncEngineClient
from engine.structured import GrammarSpec
from tui.bench.metrics import RequestRecord
from tui.bench.runner import run_workload
from tui.bench.workload import BenchRequest


async def _one(client: AsyncEngineClient, req: BenchRequest, ignore_eos: bool, temperature: float,
               seed: int | None, structured: GrammarSpec | None) -> RequestRecord:
    record = RequestRecord(prompt_len=len(req.prompt_ids))
    start = last = time.perf_counter()
    async for out in client.generate(req.prompt_ids, max_tokens=req.output_len, ignore_eos=ignore_eos,
                                     temperature=temperature, seed=seed, structured=structured):
        now = time.perf_counter()
        if out.token_ids:
            if record.ttft is None:
                record.ttft = now - start
            else:
                record.itl.append(now - last)
            last = now
            record.output_len += len(out.token_ids)
        if isinstance(out, Final):  # never admitted (queue None): it ran for no time
            queue = out.timings.queue
            record.admitted = 0.0 if queue is None else out.timings.total - queue
            record.aborted = out.finish_reason == "abort"  # by someone else: this client never aborts
            record.cached = out.usage.cached_tokens
            if out.usage.draft_tokens:
                record.drafts = (out.usage.draft_tokens, out.usage.accepted_tokens)
    record.e2e = time.perf_counter() - start
    return record


async def run_engine_bench(address: str, workload: list[BenchRequest], concurrency: int, request_rate: float,
                           seed: int, ignore_eos: bool, temperature: float, timeout: float,
                           json_schema: str | None = None, warmup: int = 0) -> tuple[list[RequestRecord], float, int]:
    """Returns per-request records, the measured duration and the peak number of requests in flight.
    With `json_schema` every request's output is constrained to it."""
    structured = None if json_schema is None else GrammarSpec(kind="json_schema", value=json_schema)
    async with AsyncEngineClient(address, timeout=timeout, name="bench") as client:
        await client.ping(timeout=5.0)
        return await run_workload(lambda req, s: _one(client, req, ignore_eos, temperature, s, structured),
                                  workload,
                                  concurrency, request_rate, seed, temperature, timeout, warmup)
