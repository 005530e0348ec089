"""Drive any backend with a workload: concurrency cap, Poisson arrivals, warmup, peak in-flight count.

A backend is one coroutine that sends a request and times its streamed output into a RequestRecord
(engine_run.py over the ZeroMQ protocol, openai_run.py over HTTP); everything else is shared here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from tqdm import tqdm

from tui.bench.metrics import RequestRecord
from tui.bench.workload import BenchRequest, arrival_gaps

Send = Callable[[BenchRequest, "int | None"], Awaitable[RequestRecord]]
"""Send one request with this sampling seed (None: greedy) and record its timings."""


class _Gauge:
    """In-flight request counter that remembers its peak."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def __enter__(self) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)

    def __exit__(self, *exc: object) -> None:
        self.now -= 1


async def run_workload(send: Send, workload: list[BenchRequest], concurrency: int, request_rate: float, seed: int,
                       temperature: float, timeout: float, warmup: int = 0) -> tuple[list[RequestRecord], float, int]:
    """Returns per-request records, the measured duration and the peak number of requests in flight.
    The first `warmup` requests run (unmeasured) before the clock starts; their records come first."""
    sem = asyncio.Semaphore(concurrency)
    gauge = _Gauge()

    async def guarded(req: BenchRequest, delay: float, i: int, bar: tqdm) -> RequestRecord:
        await asyncio.sleep(delay)  # Poisson arrival schedule, not synchronisation
        async with sem:
            with gauge:
                sample_seed = None if temperature == 0 else seed + i
                try:
                    return await asyncio.wait_for(send(req, sample_seed), timeout)
                except Exception as e:  # counted and reported, never fatal to the run
                    reason = "timed out" if isinstance(e, asyncio.TimeoutError) else str(e) or type(e).__name__
                    return RequestRecord(prompt_len=len(req.prompt_ids), error=reason)
                finally:
                    bar.update(1)

    warm: list[RequestRecord] = []
    if warmup:  # a bar of its own each, on stderr: "warmup 2/2", then "bench 0/64"
        with tqdm(total=warmup, desc="warmup", unit="req") as bar:
            warm = await asyncio.gather(*(guarded(r, 0.0, i, bar) for i, r in enumerate(workload[:warmup])))
        gauge.peak = 0
    measured = workload[warmup:]
    offsets, t = [], 0.0
    for gap in arrival_gaps(len(measured), request_rate, seed):
        t += gap
        offsets.append(t)
    with tqdm(total=len(measured), desc="bench", unit="req") as bar:
        start = time.perf_counter()
        records = await asyncio.gather(*(guarded(r, d, warmup + i, bar)
                                         for i, (r, d) in enumerate(zip(measured, offsets, strict=True))))
        duration = time.perf_counter() - start
    return [*warm, *records], duration, gauge.peak
