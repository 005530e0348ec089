"""CPU compute threads on a shared machine: how many a step uses, chosen by what measures faster.

torch's intra-op pool and the C kernels share one libgomp team, and every parallel region ends at a
barrier. On an idle machine the whole team is fastest, and libgomp's default wait (spin ~300k times,
then sleep) beats a passive one. Beside any other busy process the same team collapses: one thread
is descheduled for a time slice and the region waits for it, while its team mates spin. Measured on
the 2-core machine with docs/benchmarks.md's serving bench (demo model): 6,400 output tok/s idle with
2 spinning threads, ~300 beside one busy process; one thread gives ~4,500 in both cases. Neither fixed choice is
right, and the runqueue-wait counters cannot tell a busy neighbour from the bench client's bursts; the
step time can, so `ThreadGovernor` tries the neighbouring team size now and then and keeps what is faster.

Nothing here imports torch: `prepare_openmp` must run before libgomp loads.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from collections.abc import Callable, MutableMapping

WAIT_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
SPIN_COUNT = "300000"  # libgomp's own default, made explicit so reports say what ran (see above)
SAMPLES = 16  # recent steps per shape kept for the team size in use
TRIAL_STEPS = 3  # steps a trial of another team size runs when it is not clearly worse at once
BETTER = 0.9  # a trial whose median time per token is below this fraction of the current one wins
WORSE = 1.5  # a trial step this much slower than the current median ends the trial at once
BACKOFF_S = (2.0, 16.0)  # the wait before retrying a team size that lost: doubling from the first to the second
TRIAL_SPACING = 20  # and at least this many of the shape's steps' durations since the last trial ended

Shape = tuple[str, int]  # a step's kind and its token count's order of magnitude (bit length)


class ThreadGovernor:
    """The team size for each step, chosen by what measures faster here and now.

    It runs at `current` and now and then tries a neighbour (one thread fewer or more, alternately) on a
    step whose shape (kind, token count to a power of two) it has recent timings for at `current`. A
    trial step 1.5x slower than that ends the trial at once: under a competing process, trying the
    bigger team costs one slow step. A trial that is 10% faster over TRIAL_STEPS steps becomes current.
    A size that lost is retried after 2 s, doubling to 16 s, so a lasting competitor costs one slow step
    every 16 s and one that leaves is noticed within that; a team that turns 1.5x slower for
    TRIAL_STEPS steps in a row (a competitor arrived) has its neighbour tried at once. Trials are also
    TRIAL_SPACING steps of their shape apart at least: with the backoff alone, a 12 s prefill step was tried on
    half the team every 16 s (every other step); spaced so, a lost trial costs under 5%.

    The runner asks `threads(shape)` before a step and reports `record(shape, seconds per token, seconds)`
    after.
    """

    def __init__(self, limit: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.current = limit
        self.switches = 0
        self._clock = clock
        self._recent: dict[Shape, deque[float]] = {}
        self._trial: int | None = None
        self._trial_ratios: list[float] = []  # a trial step's time per token over the current size's median
        self._slow: list[float] = []  # consecutive steps much slower than the team's median
        self._downward = True
        self._retry_at = clock() + BACKOFF_S[0]
        self._backoff = {n: BACKOFF_S[0] for n in range(1, limit + 1)}
        self._durations: dict[Shape, deque[float]] = {}  # recent step seconds per shape, for the spacing
        self._trial_ended = clock()
        self._urgent = False  # the team turned slower: try the neighbour now, however long the steps

    def threads(self, shape: Shape) -> int:
        """The team size for a step of this shape."""
        now = self._clock()
        durations = self._durations.get(shape)
        spaced = self._urgent or (durations is not None and
                                  now - self._trial_ended >= TRIAL_SPACING * statistics.median(durations))
        if self._trial is None and self.limit > 1 and now >= self._retry_at and spaced \
                and len(self._recent.get(shape, ())) >= TRIAL_STEPS:
            self._trial = self._neighbour()
            self._trial_ratios = []
            self._urgent = False
        return self._trial if self._trial is not None else self.current

    def record(self, shape: Shape, per_token: float, seconds: float) -> None:
        """How long a step took per token and in all, at the team size `threads` gave it."""
        self._durations.setdefault(shape, deque(maxlen=SAMPLES)).append(seconds)
        if self._trial is None:
            recent = self._recent.setdefault(shape, deque(maxlen=SAMPLES))
            if len(recent) >= TRIAL_STEPS and per_token > WORSE * statistics.median(recent):
                self._slow.append(per_token)
            else:
                self._slow.clear()
            recent.append(per_token)
            if len(self._slow) >= TRIAL_STEPS:  # the team got slower: something else wants the cores
                recent.clear()
                recent.extend(self._slow)  # judge the neighbour against the team as it is now
                self._slow.clear()
                self._retry_at = self._clock()
                self._urgent = True
                self._backoff = dict.fromkeys(self._backoff, BACKOFF_S[0])
            return
        baseline = self._recent.get(shape)
        if not baseline:  # a shape the current size has no timings for: no verdict
            self._trial = None
            return
        ratio = per_token / statistics.median(baseline)
        self._trial_ratios.append(ratio)
        if ratio > WORSE:
            self._end_trial(won=False)
        elif len(self._trial_ratios) >= TRIAL_STEPS:
            self._end_trial(won=statistics.median(self._trial_ratios) < BETTER)

    def _neighbour(self) -> int:
        self._downward = not self._downward if 1 < self.current < self.limit else self.current == self.limit
        return self.current - 1 if self._downward else self.current + 1

    def _end_trial(self, won: bool) -> None:
        tried, self._trial = self._trial, None
        self._trial_ended = self._clock()
        assert tried is not None
        if won:
            self.current, self.switches = tried, self.switches + 1
            self._recent.clear()
            self._backoff = dict.fromkeys(self._backoff, BACKOFF_S[0])
            self._retry_at = self._clock() + BACKOFF_S[0]
        else:
            self._retry_at = self._clock() + self._backoff[tried]
            self._backoff[tried] = min(2 * self._backoff[tried], BACKOFF_S[1])


def prepare_openmp(environ: MutableMapping[str, str] = os.environ) -> None:
    """The OpenMP wait for this process and its children, unless the user set a wait policy or spin count.
    Must run before libgomp loads (before torch is imported here)."""
    if not any(name in environ for name in WAIT_ENV):
        environ["GOMP_SPINCOUNT"] = SPIN_COUNT


def wait_policy(environ: MutableMapping[str, str] = os.environ) -> str:
    """How the OpenMP threads of a process started with `environ` wait, for reports."""
    if "GOMP_SPINCOUNT" in environ:
        return f"spin {environ['GOMP_SPINCOUNT']}, then sleep"
    return environ.get("OMP_WAIT_POLICY", "libgomp default (spin, then sleep)").lower()


def usable_cores(environ: MutableMapping[str, str] = os.environ) -> int:
    """The physical cores among the CPUs this process may run on (its affinity mask, which containers and
    taskset narrow; SMT siblings share a core's GEMM units, so torch counts cores too), at most
    OMP_NUM_THREADS when the user set it."""
    cpus = os.sched_getaffinity(0)
    cores = set()
    for cpu in cpus:
        topology = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{topology}/physical_package_id") as package, open(f"{topology}/core_id") as core:
                cores.add((package.read().strip(), core.read().strip()))
        except OSError:
            cores.add((str(cpu), ""))  # no topology: count the CPU as its own core
    limit = environ.get("OMP_NUM_THREADS", "").split(",")[0]
    return min(len(cores), int(limit)) if limit.isdigit() and int(limit) > 0 else len(cores)

