"""The scheduler's read-only snapshot: abort in every state, in sequence and overlapped, checked only
through `LLM.stats()` (queues, slots, pages, counters), never through the scheduler's internals."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.scheduler.snapshot import SchedulerSnapshot
from tests.checkpoints import with_eos


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def assert_consistent(snap: SchedulerSnapshot) -> None:
    """What must hold after every step: each page in exactly one state, pages owned only by slot holders,
    and under reserve admission the claims within what admission may still hand out (under optimistic
    admission they may exceed it: the scheduler retracts when a step cannot get its pages)."""
    p = snap.pages
    assert p.free + p.used + p.cached == p.total
    assert p.used == len(p.owners) and p.cached == len(p.cached_pages) and p.locked == sum(p.cached_pages.values())
    assert not set(p.owners) & set(p.cached_pages)
    assert set(p.owners.values()) <= {h for h in snap.slots if h is not None}
    assert {r.rid for r in snap.running} <= set(snap.slots)
    assert not {w.rid for w in snap.waiting} & set(snap.slots)
    assert p.claimed == sum(r.claimed_pages for r in snap.running)
    if snap.admission == "reserve":
        assert p.claimed <= p.free + p.cached - p.locked


def assert_idle(snap: SchedulerSnapshot) -> None:
    p = snap.pages
    assert snap.idle and all(h is None for h in snap.slots)
    assert p.used == p.locked == p.claimed == 0 and p.free + p.cached == p.total


def state_of(snap: SchedulerSnapshot, rid: str) -> str | None:
    if any(w.rid == rid for w in snap.waiting):
        return "waiting"
    return next((r.state for r in snap.running if r.rid == rid), None)


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
@pytest.mark.parametrize("state", ["waiting", "prefilling", "running"])
def test_abort_in_every_state_through_the_snapshot(llama_ckpt, state, overlap):
    llm = LLM(str(llama_ckpt), max_prefill_tokens=6, max_running_requests=1, overlap=overlap)
    first = llm.add_request(list(range(1, 15)), greedy(50))  # three chunks of 6 tokens, then decode
    second = llm.add_request([7, 8, 9], greedy(5))  # waits: one slot only
    target = second if state == "waiting" else first
    deltas = []
    for _ in range(10):
        snap = llm.stats()
        assert_consistent(snap)
        if state_of(snap, target) == state and (state != "running" or snap.running[0].generated > 0):
            break
        deltas += llm.step(overlap).outputs
    else:
        pytest.fail(f"{target} never reached state {state}")
    llm.abort(target)
    snap = llm.stats()
    assert_consistent(snap)
    assert state_of(snap, target) is None and snap.counters.aborted == 1
    deltas += llm.step(overlap).outputs  # a batch in flight that still used its slot has now been processed
    snap = llm.stats()
    assert_consistent(snap)
    assert target not in snap.slots and target not in snap.pages.owners.values()
    while llm.has_unfinished():
        deltas += llm.step(overlap).outputs
        assert_consistent(llm.stats())
    mine = [d for d in deltas if d.rid == target]
    assert mine[-1].finish_reason == "abort" and all(not d.finished for d in mine[:-1])
    other = [d for d in deltas if d.rid != target]
    assert other[-1].finish_reason == "length" and sum(len(d.token_ids) for d in other) == (5 if target == first
                                                                                             else 50)
    snap = llm.stats()
    assert_idle(snap)
    assert snap.counters.aborted == 1 and snap.counters.finished == 1
    with pytest.raises(ValueError, match="unknown request id"):
        llm.abort(target)


def test_request_finished_by_eos_while_the_next_step_runs_keeps_its_pages_until_then(llama_ckpt, tmp_path):
    """Overlap: step N+1 is scheduled before step N's EOS is seen; its extra token is dropped, and the
    slot and pages stay held until N+1 has run, then are freed."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    free_run = LLM(str(llama_ckpt)).generate([prompt], greedy(8))[0].token_ids
    eos = free_run[2]
    stop_at = free_run.index(eos)
    llm = LLM(str(with_eos(llama_ckpt, tmp_path / "eos", [eos])), overlap=True)
    rid = llm.add_request(prompt, SamplingParams(max_tokens=8))
    deltas = []
    while llm.has_unfinished():
        result = llm.step(True)
        deltas += result.outputs
        snap = llm.stats()
        assert_consistent(snap)
        if rid in result.finished:
            assert snap.inflight_batches == 1 and rid in snap.slots  # the step scheduled past EOS still runs
    assert [t for d in deltas for t in d.token_ids] == free_run[: stop_at + 1]
    assert deltas[-1].finish_reason == "stop" and sum(d.finished for d in deltas) == 1
    assert_idle(llm.stats())
