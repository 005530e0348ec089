"""The scheduler's phases: `schedule()` -> ForwardBatch, (the runner's `run`), `process()` -> StepResult.

- `schedule()`: make room for the running set (retraction.py), decide who runs (policy.py, with drafts from
  engine/speculative/steps.py), claim their KV pages (RequestKV), build the tensors (batch_builder.py), commit;
- `process()`: verify drafts, append tokens, check stops and detokenize (output.py), finish and release.

The overlap loop (engine/loop.py) calls `schedule()` for step N+1 before `process()` of step N, so scheduling works
only from what it decided itself (`cached_len`, `sampled`), never from tokens the host has not seen yet. Every end
(EOS, length, stop string, abort) goes through `_finish`; `_release` is the one cleanup path (a retraction's too).
What the console sees of this state is views.py's. A request's `n` choices (engine/request.py's Group) share the
leader's prompt pages through the prefix cache once the leader has scheduled them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from engine.batch import ForwardBatch, ForwardOutput
from engine.config import SchedulerConfig
from engine.kv.cache import CacheManager
from engine.kv.table import RequestTable
from engine.outputs import StepResult, TokenLogprob
from engine.request import Group, Req, ReqState
from engine.runner import ModelRunner
from engine.scheduler import constraints
from engine.scheduler.admission import Admission
from engine.scheduler.batch_builder import build_batch
from engine.scheduler.constraints import ProcessedSteps
from engine.scheduler.decode import DecodeManager
from engine.scheduler.output import OutputProcessor, sample_runs
from engine.scheduler.policy import StepPolicy
from engine.scheduler.prefill import PrefillManager
from engine.scheduler.retraction import Retraction
from engine.speculative import steps as speculation
from engine.speculative.speculator import Speculator
from engine.structured import GrammarCompiler

KV_WAIT = 0.01  # seconds a step with nothing to run waits for a KV load's reads (rather than spin)


class Scheduler:
    """`runner` runs the batches `step()` schedules; `schedule()` and `process()` alone need no model.
    `config`: the engine's scheduling part (the KV page size is the cache's)."""

    def __init__(self, runner: ModelRunner | None, cache: CacheManager, table: RequestTable, eos_ids: set[int],
                 config: SchedulerConfig, token_text: Callable[[int], str] = str,
                 speculator: Speculator | None = None, kv_window: int | None = None) -> None:
        self.runner = runner
        self.speculator = speculator  # drafts for running requests to verify (engine/speculative); None: off
        self.kv_window = kv_window  # every layer attends within this many positions (ModelSpec.kv_window)
        self.cache = cache
        self.table = table
        self.page_size = cache.page_size
        self.eos_ids = eos_ids
        self.admission = Admission(config.admission, self.page_size)
        self.policy = config.schedule_policy
        self.prefill_manager = PrefillManager(table, cache, self.admission, self.policy, config.max_wait_steps)
        self.decode_manager = DecodeManager()
        self.counters = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "finished": 0, "aborted": 0,
                         "retractions": 0, "spec_drafts": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0}
        self.step_policy = StepPolicy(self.prefill_manager, self.decode_manager, self.admission, self.page_size,
                                      config.max_prefill_tokens, config.mixed_batches,
                                      config.max_consecutive_prefills)
        self.retraction = Retraction(cache, self.prefill_manager, self.decode_manager, self.admission,
                                     self._release, self.counters)
        self.outputs = OutputProcessor(eos_ids, token_text)
        self.reqs: dict[str, Req] = {}
        self.groups: dict[str, Group] = {}  # requests with n > 1, by the client's rid
        self.grammar: GrammarCompiler | None = None  # set by the engine once a request asks for structure
        self.processed = ProcessedSteps()  # which the sampler's grammars and forcing wait on
        self._scheduled_count = 0
        self._unreleased: set[Req] = set()  # finished, but a batch in flight still uses their slot/pages
        self.inflight_batches = 0

    # -- public -----------------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        req.times.arrival_step = self.counters["steps"]
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
        return bool(self.reqs) or bool(self.outputs.pending) or self.inflight_batches > 0

    def abort(self, rid: str) -> bool:
        """Abort in any state (every open choice of a group); False if the request is unknown or finished."""
        group = self.groups.get(rid)
        reqs = group.open if group is not None else [r for r in (self.reqs.get(rid),) if r is not None]
        for req in reqs:
            self._finish(req, "abort")
        return bool(reqs)

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
            self.cache.processed(self.processed.count)
        return self.cache.unstaged

    # -- schedule ---------------------------------------------------------------------------------
    def schedule(self) -> ForwardBatch | None:
        """The next batch, or None when there is nothing to run: decide who runs (engine/scheduler/policy.py),
        claim their KV pages, build the tensors and attention metadata (`build_batch`), commit.

        Before anyone is admitted, the running set's next tokens get their pages (engine/scheduler/retraction.py),
        or this returns None while a batch in flight holds pages they need."""
        start = time.perf_counter()
        self.cache.scheduling(self._scheduled_count + 1)
        self.cache.poll_loads()  # pages loaded since the last step join the prefix cache, for their requests
        room = self.retraction.make_room(self.reqs.values(), self.inflight_batches > 0)
        proposer = speculation.Proposer(self.speculator, self.decode_manager.running.values(), self.cache)
        plan = self.step_policy.plan(self.counters["steps"], proposer) if room else None
        if plan is None:
            return None
        self.retraction.claim(plan.reqs, self.table, self.kv_window)
        batch = build_batch(plan, self.table, self.eos_ids)
        self._scheduled_count += 1
        constraints.attach(batch, self.grammar, self.processed, self._scheduled_count - 1)
        self._commit(batch)
        batch.schedule_time = time.perf_counter() - start
        batch.propose_time = proposer.seconds
        return batch

    def _commit(self, batch: ForwardBatch) -> None:
        """Advance the batch's requests as if it had run, so the next schedule (in the overlap loop,
        before this batch is processed) starts where this one ends: prompt positions scored,
        `cached_len`, `inflight`, a group leader's prompt shared, `sampled`, and the running set (a
        request whose length budget is now spent leaves it)."""
        for row, count in batch.prompt_rows:
            batch.reqs[row].reply.scored += count
        for req in batch.reqs:
            req.cached_len += req.extend_len
            req.inflight += 1
            if req.group is not None:
                req.group.share(req, self.cache)
        sampled = batch.sampled_reqs
        for req in sampled:
            req.sampled += 1
        self.decode_manager.filter_reqs([r for i, r in zip(batch.sample_rows, sampled, strict=True)
                                         if i not in batch.drafts])
        for index in batch.drafts:  # back in the running set once its verification is processed
            self.decode_manager.remove_req(batch.reqs[index])
        self.inflight_batches += 1

    # -- process ----------------------------------------------------------------------------------
    def process(self, batch: ForwardBatch, output: ForwardOutput) -> StepResult:
        """Verify drafts, append each sampled token (output.py: stops, text, outputs), finish and free.

        A request that finished after this batch was scheduled (EOS seen in the previous step, or an
        abort) drops its token here; its slot and pages are released once no batch uses them."""
        start = time.perf_counter()
        tokens = output.tokens()
        self.inflight_batches -= 1
        for req in batch.reqs:
            req.inflight -= 1
        self.outputs.prompt_logprobs(batch, output.prompt_logprobs)
        runs, accepted = sample_runs(batch.sample_rows), 0
        if batch.drafts:
            assert self.speculator is not None  # drafts come from it
            runs, accepted = speculation.verify_batch(self.speculator, batch, runs, tokens, self.cache, self.counters)
        self.outputs.deliver(batch, runs, tokens, self.outputs.token_logprobs(batch, tokens, output.logprobs),
                             self._finish)
        for index in batch.drafts:  # verified: back in the running set, unless it ended
            if batch.reqs[index].state is not ReqState.FINISHED:
                self.decode_manager.filter_reqs([batch.reqs[index]])
        for req in batch.reqs:
            if req in self._unreleased and req.inflight == 0:
                self._release(req)
        self.cache.processed(self.processed.advance())  # what it wrote is final: the tiers may copy it
        generated = sum(len(rows) for index, rows in runs if index < batch.num_decode or index in batch.drafts)
        return self._count(batch, generated, accepted, batch.schedule_time + output.run_time
                           + time.perf_counter() - start)

    def _count(self, batch: ForwardBatch, generated: int, accepted: int, duration: float) -> StepResult:
        """Count the processed step (its decoded tokens teach admission and the speculator) and say what it did."""
        self.counters["steps"] += 1
        decode_queries = batch.num_decode + batch.num_verify_tokens
        if decode_queries:
            self.admission.decoded()
        self.counters["decode_tokens"] += generated
        self.counters["prefill_tokens"] += batch.num_tokens - decode_queries
        if self.speculator is not None and decode_queries == batch.num_tokens:
            self.speculator.record_step(batch.num_tokens, duration - batch.propose_time)
        return self._result(StepResult(
            kind=batch.kind, rids=[r.rid for r in batch.reqs], num_tokens=batch.num_tokens, duration=duration,
            num_decode_tokens=generated, num_prefill_tokens=batch.num_tokens - decode_queries,
            num_draft_tokens=sum(len(d) for d in batch.drafts.values()), num_accepted_tokens=accepted))

    def _finish(self, req: Req, reason: str, last_token: int | None = None,
                logprob: TokenLogprob | None = None) -> None:
        """The one way out: leave every queue, emit the Final (a group's choices but the last: a Delta with
        the choice's finish reason), release now or after the batches in flight."""
        self.prefill_manager.remove_req(req)
        self.decode_manager.remove_req(req)
        req.state = ReqState.FINISHED
        req.finish_reason = reason
        req.times.finished = time.monotonic()
        del self.reqs[req.rid]
        self.counters["aborted" if reason == "abort" else "finished"] += 1
        if reason != "abort":
            self.admission.finished(req)
        self._unreleased.add(req)
        if req.inflight == 0:
            self._release(req)
        self.outputs.final(req, last_token, logprob)
        if req.group is not None and not req.group.open:
            del self.groups[req.group.rid]

    def _release(self, req: Req) -> None:
        """The one cleanup path (from `_finish` once no batch in flight uses `req`, and from a retraction):
        free the request slot and hand the KV pages to the cache manager (only whole, known tokens are cached)."""
        self._unreleased.discard(req)
        if self.speculator is not None and req.kv.slot is not None:
            self.speculator.release(req)
        req.kv.release(self.cache, self.table, req.tokens(0, min(req.cached_len, req.total_len)))

    def check_requests(self) -> None:
        """Raise AssertionError unless every live request with no batch in flight keeps its invariant."""
        for req in self.reqs.values():
            if not req.inflight:
                req.check(self.table, self.page_size)

    def _result(self, result: StepResult) -> StepResult:
        """`result` with the outputs made since the last one (a Final names its request as finished)."""
        result.outputs = self.outputs.take()
        result.finished = [o.rid for o in result.outputs if o.finished]
        return result

