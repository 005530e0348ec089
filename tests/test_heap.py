"""The engine's heap trimmer (engine/heap.py): glibc's malloc_trim is found on Linux, and it runs at most every
TRIM_EVERY seconds and only after work, so an idle engine does nothing."""

from __future__ import annotations

import sys

import pytest

from engine.heap import HeapTrimmer


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")
def test_trims_only_after_work_and_at_most_every_interval():
    now = [100.0]
    heap = HeapTrimmer(every=30.0, clock=lambda: now[0])
    assert heap.available
    now[0] += 60
    assert not heap.maybe_trim(worked=False)  # nothing done since start: nothing to give back
    assert heap.maybe_trim(worked=True) and heap.trims == 1
    now[0] += 10
    assert not heap.maybe_trim(worked=True)  # too soon after the last
    now[0] += 25
    assert heap.maybe_trim(worked=False)  # the work 25 s ago counts
    now[0] += 100
    assert not heap.maybe_trim(worked=False) and heap.trims == 2  # idle since: no trim
