"""What clients receive from a processed step: tokens appended, stops checked, text detokenised, outputs built.

The scheduler decides who runs and owns every queue, slot and page; `OutputProcessor` only turns sampled
tokens into `Delta`s and `Final`s (engine/outputs.py) and says when a request has reached its end (EOS, a stop
token or string, its grammar's end, its length). The scheduler then finishes it (`Scheduler._finish`), which
asks `final` for the last output. Outputs wait in `pending` until the step's result takes them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec

from engine.batch import ForwardBatch
from engine.outputs import Delta, Output, TokenLogprob
from engine.reasoning import Part
from engine.request import Req, ReqState
from engine.sampling import Logprobs

log = logging.getLogger(__name__)

Finish = Callable[[Req, str, "int | None", "TokenLogprob | None"], None]
"""How a request ends: (request, finish reason, its last token and that token's log-probability, if sent)."""


class OutputProcessor:
    """`eos_ids`: tokens that end a request (unless it ignores EOS); `token_text`: a token id's text, for
    log-probabilities."""

    def __init__(self, eos_ids: set[int], token_text: Callable[[int], str] = str) -> None:
        self.eos_ids = eos_ids
        self.token_text = token_text
        self.pending: list[Output] = []

    def take(self) -> list[Output]:
        """The outputs made since the last call."""
        outputs, self.pending = self.pending, []
        return outputs

    def append(self, req: Req, token: int, logprob: TokenLogprob | None = None) -> str | None:
        """Add a sampled token to `req`: None having streamed it as a Delta, or the reason the request ends
        here ("stop", "length"); the token is then the scheduler's to send with the Final (`final`)."""
        if req.times.first_token is None:
            req.times.first_token = time.monotonic()
        if req.params.max_tokens == 0:  # scoring only: the prompt's log-probabilities, no output
            return "length"
        req.output_ids.append(token)
        if logprob is not None:
            req.reply.logprobs.append(logprob)
        part = req.reply.think.feed(token) if req.reply.think is not None else Part.ANSWER
        reason = self._stop(req, token, part)
        if reason is None:
            text, reasoning = (req.reply.detokenizer.take(final=False), req.reply.detokenizer.take_reasoning()) \
                if req.reply.detokenizer else ("", "")
            self.pending.append(Delta(rid=req.client_rid, index=req.index, text=text, token_ids=[token],
                                      logprobs=None if logprob is None else [logprob],
                                      prompt_logprobs=_first_prompt_logprobs(req), reasoning=reasoning))
        return reason

    def deliver(self, batch: ForwardBatch, runs: list[tuple[int, list[int]]], tokens: list[int],
                logprobs: dict[int, TokenLogprob], finish: Finish) -> None:
        """Append each request's rows' tokens (`runs`: its index in the batch and its rows, cut to what verification
        kept) until it ends; `finish` ends it (the scheduler's: out of every queue, then `final` for the output)."""
        for index, rows in runs:
            req = batch.reqs[index]
            for row in rows:
                if req.state is ReqState.FINISHED:
                    break
                if (reason := self.append(req, tokens[row], logprobs.get(row))) is None:
                    continue
                if req.params.max_tokens == 0:  # scoring only: the token was not appended, none goes with the Final
                    finish(req, reason, None, None)
                else:
                    finish(req, reason, tokens[row], logprobs.get(row))

    def _stop(self, req: Req, token: int, part: Part) -> str | None:
        """Why `token` ends `req`, if it does; detokenises it otherwise (a stop string ends it there too)."""
        if req.grammar is not None and part is Part.ANSWER and (not req.grammar.accept(token)
                                                                or req.grammar.is_terminated):
            if not req.grammar.is_terminated:  # the mask allowed it, so this is a bug, but only this request's
                log.error("request %s sampled token %d, which its grammar rejects; it ends here", req.rid, token)
            return "stop"
        if (token in self.eos_ids and not req.params.ignore_eos) or token in (req.params.stop_token_ids or ()):
            return "stop"
        if req.reply.detokenizer is not None:
            req.reply.detokenizer.add(token, part)
            if req.reply.detokenizer.stopped:
                return "stop"
        return "length" if len(req.output_ids) >= req.max_output else None

    def final(self, req: Req, last_token: int | None, logprob: TokenLogprob | None) -> None:
        """The finished request's last output: its Final, or for a group's choice but the last a Delta with
        the choice's finish reason (the last one's Final carries the usage of all)."""
        text, reasoning = (req.reply.detokenizer.take(final=True), req.reply.detokenizer.take_reasoning()) \
            if req.reply.detokenizer else ("", "")
        tokens = [] if last_token is None else [last_token]
        extra = {"logprobs": None if logprob is None else [logprob],
                 "prompt_logprobs": _first_prompt_logprobs(req) if tokens or not req.output_ids else None}
        group = req.group
        if group is None:
            self.pending.append(msgspec.structs.replace(req.final(tokens, text, reasoning=reasoning), **extra))
        elif group.open:
            self.pending.append(Delta(rid=group.rid, index=req.index, text=text, token_ids=tokens,
                                      finish_reason=req.finish_reason, reasoning=reasoning, **extra))
        else:
            self.pending.append(msgspec.structs.replace(req.final(tokens, text, group.members, reasoning), **extra))

    def prompt_logprobs(self, batch: ForwardBatch, numbers: Logprobs | None) -> None:
        """Add this step's prompt log-probabilities to their requests (the first prompt token has none)."""
        if numbers is None:
            return
        chosen, top_ids, top_values = numbers.chosen.tolist(), numbers.top_ids.tolist(), numbers.top_values.tolist()
        at = 0
        for row, count in batch.prompt_rows:
            req = batch.reqs[row]
            if req.reply.prompt_logprobs is None:
                req.reply.prompt_logprobs = [self._logprob(req.input_ids[0], None, [], [], 0)]
            first = len(req.reply.prompt_logprobs)
            k = req.params.prompt_logprobs or 0
            req.reply.prompt_logprobs += [self._logprob(req.input_ids[first + j], chosen[at + j], top_ids[at + j],
                                                  top_values[at + j], k) for j in range(count)]
            at += count

    def token_logprobs(self, batch: ForwardBatch, tokens: list[int],
                       numbers: Logprobs | None) -> dict[int, TokenLogprob]:
        """Each sampled token's log-probability, by sampled row, for the rows that asked."""
        if numbers is None:
            return {}
        chosen, top_ids, top_values = numbers.chosen.tolist(), numbers.top_ids.tolist(), numbers.top_values.tolist()
        return {i: self._logprob(tokens[i], chosen[j], top_ids[j], top_values[j],
                                 batch.reqs[batch.sample_rows[i]].params.logprobs or 0)
                for j, i in enumerate(batch.sampling.logprob_rows or ())}

    def _logprob(self, token: int, value: float | None, ids: list[int], values: list[float], k: int) -> TokenLogprob:
        text = self.token_text
        return TokenLogprob(token, text(token), value, [(t, text(t), v) for t, v in zip(ids[:k], values[:k],
                                                                                        strict=True)])


def _first_prompt_logprobs(req: Req) -> list[TokenLogprob] | None:
    """A request's prompt log-probabilities, with its first output only."""
    if req.params.prompt_logprobs is None or len(req.output_ids) > 1:
        return None
    return req.reply.prompt_logprobs


def sample_runs(rows: list[int]) -> list[tuple[int, list[int]]]:
    """Each request's sampled rows: (its index in the batch, the rows), in row order (a verifying request's
    rows are consecutive)."""
    runs: list[tuple[int, list[int]]] = []
    for row, index in enumerate(rows):
        if runs and runs[-1][0] == index:
            runs[-1][1].append(row)
        else:
            runs.append((index, [row]))
    return runs
