"""Drive a running engine with a workload over the ZeroMQ protocol and time every streamed token."""

from __future__ import annotations

import asyncio
import time

from tqdm import tqdm

from engine.service.client import AsyncEngineClient
from tui.bench.metrics import RequestRecord
from tui.bench.workload import BenchRequest, arrival_gaps


class _Gauge:
    """In-flight request counter that remembers its peak."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def __enter__(self) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)

    def __exit__(self, *exc: object) -> None:
        self.now -= 1


async def _one(client: AsyncEngineClient, req: BenchRequest, ignore_eos: bool, temperature: float,
               seed: int | None) -> RequestRecord:
    record = RequestRecord(prompt_len=len(req.prompt_ids))
    start = last = time.perf_counter()
    async for out in client.generate(req.prompt_ids, max_tokens=req.output_len, ignore_eos=ignore_eos,
                                     temperature=temperature, seed=seed):
        now = time.perf_counter()
        if out.token_ids:
            if record.ttft is None:
                record.ttft = now - start
            else:
                record.itl.append(now - last)
            last = now
            record.output_len += len(out.token_ids)
    record.e2e = time.perf_counter() - start
    return record


async def run_engine_bench(address: str, workload: list[BenchRequest], concurrency: int, request_rate: float,
                           seed: int, ignore_eos: bool, temperature: float, timeout: float,
                           warmup: int = 0) -> tuple[list[RequestRecord], float, int]:
    """Returns per-request records, the measured duration and the peak number of requests in flight."""
    async with AsyncEngineClient(address, timeout=timeout) as client:
        await client.ping(timeout=5.0)
        sem = asyncio.Semaphore(concurrency)
        gauge = _Gauge()
        bar = tqdm(total=len(workload), desc="bench", unit="req")

        async def guarded(req: BenchRequest, delay: float, i: int) -> RequestRecord:
            await asyncio.sleep(delay)  # Poisson arrival schedule, not synchronisation
            async with sem:
                with gauge:
                    sample_seed = None if temperature == 0 else seed + i
                    try:
                        return await asyncio.wait_for(_one(client, req, ignore_eos, temperature, sample_seed), timeout)
                    except Exception as e:  # counted and reported, never fatal to the run
                        reason = "timed out" if isinstance(e, asyncio.TimeoutError) else str(e) or type(e).__name__
                        return RequestRecord(prompt_len=len(req.prompt_ids), error=reason)
                    finally:
                        bar.update(1)

        if warmup:
            bar.set_description("warmup")
            await asyncio.gather(*(guarded(r, 0.0, i) for i, r in enumerate(workload[:warmup])))
            bar.reset()
            bar.set_description("bench")
            gauge.peak = 0
        offsets, t = [], 0.0
        for gap in arrival_gaps(len(workload), request_rate, seed):
            t += gap
            offsets.append(t)
        start = time.perf_counter()
        records = await asyncio.gather(*(guarded(r, d, i) for i, (r, d) in enumerate(zip(workload, offsets,
                                                                                          strict=True))))
        duration = time.perf_counter() - start
        bar.close()
        return list(records), duration, gauge.peak
