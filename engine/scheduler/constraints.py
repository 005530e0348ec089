"""What a step's sampler must apply beyond the logits: grammar masks and a think block's forced close.

Both depend on every token sampled before the step, and the overlap loop (engine/loop.py) schedules step N+1
before step N's tokens are processed; so the masks are filled at sampling time, on the model's thread, once
`ProcessedSteps` says step N is done. A request verifying drafts has nothing in flight: its rows are filled
when the step is scheduled, each as if the drafts before it were accepted.
"""

from __future__ import annotations

import functools
import threading

from engine.batch import ForwardBatch
from engine.sampling import Forcing, Grammars
from engine.structured import GrammarCompiler

GRAMMAR_WAIT = 60.0  # seconds a step's sampler waits for the previous step's processing before giving up


class ProcessedSteps:
    """How many batches are processed so far; the model's thread may wait for a count."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self.count = 0

    def advance(self) -> int:
        with self._changed:
            self.count += 1
            self._changed.notify_all()
        return self.count

    def wait(self, count: int) -> None:
        """Block until `count` batches are processed: their tokens are then in the grammars of the batch
        about to sample."""
        with self._changed:
            if not self._changed.wait_for(lambda: self.count >= count, GRAMMAR_WAIT):
                raise RuntimeError(f"step {count + 1} waited {GRAMMAR_WAIT:.0f} s for the previous step's tokens")


def attach(batch: ForwardBatch, compiler: GrammarCompiler | None, processed: ProcessedSteps, previous: int) -> None:
    """Give the batch's sampling its grammar masks and forced tokens, both read once `previous` batches (every
    one scheduled before this) are processed."""
    wait = functools.partial(processed.wait, previous)
    sampled = batch.sampled_reqs
    if compiler is not None and any(r.grammar is not None for r in sampled):
        grammars = Grammars([r.grammar for r in sampled], compiler.allocate_bitmask(len(sampled)), wait)
        for row, (index, req) in enumerate(zip(batch.sample_rows, sampled, strict=True)):
            drafts = batch.drafts.get(index)
            if drafts is None or req.grammar is None:
                continue
            if row == 0 or batch.sample_rows[row - 1] != index:  # the request's first row
                req.grammar.fill_ahead(grammars.bitmask, row, drafts)
            grammars.matchers[row] = None
            grammars.filled.append(row)
        batch.sampling.grammars = grammars
    # a think block whose budget may be spent by then (`ThinkBlock.may_force`) may have to emit its close
    forced = [(row, r.reply.think) for row, r in enumerate(sampled)
              if r.reply.think is not None and r.reply.think.may_force(r.sampled)]
    if forced:
        batch.sampling.forcing = Forcing(forced, wait)
