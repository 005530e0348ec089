"""CPU threads on a shared machine (engine/threads.py): the governor's choices on scripted timings, the
OpenMP wait setting reaching the engine process and its tensor-parallel workers, and a real competing
process making the governor shrink the team while the output stays token-exact."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.service.launcher import start
from engine.threads import (
    BACKOFF_S,
    TRIAL_SPACING,
    TRIAL_STEPS,
    ThreadGovernor,
    prepare_openmp,
    usable_cores,
    wait_policy,
)

DECODE = ("decode", 6)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def drive(gov: ThreadGovernor, clock: Clock, cost: dict[int, float], steps: int, dt: float = 0.01) -> list[int]:
    """Run `steps` steps whose time per token depends only on the team size; the sizes used, in order."""
    used = []
    for _ in range(steps):
        n = gov.threads(DECODE)
        used.append(n)
        gov.record(DECODE, cost[n], dt)
        clock.now += dt
    return used


def test_governor_keeps_the_team_when_a_smaller_one_is_slower() -> None:
    clock = Clock()
    gov = ThreadGovernor(2, clock)
    used = drive(gov, clock, {2: 1.0, 1: 1.8}, steps=2000)  # 20 s
    assert gov.current == 2 and gov.switches == 0
    trials = [i for i, n in enumerate(used) if n == 1]
    assert trials, "it never tried the smaller team"
    gaps = [b - a for a, b in itertools.pairwise(trials)]  # each trial one step: it lost at once
    assert min(gaps) >= int(BACKOFF_S[0] / 0.01) and gaps == sorted(gaps), "retries back off"


def test_governor_shrinks_beside_a_competitor_and_grows_back_when_it_leaves() -> None:
    clock = Clock()
    gov = ThreadGovernor(2, clock)
    drive(gov, clock, {2: 1.0, 1: 1.7}, steps=500)
    assert gov.current == 2
    contended = {2: 15.0, 1: 1.7}  # a busy neighbour: the two-thread barrier waits for time slices
    used = drive(gov, clock, contended, steps=3 * TRIAL_STEPS)  # noticed at once, not at the next retry
    assert gov.current == 1 and used.count(2) == TRIAL_STEPS  # three slow steps, then it tried one thread
    used = drive(gov, clock, contended, steps=6000)  # a minute beside it: bigger team tried rarely, briefly
    assert gov.current == 1 and used.count(2) <= 8
    drive(gov, clock, {2: 1.0, 1: 1.7}, steps=int(BACKOFF_S[1] / 0.01) + 10)  # it left
    assert gov.current == 2


def test_governor_spaces_trials_of_long_steps() -> None:
    """12 s prefill steps on an idle machine: trials of the smaller team (which loses) are TRIAL_SPACING steps
    apart, not one every backoff (16 s: every other step), so they cost under 5%."""
    clock = Clock()
    gov = ThreadGovernor(2, clock)
    used = drive(gov, clock, {2: 1.0, 1: 1.9}, steps=200, dt=12.0)
    assert gov.current == 2
    assert 1 <= used.count(1) <= 200 // TRIAL_SPACING + 1


def test_governor_judges_only_shapes_it_has_timings_for() -> None:
    clock = Clock()
    gov = ThreadGovernor(2, clock)
    clock.now = 10.0
    prefill = ("prefill", 12)
    assert gov.threads(prefill) == 2  # no timings for this shape yet: no trial
    gov.record(prefill, 0.1, 0.1)
    assert gov.current == 2 and gov.switches == 0


def test_openmp_wait_is_ours_unless_the_user_chose() -> None:
    env: dict[str, str] = {}
    prepare_openmp(env)
    assert "GOMP_SPINCOUNT" in env and wait_policy(env).startswith("spin")
    for chosen in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "0"}):
        env = dict(chosen)
        prepare_openmp(env)
        assert env == chosen


def test_usable_cores_are_physical_cores_in_the_affinity_mask_within_omp_num_threads() -> None:
    assert 1 <= usable_cores({}) <= len(os.sched_getaffinity(0))
    assert usable_cores({"OMP_NUM_THREADS": "1"}) == 1
    assert usable_cores({"OMP_NUM_THREADS": "junk"}) == usable_cores({})


def test_thread_settings_reach_the_engine_and_its_workers(llama_ckpt: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # the user's choice wins over ours
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    handle = start(model=str(llama_ckpt), num_pages=64, max_running_requests=4, threads=2, tensor_parallel_size=2)
    try:
        with handle.client() as client:
            execution = client.info().execution
    finally:
        handle.stop()
    assert execution["threads"] == "rank 0: 1; rank 1: 1 (passive)"
    assert execution["omp_wait"] == "passive"


COMPETED = textwrap.dedent("""
    import json, os, subprocess, sys, time
    os.sched_setaffinity(0, {0, 1})
    spin = "import os, time\\nos.sched_setaffinity(0, {0})\\nend = time.monotonic() + 60\\n" \\
           "while time.monotonic() < end:\\n    pass\\n"
    from engine import LLM, SamplingParams
    llm = LLM(sys.argv[1], max_running_requests=8)
    prompts = [[5 + i, 6, 7, 8] for i in range(8)]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    alone = [o.token_ids for o in llm.generate(prompts, params)]
    competitor = subprocess.Popen([sys.executable, "-c", spin])
    try:
        end = time.monotonic() + 40
        while llm.governor.current == 2 and time.monotonic() < end:
            beside = [o.token_ids for o in llm.generate(prompts, params)]
            assert beside == alone, "the team size changed the output"
    finally:
        competitor.kill()
    print(json.dumps({"current": llm.governor.current, "threads": llm.execution["threads"]}))
""")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0),
                    reason="needs CPUs 0 and 1")
def test_a_busy_neighbour_makes_the_team_shrink(llama_ckpt: Path) -> None:
    """The engine on CPUs 0-1 and a process spinning on CPU 0: the governor moves to one thread (within
    40 s of steps, usually a few), and every generation beside it equals the one before it started."""
    run = subprocess.run([sys.executable, "-c", COMPETED, str(llama_ckpt)], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).parent.parent)
    assert run.returncode == 0, run.stderr[-3000:]
    assert '"current": 1' in run.stdout, run.stdout
