"""The scheduler's read-only snapshot: abort in every state, in sequence and overlapped, checked only
through `LLM.stats()` (queues, slots, pages, counters), never through the scheduler's internals; and
the KV page map the stats carry (engine/pages.py): runs that paint what the pool holds, whose size
follows the requests rather than the pool, with a complete list for each new subscriber."""

from __future__ import annotations

import re
import time
import typing
from pathlib import Path

import pytest
import zmq

from engine import LLM, SamplingParams
from engine.pages import FREE, HELD, LOCKED, paint
from engine.scheduler.snapshot import WAIT_REASONS, PageSnapshot, SchedulerSnapshot, WaitingEntry
from engine.service import protocol
from engine.service.client.core import StatsFeed
from engine.service.publisher import StatsPublisher
from engine.service.registry import Stage
from engine.service.stats import FULL_EVERY, StatsRecorder
from tests.checkpoints import with_eos


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def assert_consistent(snap: SchedulerSnapshot) -> None:
    """What must hold after every step: each page in exactly one state, pages owned only by slot holders,
    and under reserve admission the claims within what admission may still hand out (under optimistic
    admission they may exceed it: the scheduler retracts when a step cannot get its pages)."""
    p = snap.pages
    states, holders = painted(p)
    assert p.free + p.held + p.cached == p.total
    assert [states.count(s.encode()) for s in ".RcL"] == [p.free, p.held, p.cached - p.locked, p.locked]
    assert set(holders) - {""} <= {h for h in snap.slots if h is not None}
    assert {r.rid for r in snap.running} <= set(snap.slots)
    assert not {w.rid for w in snap.waiting} & set(snap.slots)
    assert p.claimed == sum(r.claimed_pages for r in snap.running)
    if snap.admission == "reserve":
        assert p.claimed <= p.free + p.cached - p.locked


def painted(pages: PageSnapshot | protocol.Pages) -> tuple[bytearray, list[str]]:
    """A state and a holder per page, from a complete list of runs."""
    assert pages.complete if isinstance(pages, PageSnapshot) else pages.base > 0
    return paint(pages.total, pages.runs, pages.owners)


def assert_idle(snap: SchedulerSnapshot) -> None:
    p = snap.pages
    assert snap.idle and all(h is None for h in snap.slots)
    assert p.held == p.locked == p.claimed == 0 and p.free + p.cached == p.total


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
    assert target not in snap.slots and target not in painted(snap.pages)[1]
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


def pool_truth(llm: LLM) -> tuple[str, list[str]]:
    """What the allocator and the prefix cache hold, page by page: what the page map must paint."""
    owner, cached = llm.cache.allocator.owner, llm.cache.cached_pages()
    states = "".join(HELD if p in owner else (LOCKED if cached[p] else "c") if p in cached else FREE
                     for p in range(llm.num_pages))
    return states, [owner.get(p, "") for p in range(llm.num_pages)]


def test_page_runs_paint_what_the_pool_holds(llama_ckpt):
    """A real engine with held, cached and locked pages: at every step, a complete snapshot's runs, and the
    stats a client assembles (a complete list, then the changes laid over it), paint exactly what the
    allocator and the prefix cache hold."""
    llm = LLM(str(llama_ckpt), page_size=4, num_pages=64, max_prefill_tokens=8)
    prefix = list(range(1, 13))  # three pages
    llm.generate([prefix + [20, 21, 22, 23, 24]], greedy(2))  # leaves four full pages in the prefix cache
    recorder, feed = StatsRecorder(llm), StatsFeed()
    llm.add_request(prefix + [30, 31, 32], greedy(12))  # matches (and locks) three of them
    llm.add_request(list(range(40, 51)), greedy(12))  # pages of its own, prefilled in two chunks
    kinds, seen = set(), set()
    while llm.has_unfinished():
        truth = pool_truth(llm)
        states, holders = painted(llm.stats().pages)
        assert (states.decode(), holders) == truth
        data = protocol.encode(recorder.snapshot())
        sent = protocol.decode_stats(data).pages
        kinds.add("complete" if sent.base == recorder.seq else "changes")
        stats = feed.take([data])
        assert stats is not None
        states, holders = painted(stats.pages)
        assert (states.decode(), holders) == truth
        seen |= set(truth[0])
        llm.step()
    assert kinds == {"complete", "changes"} and seen == set(".RcL")


def test_stats_size_follows_the_requests_not_the_pool(llama_ckpt):
    """The same requests on a pool of 2,048 pages and on one of 200,000: each snapshot differs by the few
    bytes of its larger numbers (a character per page made it 198,000 bytes)."""
    sizes = []
    for num_pages in (2048, 200_000):
        llm = LLM(str(llama_ckpt), page_size=1, num_pages=num_pages, dtype="bfloat16")
        llm.generate([list(range(1, 30))], greedy(2))  # cached pages
        recorder = StatsRecorder(llm)
        llm.add_request(list(range(1, 20)) + [40, 41], greedy(50))  # locks a cached prefix
        llm.add_request(list(range(60, 90)), greedy(50))
        one = []
        for _ in range(6):
            stats = recorder.snapshot()
            one.append((stats.pages.base == stats.seq, len(protocol.encode(stats))))
            llm.step()
        sizes.append(one)
    small, large = sizes
    assert {complete for complete, _ in small} == {True, False}
    assert all(a[0] == b[0] and abs(a[1] - b[1]) <= 16 for a, b in zip(small, large, strict=True)), sizes


def test_each_new_subscriber_is_sent_every_page(llama_ckpt, tmp_path):
    """Snapshots list the pages that changed since the last complete list, so a subscriber that joins
    late needs a complete one: XPUB reports every subscribe (not only a topic's first), the publisher
    asks for a complete list for each, and the newcomer's client paints every page from what it gets."""
    llm = LLM(str(llama_ckpt), num_pages=64)
    llm.generate([list(range(1, 40))], greedy(2))  # something in the map besides free pages
    recorder = StatsRecorder(llm)
    asked: list[bool] = []

    def build(full: bool) -> protocol.Stats:
        asked.append(full)
        return recorder.snapshot(full)

    ctx = zmq.Context()
    try:
        pub = ctx.socket(zmq.XPUB)
        pub.bind(f"ipc://{tmp_path}/stats")
        publisher = StatsPublisher(pub, build)
        subs, feeds = [], []
        for n in range(2):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"ipc://{tmp_path}/stats")
            subs.append(sub)
            feeds.append(StatsFeed())
            assert pub.poll(5000), f"subscriber {n}'s subscribe was not reported"
            publisher.read_subscriptions()
            complete, deadline = None, time.monotonic() + FULL_EVERY / 2  # not the periodic one: the asked one
            while complete is None and time.monotonic() < deadline:  # within FULL_SPACING of the last one
                publisher.publish(idle=True, force=True)
                assert subs[n].poll(5000)
                complete = feeds[n].take([subs[n].recv()])
                time.sleep(0.02)
            assert complete is not None and painted(complete.pages)[0].decode() == pool_truth(llm)[0]
            publisher.publish(idle=True, force=True)  # the next one lists the changes only
            assert asked[-1] is False and protocol.decode_stats(subs[n].recv()).pages.runs == []
        assert asked.count(True) == 2 and asked[0] is True  # one per subscriber
    finally:
        ctx.destroy(linger=0)


def test_an_aborted_requests_final_in_an_idle_step_is_recorded(llama_ckpt):
    """A request aborted after its first token ends in a Final that an idle step carries (nothing left to run);
    the recorder sees it too, so it holds no request that has ended (it used to keep each such id for good)."""
    llm = LLM(str(llama_ckpt))
    recorder = StatsRecorder(llm)
    rid = llm.add_request([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
    while not (result := llm.step()).outputs:
        recorder.record_step(result)
    recorder.record_step(result)  # its first token: the recorder now follows it
    llm.abort(rid)
    ended = []
    while llm.has_unfinished() or not ended:
        result = llm.step()
        ended += [o for o in result.outputs if o.finished]
        recorder.record_step(result)
    assert [o.rid for o in ended] == [rid] and result.kind == "idle"
    assert not recorder._started


def test_the_scheduler_gives_exactly_the_waiting_reasons_the_protocol_documents(llama_ckpt, tmp_path):
    """Why a request waits has one definition (snapshot.py's WaitReason, which the scheduler's admission
    returns): driven into each, the scheduler gives every one of them and no other; the wire's waiting rows
    are the snapshot's; and docs/protocol.md lists exactly these, besides the server's preparing stages."""
    seen: set[str] = set()

    def steps(llm: LLM, n: int = 2) -> None:
        for _ in range(n):
            seen.update(w.reason for w in llm.stats().waiting)
            llm.step()

    slots = LLM(str(llama_ckpt), max_running_requests=1)  # "slot", and "queue" behind it
    for prompt in ([1, 2, 3], [4, 5], [6]):
        slots.add_request(prompt, greedy(4))
    steps(slots)
    budget = LLM(str(llama_ckpt), max_prefill_tokens=4)  # a long prompt's chunks spend the budget
    budget.add_request(list(range(1, 20)), greedy(4))
    budget.add_request([4, 5], greedy(4))
    steps(budget)
    pages = LLM(str(llama_ckpt), page_size=4, num_pages=8, admission="reserve")
    pages.add_request([1] * 4, greedy(12))  # reserves 4 of 8 pages
    pages.step()
    pages.add_request([2] * 10, greedy(8))  # needs 5
    steps(pages)
    choices = LLM(str(llama_ckpt))  # n choices: the others wait for the first to cache the prompt
    choices.add_request(list(range(1, 40)), SamplingParams(max_tokens=4, n=3))
    steps(choices, 1)
    with LLM(str(llama_ckpt), kv_cache_dir=str(tmp_path)) as first:  # its pages on disk for the next engine
        first.generate([list(range(1, 60))], greedy(1))
    loads = LLM(str(llama_ckpt), kv_cache_dir=str(tmp_path))  # the prefix is found on disk and loads first
    loads.add_request(list(range(1, 60)), greedy(4))
    steps(loads)
    assert seen == set(WAIT_REASONS)

    assert typing.get_type_hints(protocol.Stats)["waiting"] == list[WaitingEntry]
    doc = (Path(__file__).parent.parent / "docs" / "protocol.md").read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| `waiting` |"))
    assert set(re.findall(r'`"([a-z_ ]+)"`', row)) == set(WAIT_REASONS) | set(typing.get_args(Stage))
