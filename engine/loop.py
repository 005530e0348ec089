"""StepLoop: drives the scheduler's schedule -> run -> process, in sequence or overlapped.

Overlapped: step N+1 is scheduled, and its batch handed to the
model worker, before step N's result is processed, so the host's scheduling, detokenisation and
sending happen while the model runs (torch releases the GIL; one worker thread keeps the steps in
order). Step N+1's input ids come from the token table the sampler of step N writes, so scheduling
never waits for a sampled token. The scheduler's accounting (`sampled`, `inflight`, deferred
release) keeps this safe: see engine/scheduler/scheduler.py.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from engine.batch import ForwardBatch, ForwardOutput
from engine.outputs import StepResult
from engine.runner import ModelRunner
from engine.scheduler import Scheduler

Launched = tuple[ForwardBatch, "Future[ForwardOutput]"]


class StepLoop:
    """At most one batch in flight: each `step` returns exactly one processed batch (or an idle result)."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self._worker: ThreadPoolExecutor | None = None
        self._inflight: Launched | None = None

    @property
    def has_inflight(self) -> bool:
        return self._inflight is not None

    def step(self, overlap: bool) -> StepResult:
        """Process one batch. With `overlap`, the next batch is scheduled and started first; without it,
        a batch still in flight from an overlapped step is finished before anything new starts."""
        if self._inflight is None:
            if not overlap:
                return self.scheduler.step()
            self._inflight = self._launch()
            if self._inflight is None:
                return self.scheduler.idle()
        batch, future = self._inflight
        self._inflight = self._launch() if overlap else None
        return self.scheduler.process(batch, future.result())

    def _launch(self) -> Launched | None:
        batch = self.scheduler.schedule()
        if batch is None:
            return None
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="minichat-model")
        return batch, self._worker.submit(self.runner.run, batch)
