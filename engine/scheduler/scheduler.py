"""The scheduler's three phases: `schedule()` -> ForwardBatch, (the runner's `run`), `process()` -> StepResult.

`step()` is the body of the seed's `normal_loop`, the three in sequence, minus message receiving
(the server does that between steps). `schedule()` decides who runs (`_prefill_first`, the seed's
"prefill first, else decode"), and engine/scheduler/batch_builder.py builds the step's tensors from
that decision. The overlap loop (engine/loop.py) calls `schedule()` for step N+1 before `process()`
of step N, so scheduling works only from what it decided itself (`cached_len`, `sampled`), never from
tokens the host has not seen yet. Every way a request can end -- EOS, length, stop string, abort --
goes through `_finish`. Resources have one cleanup path, `_release` (slot back to the table, pages to
the cache manager): `_finish` reaches it once no scheduled batch still uses the request, and so does
a retraction (`_retract`).

Retraction (optimistic admission, engine/scheduler/admission.py): when the running set's next tokens
need more pages than are free or evictable, running requests go back to the front of the waiting
queue in `PrefillManager.retraction_order` (admission's order reversed: latest arrival first, under
the priority policy lowest priority first). Their written pages go to the prefix cache, so their next
admission recomputes only what was evicted meanwhile, and they keep their output and seed: a
retracted request samples exactly the tokens it would have. A retraction happens only with no batch
in flight (a batch in flight still writes the victims' pages); until then `schedule()` returns None,
and the step loop processes the batch in flight first.

Log-probabilities: a prompt asking for its own (`prompt_logprobs`) adds the logits rows of its
positions to the step's, kept in position order; `process` turns the runner's numbers into
`TokenLogprob`s. The `n` choices of a request (engine/request.py's Group) are requests of their own
that share the leader's prompt pages through the prefix cache once the leader has scheduled them.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable

import msgspec

from engine.batch import ForwardBatch, ForwardOutput
from engine.config import EngineConfig
from engine.kv.cache import CacheManager, PrefixMatch
from engine.kv.table import RequestTable
from engine.outputs import Delta, Output, StepResult, TokenLogprob
from engine.pages import PageMap
from engine.reasoning import Part
from engine.request import Group, Req, ReqState
from engine.runner import ModelRunner
from engine.sampling import Forcing, Grammars, Logprobs
from engine.scheduler.admission import Admission
from engine.scheduler.batch_builder import Plan, build_batch
from engine.scheduler.budget import pages_for
from engine.scheduler.decode import DecodeManager
from engine.scheduler.prefill import PrefillManager
from engine.scheduler.snapshot import (
    PROMPT_ENDS,
    PageSnapshot,
    RequestDetail,
    RunningEntry,
    SchedulerCounters,
    SchedulerSnapshot,
    Speculation,
    WaitingEntry,
)
from engine.speculative.speculator import Speculator, accepted
from engine.structured import GrammarCompiler

log = logging.getLogger(__name__)
GRAMMAR_WAIT = 60.0  # seconds a step's sampler waits for the previous step's processing before giving up
KV_WAIT = 0.01  # seconds a step with nothing to run waits for a KV load's reads (rather than spin)


class Scheduler:
    """`runner` runs the batches `step()` schedules; `schedule()` and `process()` alone need no model.
    `config`: the engine's scheduling knobs (max_prefill_tokens, mixed_batches, admission, schedule_policy,
    max_wait_steps, max_consecutive_prefills); the KV page size is the cache's."""

    def __init__(self, runner: ModelRunner | None, cache: CacheManager, table: RequestTable, eos_ids: set[int],
                 config: EngineConfig, token_text: Callable[[int], str] = str,
                 speculator: Speculator | None = None, kv_window: int | None = None) -> None:
        self.runner = runner
        self.speculator = speculator  # drafts for running requests to verify (engine/speculative); None: off
        self.kv_window = kv_window  # every layer attends within this many positions (ModelSpec.kv_window)
        self.token_text = token_text  # a token id's text, for log-probabilities
        self.mixed_batches = config.mixed_batches
        self.cache = cache
        self.table = table
        self.page_size = cache.page_size
        self.prefill_budget = config.max_prefill_tokens
        self.eos_ids = eos_ids
        self.admission = Admission(config.admission, self.page_size)
        self.policy = config.schedule_policy
        self.max_consecutive_prefills = config.max_consecutive_prefills
        self.prefill_manager = PrefillManager(table, cache, self.admission, self.policy, config.max_wait_steps)
        self.decode_manager = DecodeManager()
        self.reqs: dict[str, Req] = {}
        self.groups: dict[str, Group] = {}  # requests with n > 1, by the client's rid
        self.grammar: GrammarCompiler | None = None  # set by the engine once a request asks for structure
        self._processed = threading.Condition()  # batches processed so far (`_processed_count`), for grammars
        self._processed_count = 0
        self._scheduled_count = 0
        self._pending: list[Output] = []
        self._unreleased: set[Req] = set()  # finished, but a batch in flight still uses their slot/pages
        self._prefill_streak = 0  # prefill-only steps in a row while running requests waited
        self.inflight_batches = 0
        self.pages: PageMap | None = None  # what each KV page is, for snapshots (made by the first one)
        self.counters = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "finished": 0, "aborted": 0,
                         "retractions": 0, "spec_drafts": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0}
        self._propose_time = 0.0  # of the step being scheduled, seconds the proposer took

    # -- public -----------------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        req.arrival_step = self.counters["steps"]
        self.reqs[req.rid] = req
        if req.group is not None:
            self.groups[req.group.rid] = req.group
        self.prefill_manager.add_one_req(req)

    @property
    def runnable(self) -> bool:
        return self.prefill_manager.runnable or self.decode_manager.runnable

    @property
    def num_waiting(self) -> int:
        return len(self.prefill_manager.waiting)

    def has_unfinished(self) -> bool:
        """Live requests, undelivered deltas, or batches in flight (whose frees are still to come)."""
        return bool(self.reqs) or bool(self._pending) or self.inflight_batches > 0

    def abort(self, rid: str) -> bool:
        """Abort in any state (every open choice of a group); False if the request is unknown or finished."""
        group = self.groups.get(rid)
        reqs = group.open if group is not None else [r for r in (self.reqs.get(rid),) if r is not None]
        for req in reqs:
            self._finish(req, "abort")
        return bool(reqs)

    def watch_pages(self) -> set[int]:
        """A set each snapshot from now on adds the pages whose state changed to; its holder empties it,
        and gives it to `snapshot` to have only those pages listed."""
        return self._page_map().watch()

    def _page_map(self) -> PageMap:
        """Made at the first snapshot: until then nobody asks, and the allocator notes nothing."""
        if self.pages is None:
            self.pages = PageMap(self.cache)
        return self.pages

    def snapshot(self, changed: set[int] | None = None) -> SchedulerSnapshot:
        """A read-only picture of queues, slots, pages and counters (see engine/scheduler/snapshot.py):
        every page, or with `changed` (from `watch_pages`) only those."""
        alloc = self.cache.allocator
        page_map = self._page_map()
        page_map.refresh()
        runs, owners = page_map.runs(changed)
        held = len(alloc.owner)
        cached = alloc.num_pages - alloc.num_free - held
        admitted = sorted(((r, r.slot) for r in self.reqs.values() if r.slot is not None), key=lambda a: a[0].uid)
        running = tuple(
            RunningEntry(rid=r.rid, client=r.client, slot=slot,
                         state="prefilling" if r.state is ReqState.PREFILLING else "running",
                         prompt_tokens=r.input_len, prefilled=min(r.cached_len, r.input_len),
                         generated=len(r.output_ids), max_tokens=r.max_output, pages=len(r.pages),
                         claimed_pages=self.admission.claim(r), priority=r.params.priority,
                         retractions=r.retractions, spec=_speculation(r))
            for r, slot in admitted)
        pages = PageSnapshot(page_size=self.page_size, total=alloc.num_pages, free=alloc.num_free, held=held,
                             cached=cached, locked=cached - self.cache.evictable_size,
                             claimed=sum(e.claimed_pages for e in running), runs=tuple(runs), owners=tuple(owners),
                             complete=changed is None, tiers=tuple(self.cache.tier_use()))
        now = time.monotonic()
        waiting = tuple(WaitingEntry(rid=r.rid, client=r.client, prompt_tokens=r.input_len, waited=now - r.arrival_time,
                                     reason=self.prefill_manager.reason(r), priority=r.params.priority,
                                     retractions=r.retractions, generated=len(r.output_ids))
                        for r in self.prefill_manager.ordered(self.counters["steps"]))
        return SchedulerSnapshot(waiting=waiting, running=running, slots=tuple(self.table.holder), pages=pages,
                                 counters=SchedulerCounters(**self.counters, **{
                                     f"hit_tokens_{tier}": n for tier, n in self.prefill_manager.hit_tokens.items()}),
                                 inflight_batches=self.inflight_batches,
                                 admission=self.admission.describe(), policy=self.policy)

    def describe(self, rid: str, text_from: int = 0) -> RequestDetail[tuple[int, ...]] | None:
        """One live request in detail (see RequestDetail), by the client's rid or a choice's own; None
        when it is not live. Costs O(PROMPT_ENDS) plus the output text from `text_from` on."""
        req = self.reqs.get(rid)
        if req is None and (group := self.groups.get(rid)) is not None and group.open:
            req = group.open[0]
        if req is None:
            return None
        waiting = req.state is ReqState.WAITING
        text = req.detokenizer.text[:req.detokenizer.emitted] if req.detokenizer is not None else ""
        ends = PROMPT_ENDS
        return RequestDetail(
            rid=req.client_rid, client=req.client, state=req.state.value,
            reason=self.prefill_manager.reason(req) if waiting else "", params=req.params,
            prompt_tokens=req.input_len, prompt_head=tuple(req.input_ids[:ends]),
            prompt_tail=tuple(req.input_ids[-ends:]) if req.input_len > 2 * ends else (),
            cached_tokens=req.prefix_len, host_tokens=req.host_tokens, disk_tokens=req.disk_tokens, slot=req.slot,
            pages=len(req.pages),
            claimed_pages=0 if waiting else self.admission.claim(req), generated=len(req.output_ids),
            max_tokens=req.max_output, retractions=req.retractions, choices=req.params.n,
            age=time.monotonic() - req.arrival_time, ttft=req.ttft,
            queue=None if req.admit_time is None else req.admit_time - req.arrival_time,
            output=text[max(0, text_from):], output_chars=len(text), spec=_speculation(req))

    def step(self) -> StepResult:
        """One step in sequence: schedule, run, process."""
        assert self.runner is not None, "step() runs batches: give the scheduler a runner"
        batch = self.schedule()
        if batch is None:
            return self.idle()
        return self.process(batch, self.runner.run(batch))

    def idle(self) -> StepResult:
        """The result of a step with nothing to run (it still carries aborts' final deltas). Requests waiting only
        for their KV to load from disk would have the loop spin: it waits for a read (KV_WAIT at most) first."""
        if self.cache.loading:
            self.cache.wait_loads(KV_WAIT)
        return self._result(StepResult(kind="idle"))

    def write_behind(self) -> bool:
        """At idle (every batch processed): write down the final KV pages that waited for room in the disk tier's
        staging ring; True while some still wait."""
        if self.cache.unstaged:
            self.cache.processed(self._processed_count)
        return self.cache.unstaged

    # -- schedule ---------------------------------------------------------------------------------
    def schedule(self) -> ForwardBatch | None:
        """The next batch, or None when there is nothing to run: decide who runs (`_prefill_first`),
        claim their KV pages, build the tensors and attention metadata (`build_batch`), commit.

        Before anyone is admitted, the running set's next tokens get their pages (`_make_room`):
        retracting requests if need be (see the module docstring), or returning None while a batch in
        flight holds pages they need."""
        start = time.perf_counter()
        self._propose_time = 0.0
        self.cache.scheduling(self._scheduled_count + 1)
        self.cache.poll_loads()  # pages loaded since the last step join the prefix cache, for their requests
        plan = self._prefill_first() if self._make_room() else None
        if plan is None:
            return None
        self._allocate_kv(plan.reqs)
        batch = build_batch(plan, self.table, self.eos_ids)
        self._scheduled_count += 1
        self._attach_grammars(batch)
        self._attach_forcing(batch)
        self._commit(batch)
        batch.schedule_time = time.perf_counter() - start
        batch.propose_time = self._propose_time
        return batch

    def _prefill_first(self) -> Plan | None:
        """The seed's rule (its `_schedule_next_batch`): a prefill batch whenever one can be formed,
        else decode the running set; None when neither has anyone.

        With `mixed_batches` (the default) the running requests ride along in a prefill step, one
        decode token each ahead of the prompt tokens ("mixed"), so a request arriving never stalls the
        ones already generating (and the weights are read once for both). Without, the step is prefill
        only, as in the seed, or decode, and `_decode_due` bounds the prefill-only steps in a row.

        With a proposer, decoding requests may carry drafts to verify (`_propose`): in a mixed step they are
        proposed before admission, which then counts their tokens and pages; without mixed batches, only in
        a decode step."""
        running = list(self.decode_manager.running.values())
        decoding = self.decode_manager.schedule_next_batch() or []  # arrival order, one token each
        drafts: dict[Req, list[int]] = {}
        if self.mixed_batches:
            decoding, drafts = self._propose(decoding)
            prefill = self._admit(running, decoding, drafts)
        else:
            prefill = None if self._decode_due(running) else self._admit(running, decoding, drafts)
            if prefill is None:
                decoding, drafts = self._propose(decoding)
        decode = decoding if prefill is None or self.mixed_batches else []
        if not prefill and not decode:
            return None
        self._prefill_streak = self._prefill_streak + 1 if not decode and running else 0
        return Plan(decode=[r for r in decode if r not in drafts], prefill=prefill or [],
                    verify={r: drafts[r] for r in decode if r in drafts})

    def _decode_due(self, running: list[Req]) -> bool:
        """Without mixed batches, running requests that sat out `max_consecutive_prefills` prefill steps
        in a row decode now, however many requests wait."""
        return bool(running) and not self.mixed_batches and self._prefill_streak >= self.max_consecutive_prefills

    def _admit(self, running: list[Req], decoding: list[Req], drafts: dict[Req, list[int]]) -> list[Req] | None:
        """The waiting requests that fit beside the running set (PrefillAdder's three limits); None if
        none. The running set's claims (with this step's drafts) count against the KV estimate, and in a
        mixed step the decoding requests' tokens against the token budget (the prompts get what is left)."""
        if not self.prefill_manager.runnable:
            return None
        budget = self.prefill_budget - (sum(r.extend_len for r in decoding) if self.mixed_batches else 0)
        claimed = sum(max(self.admission.claim(r), self._next_pages(r, 1 + len(drafts.get(r, ())))) for r in running)
        return self.prefill_manager.schedule_next_batch(budget, claimed, self.counters["steps"])

    def _propose(self, decoding: list[Req]) -> tuple[list[Req], dict[Req, list[int]]]:
        """The requests decoding this step and the drafts some of them verify (engine/speculative), each cut
        where its grammar forbids a draft or the free pages end; requests sitting this step out (overlap: see
        `Speculator.plan`) are left out."""
        if self.speculator is None or not decoding:
            return decoding, {}
        start = time.perf_counter()
        drafts, resting = self.speculator.plan(decoding, len(decoding))
        room = self.cache.available_size - sum(self._next_pages(r) for r in self.decode_manager.running.values())
        kept: dict[Req, list[int]] = {}
        for req, proposal in drafts.items():
            count = _draftable(req, proposal)
            while count and self._next_pages(req, 1 + count) - self._next_pages(req) > room:
                count -= 1
            room -= self._next_pages(req, 1 + count) - self._next_pages(req)
            if count:
                kept[req] = self.speculator.cut(req, proposal, count)
                req.extend_len = 1 + count
            else:
                self.speculator.cut(req, proposal, 0)
        self._propose_time = time.perf_counter() - start
        return [r for r in decoding if r not in resting], kept

    def _attach_grammars(self, batch: ForwardBatch) -> None:
        """Grammar masks for the rows that sample under one; the step's sampler waits (`_wait_processed`)
        until the previous step's tokens are accepted into them. A request verifying drafts has nothing in
        flight: its rows are filled now, each as if the drafts before it were accepted."""
        sampled = batch.sampled_reqs
        if self.grammar is None or all(r.grammar is None for r in sampled):
            return
        grammars = Grammars([r.grammar for r in sampled], self.grammar.allocate_bitmask(len(sampled)),
                            functools.partial(self._wait_processed, self._scheduled_count - 1))
        for row, (index, req) in enumerate(zip(batch.sample_rows, sampled, strict=True)):
            drafts = batch.drafts.get(index)
            if drafts is None or req.grammar is None:
                continue
            if row == 0 or batch.sample_rows[row - 1] != index:  # the request's first row
                req.grammar.fill_ahead(grammars.bitmask, row, drafts)
            grammars.matchers[row] = None
            grammars.filled.append(row)
        batch.sampling.grammars = grammars

    def _attach_forcing(self, batch: ForwardBatch) -> None:
        """The rows whose request may have to emit a given token next (a think block whose budget may be
        spent by then: `ThinkBlock.may_force`); which do, and what, is read at sampling time, once the
        previous step's tokens are processed (`_wait_processed`), as for grammars."""
        rows = [(row, r.think) for row, r in enumerate(batch.sampled_reqs)
                if r.think is not None and r.think.may_force(r.sampled)]
        if rows:
            batch.sampling.forcing = Forcing(rows, functools.partial(self._wait_processed, self._scheduled_count - 1))

    def _commit(self, batch: ForwardBatch) -> None:
        """Advance the batch's requests as if it had run, so the next schedule (in the overlap loop,
        before this batch is processed) starts where this one ends: prompt positions scored,
        `cached_len`, `inflight`, a group leader's prompt shared, `sampled`, and the running set (a
        request whose length budget is now spent leaves it)."""
        for row, count in batch.prompt_rows:
            batch.reqs[row].scored += count
        for req in batch.reqs:
            req.cached_len += req.extend_len
            req.inflight += 1
            self._share_prompt(req)
        sampled = batch.sampled_reqs
        for req in sampled:
            req.sampled += 1
        self.decode_manager.filter_reqs([r for i, r in zip(batch.sample_rows, sampled, strict=True)
                                         if i not in batch.drafts])
        for index in batch.drafts:  # back in the running set once its verification is processed
            self.decode_manager.remove_req(batch.reqs[index])
        self.inflight_batches += 1

    def _share_prompt(self, req: Req) -> None:
        """A group's leader whose prompt is now cached shares it: its siblings, held until then
        (`Req.held`), match it instead of computing it again."""
        group = req.group
        if group is not None and req.index == 0 and not group.shared and req.cached_len >= req.input_len:
            req.prefix = self.cache.share(req.input_ids, req.pages, req.prefix)
            group.shared = True

    def _next_pages(self, req: Req, tokens: int = 1) -> int:
        """New pages a running request needs for its next `tokens` query tokens (its next token and drafts)."""
        return max(0, pages_for(req.cached_len + tokens, self.page_size) - len(req.pages))

    def _drop_loads(self) -> None:
        """Waiting requests' KV loads from the tiers give their pages back (a request loads again when it is next
        considered): running requests' next tokens come before a waiting prefix, and retracting a running request
        for pages a waiting one holds would retract the last one in a tight pool."""
        for req in self.reqs.values():
            if req.slot is None and req.loading is not None:
                self.cache.cancel_load(req.loading)
                req.loading = None

    def _make_room(self) -> bool:
        """Free or evictable pages for every running request's next token, retracting requests until
        there are; False (and nothing changed) while a batch in flight still holds pages."""
        need = sum(self._next_pages(r) for r in self.decode_manager.running.values())
        if need <= self.cache.available_size:
            return True
        self._drop_loads()
        if need <= self.cache.available_size:
            return True
        if self.inflight_batches:
            return False
        victims = self.prefill_manager.retraction_order(
            r for r in self.reqs.values() if r.slot is not None and r.state is not ReqState.FINISHED)
        while need > self.cache.available_size:
            if len(victims) <= 1:  # cannot happen: a prompt that fits the pool alone is refused at submission
                raise RuntimeError(f"KV pool of {self.cache.allocator.num_pages} pages cannot hold one request")
            victim = victims.pop(0)
            if victim.rid in self.decode_manager.running:
                need -= self._next_pages(victim)
            self._retract(victim)
        return True

    def _retract(self, req: Req) -> None:
        """Back to the front of the waiting queue, holding nothing; its written pages go to the cache."""
        self.decode_manager.remove_req(req)
        self.prefill_manager.remove_req(req)
        self._release(req)
        req.cached_len, req.extend_len, req.prefix = 0, 0, PrefixMatch()
        req.state = ReqState.WAITING
        req.retractions += 1
        self.counters["retractions"] += 1
        self.admission.retracted()
        self.prefill_manager.put_back(req)

    def _allocate_kv(self, reqs: list[Req]) -> None:
        """Claim pages for the positions this step writes (room was made for them, so this cannot fail), after
        giving back those a sliding window has passed."""
        ps = self.page_size
        for req in reqs:
            if self.kv_window is not None:
                self._release_outside_window(req, self.kv_window)
            need = pages_for(req.cached_len + req.extend_len, ps) - len(req.pages)
            if need <= 0:
                continue
            new = self.cache.allocate(need, req.rid)
            assert req.slot is not None  # a scheduled request holds a slot
            self.table.write_pages(req.slot, len(req.pages), new, ps)
            req.pages += new

    def _release_outside_window(self, req: Req, window: int) -> None:
        """Give the cache the request's pages that every layer's window has passed: this step's first query
        (position cached_len) reads keys from cached_len - window + 1 on, and later ones read later keys. The pages
        keep their places in `req.pages`; the request's prefix match covers them now (CacheManager.release_front).
        A batch still in flight may write them, but runs before any step that could reuse them."""
        passed = min(req.cached_len - window + 1, req.total_len) // self.page_size
        if passed > len(req.prefix.pages):
            req.prefix = self.cache.release_front(req.tokens(0, passed * self.page_size), req.pages, req.prefix)

    # -- process ----------------------------------------------------------------------------------
    def process(self, batch: ForwardBatch, output: ForwardOutput) -> StepResult:
        """Append each sampled token, detokenise, finish (EOS, stop string, length) and free.

        A request that finished after this batch was scheduled (EOS seen in the previous step, or an
        abort) drops its token here; its slot and pages are released once no batch uses them."""
        start = time.perf_counter()
        tokens = output.tokens()
        self.inflight_batches -= 1
        for req in batch.reqs:
            req.inflight -= 1
        self._collect_prompt_logprobs(batch, output.prompt_logprobs)
        logprobs = self._token_logprobs(batch, tokens, output.logprobs)
        generated = accepted_drafts = 0  # tokens the decoding requests' rows kept; drafts accepted
        for index, rows in _runs(batch.sample_rows):
            req, drafts = batch.reqs[index], batch.drafts.get(index)
            if drafts is not None:
                kept = self._verify(req, drafts, [tokens[row] for row in rows])
                accepted_drafts += kept
                rows = rows[: kept + 1]
            if index < batch.num_decode or drafts is not None:
                generated += len(rows)
            for row in rows:
                if req.state is ReqState.FINISHED:
                    break
                self._append_token(req, tokens[row], logprobs.get(row))
            if drafts is not None and req.state is not ReqState.FINISHED:
                self.decode_manager.filter_reqs([req])
        for req in batch.reqs:
            if req in self._unreleased and req.inflight == 0:
                self._release(req)
        with self._processed:
            self._processed_count += 1
            self._processed.notify_all()
        self.cache.processed(self._processed_count)  # what it wrote is final: the tiers may copy it
        self.counters["steps"] += 1
        decode_queries = batch.num_decode + batch.num_verify_tokens
        if decode_queries:
            self.admission.decoded()
        self.counters["decode_tokens"] += generated
        self.counters["prefill_tokens"] += batch.num_tokens - decode_queries
        duration = batch.schedule_time + output.run_time + time.perf_counter() - start
        if self.speculator is not None and decode_queries == batch.num_tokens:
            self.speculator.record_step(batch.num_tokens, duration - batch.propose_time)
        return self._result(StepResult(
            kind=batch.kind, rids=[r.rid for r in batch.reqs], num_tokens=batch.num_tokens, duration=duration,
            num_decode_tokens=generated, num_prefill_tokens=batch.num_tokens - decode_queries,
            num_draft_tokens=sum(len(d) for d in batch.drafts.values()), num_accepted_tokens=accepted_drafts))

    def _verify(self, req: Req, drafts: list[int], sampled: list[int]) -> int:
        """How many of `req`'s drafts its rows' samples accept (engine/speculative/speculator.py); the rest are
        rolled back: their positions leave `cached_len` and `sampled`, pages holding only them are freed."""
        kept = accepted(drafts, sampled)
        rejected = len(drafts) - kept
        req.cached_len -= rejected
        req.sampled -= rejected
        keep = pages_for(req.cached_len, self.page_size)
        if len(req.pages) > keep:
            self.cache.free(req.pages[keep:])
            del req.pages[keep:]
        self.counters["spec_drafts"] += 1
        self.counters["spec_draft_tokens"] += len(drafts)
        self.counters["spec_accepted_tokens"] += kept
        assert self.speculator is not None  # drafts come from it
        self.speculator.verified(req, len(drafts), kept)
        return kept

    def _wait_processed(self, count: int) -> None:
        """Block (the model's thread) until `count` batches are processed: their tokens are then accepted
        into the grammars of the batch about to sample."""
        with self._processed:
            if not self._processed.wait_for(lambda: self._processed_count >= count, GRAMMAR_WAIT):
                raise RuntimeError(f"step {count + 1} waited {GRAMMAR_WAIT:.0f} s for the previous step's tokens")

    def _collect_prompt_logprobs(self, batch: ForwardBatch, numbers: Logprobs | None) -> None:
        """Add this step's prompt log-probabilities to their requests (the first prompt token has none)."""
        if numbers is None:
            return
        chosen, top_ids, top_values = numbers.chosen.tolist(), numbers.top_ids.tolist(), numbers.top_values.tolist()
        at = 0
        for row, count in batch.prompt_rows:
            req = batch.reqs[row]
            if req.prompt_logprobs is None:
                req.prompt_logprobs = [self._logprob(req.input_ids[0], None, [], [], 0)]
            first = len(req.prompt_logprobs)
            k = req.params.prompt_logprobs or 0
            req.prompt_logprobs += [self._logprob(req.input_ids[first + j], chosen[at + j], top_ids[at + j],
                                                  top_values[at + j], k) for j in range(count)]
            at += count

    def _token_logprobs(self, batch: ForwardBatch, tokens: list[int],
                        numbers: Logprobs | None) -> dict[int, TokenLogprob]:
        """Each sampled token's log-probability, by sampled row, for the rows that asked."""
        if numbers is None:
            return {}
        chosen, top_ids, top_values = numbers.chosen.tolist(), numbers.top_ids.tolist(), numbers.top_values.tolist()
        out = {}
        for j, i in enumerate(batch.sampling.logprob_rows or ()):
            out[i] = self._logprob(tokens[i], chosen[j], top_ids[j], top_values[j],
                                   batch.reqs[batch.sample_rows[i]].params.logprobs or 0)
        return out

    def _logprob(self, token: int, value: float | None, ids: list[int], values: list[float], k: int) -> TokenLogprob:
        text = self.token_text
        return TokenLogprob(token, text(token), value, [(t, text(t), v) for t, v in zip(ids[:k], values[:k],
                                                                                        strict=True)])

    def _append_token(self, req: Req, token: int, logprob: TokenLogprob | None = None) -> None:
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
        if req.params.max_tokens == 0:  # scoring only: the prompt's log-probabilities, no output
            self._finish(req, "length")
            return
        req.output_ids.append(token)
        if logprob is not None:
            req.logprobs.append(logprob)
        part = req.think.feed(token) if req.think is not None else Part.ANSWER
        reason = None
        if req.grammar is not None and part is Part.ANSWER and (not req.grammar.accept(token)
                                                                or req.grammar.is_terminated):
            if not req.grammar.is_terminated:  # the mask allowed it, so this is a bug, but only this request's
                log.error("request %s sampled token %d, which its grammar rejects; it ends here", req.rid, token)
            reason = "stop"
        elif (token in self.eos_ids and not req.params.ignore_eos) or token in (req.params.stop_token_ids or ()):
            reason = "stop"
        else:
            if req.detokenizer is not None:
                req.detokenizer.add(token, part)
            if req.detokenizer is not None and req.detokenizer.stopped:
                reason = "stop"
            elif len(req.output_ids) >= req.max_output:
                reason = "length"
        if reason is None:
            text, reasoning = (req.detokenizer.take(final=False), req.detokenizer.take_reasoning()) \
                if req.detokenizer else ("", "")
            self._pending.append(Delta(rid=req.client_rid, index=req.index, text=text, token_ids=[token],
                                       logprobs=None if logprob is None else [logprob],
                                       prompt_logprobs=self._first_prompt_logprobs(req), reasoning=reasoning))
        else:
            self._finish(req, reason, last_token=token, logprob=logprob)

    @staticmethod
    def _first_prompt_logprobs(req: Req) -> list[TokenLogprob] | None:
        """A request's prompt log-probabilities, with its first output only."""
        if req.params.prompt_logprobs is None or len(req.output_ids) > 1:
            return None
        return req.prompt_logprobs

    def _finish(self, req: Req, reason: str, last_token: int | None = None,
                logprob: TokenLogprob | None = None) -> None:
        """The one way out: leave every queue, emit the Final (a group's choices but the last: a Delta with
        the choice's finish reason), release now or after the batches in flight."""
        self.prefill_manager.remove_req(req)
        self.decode_manager.remove_req(req)
        req.state = ReqState.FINISHED
        req.finish_reason = reason
        req.finish_time = time.monotonic()
        del self.reqs[req.rid]
        self.counters["aborted" if reason == "abort" else "finished"] += 1
        if reason != "abort":
            self.admission.finished(req)
        self._unreleased.add(req)
        if req.inflight == 0:
            self._release(req)
        text, reasoning = (req.detokenizer.take(final=True), req.detokenizer.take_reasoning()) \
            if req.detokenizer else ("", "")
        tokens = [] if last_token is None else [last_token]
        extra = {"logprobs": None if logprob is None else [logprob],
                 "prompt_logprobs": self._first_prompt_logprobs(req) if tokens or not req.output_ids else None}
        group = req.group
        if group is None:
            self._pending.append(msgspec.structs.replace(req.final(tokens, text, reasoning=reasoning), **extra))
        elif group.open:
            self._pending.append(Delta(rid=group.rid, index=req.index, text=text, token_ids=tokens,
                                       finish_reason=reason, reasoning=reasoning, **extra))
        else:
            del self.groups[group.rid]
            self._pending.append(msgspec.structs.replace(req.final(tokens, text, group.members, reasoning),
                                                         **extra))

    def _release(self, req: Req) -> None:
        """The one cleanup path (from `_finish` once no batch in flight uses `req`, and from `_retract`):
        free the request slot and hand the KV pages to the cache manager (only whole, known tokens are cached)."""
        self._unreleased.discard(req)
        if req.loading is not None:  # its prefix's pages, loading or loaded for it
            self.cache.cancel_load(req.loading)
            req.loading = None
        if req.slot is None:  # never admitted: it held nothing else
            return
        if self.speculator is not None:
            self.speculator.release(req)
        self.table.free(req.slot)
        req.slot = None
        self.cache.release(req.tokens(0, min(req.cached_len, req.total_len)), req.pages, req.prefix)
        req.pages = []

    def _result(self, result: StepResult) -> StepResult:
        """`result` with the outputs made since the last one (a Final names its request as finished)."""
        result.outputs, self._pending = self._pending, []
        result.finished = [o.rid for o in result.outputs if o.finished]
        return result


def _speculation(req: Req) -> Speculation | None:
    spec = req.spec
    return None if spec is None else Speculation(draft_tokens=spec.proposed, accepted_tokens=spec.accepted,
                                                 verifications=spec.verifies)


def _draftable(req: Req, proposal: list[int]) -> int:
    """How many of `proposal` a request may verify: what its grammar accepts; none while its think block
    is not over and its masks depend on the block (a budget that may force its close along the drafts, or
    a grammar that starts after it): those are known only token by token (engine/reasoning.py)."""
    block = req.think
    if block is not None and not block.answering and \
            (req.grammar is not None or block.may_force(req.sampled + len(proposal))):
        return 0
    return len(proposal) if req.grammar is None else req.grammar.allowed(proposal)


def _runs(rows: list[int]) -> list[tuple[int, list[int]]]:
    """Each request's sampled rows: (its index in the batch, the rows), in row order (a verifying request's
    rows are consecutive)."""
    runs: list[tuple[int, list[int]]] = []
    for row, index in enumerate(rows):
        if runs and runs[-1][0] == index:
            runs[-1][1].append(row)
        else:
            runs.append((index, [row]))
    return runs
