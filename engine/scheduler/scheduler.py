"""Scheduler.step(): schedule (prefill first, else decode) -> forward -> process results -> cleanup.

The loop body of the seed's `normal_loop`, minus message receiving (the server does that between
steps). Every way a request can end -- EOS, length, stop string, abort -- goes through
`_finish`, the one cleanup path that returns the request slot and hands KV pages to the cache.
"""

from __future__ import annotations

import time

from engine.kv.cache import CacheManager
from engine.kv.table import RequestTable
from engine.outputs import Delta, StepResult
from engine.request import Req, ReqState
from engine.runner import ModelRunner
from engine.sampling import sample
from engine.scheduler.budget import pages_for
from engine.scheduler.decode import DecodeManager
from engine.scheduler.prefill import PrefillManager


class Scheduler:
    def __init__(self, runner: ModelRunner, cache: CacheManager, table: RequestTable, max_prefill_tokens: int,
                 eos_ids: set[int]) -> None:
        self.runner = runner
        self.cache = cache
        self.table = table
        self.page_size = cache.page_size
        self.prefill_budget = max_prefill_tokens
        self.eos_ids = eos_ids
        self.prefill_manager = PrefillManager(table, cache)
        self.decode_manager = DecodeManager(self.page_size)
        self.reqs: dict[str, Req] = {}
        self._pending: list[Delta] = []
        self.step_count = 0

    # -- public -----------------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        self.reqs[req.rid] = req
        self.prefill_manager.add_one_req(req)

    @property
    def runnable(self) -> bool:
        return self.prefill_manager.runnable or self.decode_manager.runnable

    def has_unfinished(self) -> bool:
        return bool(self.reqs) or bool(self._pending)

    def abort(self, rid: str) -> bool:
        """Abort in any state; False if the request is unknown or already finished."""
        req = self.reqs.get(rid)
        if req is None:
            return False
        self._finish(req, "abort")
        return True

    def step(self) -> StepResult:
        """One scheduler step: a prefill batch if one can be formed, else a decode batch."""
        start = time.perf_counter()
        kind, reqs = "prefill", None
        if self.prefill_manager.runnable:  # the reservation sum is only needed to admit someone
            reqs = self.prefill_manager.schedule_next_batch(self.prefill_budget, self.decode_manager.inflight_pages())
        if reqs is None:
            kind, reqs = "decode", self.decode_manager.schedule_next_batch()
        if reqs is None:
            return self._result("idle", [], 0, start)
        self._allocate_kv(reqs)
        # A request samples when this step reaches the end of its known tokens; mid-chunk ones do not.
        wants = [r.cached_len + r.extend_len == r.total_len for r in reqs]
        logits = self.runner.forward(reqs, wants)
        sampled = [r for r, w in zip(reqs, wants, strict=True) if w]
        next_tokens = sample(logits, [r.params for r in sampled], [r.generator for r in sampled])
        num_tokens = 0
        for req in reqs:
            req.cached_len += req.extend_len
            num_tokens += req.extend_len
        self.decode_manager.filter_reqs(sampled)
        for req, token in zip(sampled, next_tokens, strict=True):
            self._append_token(req, token)
        self.step_count += 1
        return self._result(kind, [r.rid for r in reqs], num_tokens, start)

    # -- internals --------------------------------------------------------------------------------
    def _allocate_kv(self, reqs: list[Req]) -> None:
        """Claim pages for the positions this step writes (reserved at admission, so this cannot fail)."""
        ps = self.page_size
        for req in reqs:
            need = pages_for(req.cached_len + req.extend_len, ps) - len(req.pages)
            if need <= 0:
                continue
            new = self.cache.allocate(need, req.rid)
            self.table.write_pages(req.slot, len(req.pages), new, ps)
            req.pages += new

    def _append_token(self, req: Req, token: int) -> None:
        now = time.monotonic()
        req.output_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = now
        reason = None
        if token in self.eos_ids and not req.params.ignore_eos:
            reason = "stop"
        else:
            if req.detokenizer is not None:
                req.detokenizer.add(token)
            if req.detokenizer is not None and req.detokenizer.stopped:
                reason = "stop"
            elif not req.can_decode:
                reason = "length"
        if reason is None:
            text = req.detokenizer.take(final=False) if req.detokenizer else ""
            self._pending.append(Delta(req.rid, [token], text))
        else:
            self._finish(req, reason, last_token=token)

    def _finish(self, req: Req, reason: str, last_token: int | None = None) -> None:
        """The one cleanup path: leave every queue, free the slot, hand KV to the cache manager."""
        self.prefill_manager.remove_req(req)
        self.decode_manager.remove_req(req)
        if req.slot is not None:
            self.table.free(req.slot)
            req.slot = None
        if req.state is not ReqState.WAITING:
            self.cache.release(req.tokens(0, req.cached_len), req.pages, req.prefix)
        req.pages = []
        req.state = ReqState.FINISHED
        req.finish_reason = reason
        req.finish_time = time.monotonic()
        del self.reqs[req.rid]
        text = req.detokenizer.take(final=True) if req.detokenizer else ""
        self._pending.append(Delta(req.rid, [] if last_token is None else [last_token], text, reason))

    def _result(self, kind: str, rids: list[str], num_tokens: int, start: float) -> StepResult:
        deltas, self._pending = self._pending, []
        return StepResult(kind=kind, rids=rids, finished=[d.rid for d in deltas if d.finished], deltas=deltas,
                          num_tokens=num_tokens, duration=time.perf_counter() - start)
