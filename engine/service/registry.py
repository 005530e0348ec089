"""The server's requests: one `Record` per live request, from its Submit to its Final, in one `Registry`.

A record's lifecycle: preparing (its text prompt on the tokenizer worker, its grammar on the grammar
worker: `stage` "tokenizing", then "compiling grammar") -> queued in the engine (handed to the LLM, whose
scheduler says whether it waits, prefills or runs: `LLM.describe`) -> done: its Final went out, or it was
refused or aborted before it reached the engine, and the record is gone. Its client may go first: a
queued record then stays, without an owner, until the engine's Final for the abort (dropped), so the rid
stays taken as long as the engine knows it. The server branches over this registry alone (a duplicate
rid, an abort, a client gone, shutdown); the engine keeps its own indexes of the same requests for its
own work (`LLM._live`: the client's rid -> its request, for `LLM.request`; `Scheduler.reqs`: each choice
by its own rid). Both drop a request in the step that makes its Final; the server drops its record as it
delivers that Final, after the step (`EngineServer._deliver`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from engine.params import SamplingParams
from engine.structured import GrammarSpec

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

    from engine.llm import LLM

Stage = Literal["tokenizing", "compiling grammar"]  # a preparing request's reason to wait, in the stats


class GrammarJob:
    """A request's grammar on the grammar worker; `started` once the worker took it (a grammar's time limit
    counts from there, not from the queue behind another one)."""

    def __init__(self, llm: LLM, spec: GrammarSpec, worker: ThreadPoolExecutor) -> None:
        self.started: float | None = None
        self.compiled = worker.submit(self._compile, llm, spec)

    def _compile(self, llm: LLM, spec: GrammarSpec) -> CompiledGrammar:
        self.started = time.monotonic()
        return llm.compile_grammar(spec)

    def overdue(self, now: float, limit: float) -> bool:
        return not self.compiled.done() and self.started is not None and now - self.started > limit


@dataclass
class Preparation:
    """What a request needs before it can queue: its token ids (a text prompt's on the tokenizer worker;
    token ids are done at once) and its grammar, if it has one, on the grammar worker. Neither runs on the
    loop: their cost is the client's."""

    ids: Future[list[int]]
    grammar: GrammarJob | None

    @property
    def stage(self) -> Stage:
        return "tokenizing" if not self.ids.done() else "compiling grammar"

    @property
    def prompt_tokens(self) -> int:
        """0 while the prompt is tokenized, or when tokenizing failed."""
        ids = self.ids
        return len(ids.result()) if ids.done() and not ids.cancelled() and ids.exception() is None else 0

    def ready(self) -> bool:
        return self.ids.done() and (self.grammar is None or self.grammar.compiled.done())

    def cancel(self) -> None:
        self.ids.cancel()
        if self.grammar is not None:
            self.grammar.compiled.cancel()  # a compile under way runs to its end (xgrammar cannot stop it)


@dataclass
class Record:
    """One live request as the server knows it: who sent it (`owner`, the connection to answer; None once
    it is gone) and, until it is queued in the engine, its `preparation`."""

    rid: str
    owner: bytes | None
    client: str  # the label operators see (Submit.client, or "client N")
    params: SamplingParams
    arrival: float  # time.monotonic() at submission: the request's timings count from here
    preparation: Preparation | None = None


class Registry:
    """The live requests by rid, in arrival order; the preparing ones are also indexed apart, since the
    loop looks at them every pass."""

    def __init__(self) -> None:
        self._records: dict[str, Record] = {}
        self._preparing: dict[str, Record] = {}

    def __contains__(self, rid: str) -> bool:
        return rid in self._records

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[Record]:
        """Over a copy, so the caller may remove records as it goes."""
        return iter(list(self._records.values()))

    def get(self, rid: str) -> Record | None:
        return self._records.get(rid)

    def add(self, record: Record) -> None:
        assert record.rid not in self._records, record.rid
        self._records[record.rid] = record
        if record.preparation is not None:
            self._preparing[record.rid] = record

    def queued(self, record: Record) -> None:
        """`record` is in the engine now: its preparation is done."""
        record.preparation = None
        self._preparing.pop(record.rid, None)

    def remove(self, rid: str) -> Record:
        """The record of a request that is done; its preparation, if one is under way, stops."""
        self._preparing.pop(rid, None)
        record = self._records.pop(rid)
        if record.preparation is not None:
            record.preparation.cancel()
        return record

    def preparing(self) -> list[tuple[Record, Preparation]]:
        """The requests not queued yet, in arrival order, with their preparation."""
        return [(r, r.preparation) for r in self._preparing.values() if r.preparation is not None]

    def of(self, owner: bytes) -> list[Record]:
        return [r for r in self._records.values() if r.owner == owner]

    def owners(self) -> set[bytes]:
        """The connections with live requests (read by the liveness thread while the loop is inside a step)."""
        return {r.owner for r in self._records.values() if r.owner is not None}
