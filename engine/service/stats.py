"""Live stats: counters and recent steps recorded by the server, and complete snapshots built from an LLM.

A snapshot names every waiting and running request, every request slot and every KV page, so a
dashboard that subscribes late (PUB/SUB drops what was sent before it joined) can draw the whole
scheduler from one message.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

from engine.service.protocol import Counters, Info, Pages, RunningReq, Stats, StepRecord, WaitingReq

if TYPE_CHECKING:  # only the engine process builds snapshots; `minichat status` just formats them
    from engine.llm import LLM
    from engine.outputs import StepResult
    from engine.request import Req

RATE_WINDOW = 2.0  # seconds of recent steps that token and step rates average over


class StatsRecorder:
    """Counts what the engine did and remembers the last `history` steps; `snapshot()` adds live state."""

    def __init__(self, llm: LLM, history: int = 32) -> None:
        self.llm = llm
        self.start = time.monotonic()
        self.seq = 0
        self.submitted = self.finished = self.aborted = self.errors = 0
        self.steps = self.prefill_tokens = self.decode_tokens = 0
        self.recent: deque[StepRecord] = deque(maxlen=history)
        self._window: deque[tuple[float, str, int]] = deque()  # (end time, kind, tokens)

    def record_step(self, result: StepResult) -> None:
        # Aborts are counted by the server when it aborts (see EngineServer._abort_request).
        self.finished += sum(d.finish_reason not in (None, "abort") for d in result.deltas)
        if result.kind == "idle":
            return
        now = time.monotonic()
        self.steps += 1
        if result.kind == "prefill":
            self.prefill_tokens += result.num_tokens
        else:
            self.decode_tokens += result.num_tokens
        self.recent.append(StepRecord(index=self.steps, kind=result.kind, rids=result.rids,
                                      num_tokens=result.num_tokens, duration=result.duration,
                                      at=now - self.start))
        self._window.append((now, result.kind, result.num_tokens))

    def _counters(self, now: float) -> Counters:
        while self._window and self._window[0][0] < now - RATE_WINDOW:
            self._window.popleft()
        span = max(min(RATE_WINDOW, now - self.start), 1e-3)
        prefill = sum(n for _, kind, n in self._window if kind == "prefill")
        decode = sum(n for _, kind, n in self._window if kind == "decode")
        return Counters(submitted=self.submitted, finished=self.finished, aborted=self.aborted, errors=self.errors,
                        steps=self.steps, prefill_tokens=self.prefill_tokens, decode_tokens=self.decode_tokens,
                        prefill_tokens_per_s=prefill / span, decode_tokens_per_s=decode / span,
                        steps_per_s=len(self._window) / span)

    def snapshot(self) -> Stats:
        now = time.monotonic()
        llm = self.llm
        pm = llm.scheduler.prefill_manager
        holders = [pm.chunked] if pm.chunked is not None else []
        holders += sorted(llm.scheduler.decode_manager.running.values(), key=lambda r: r.uid)
        self.seq += 1
        return Stats(seq=self.seq, time=time.time(), uptime=now - self.start, model=Path(llm.model_path).name,
                     waiting=[WaitingReq(rid=r.rid, prompt_tokens=r.input_len, waited=now - r.arrival_time)
                              for r in pm.waiting],
                     running=[_running(r) for r in holders], slots=list(llm.table.holder), pages=_pages(llm),
                     counters=self._counters(now), steps=list(self.recent))


def _running(req: Req) -> RunningReq:
    return RunningReq(rid=req.rid, slot=-1 if req.slot is None else req.slot,
                      state="prefilling" if req.state.value == "prefilling" else "running",
                      prompt_tokens=req.input_len, prefilled=min(req.cached_len, req.input_len),
                      generated=len(req.output_ids), max_tokens=req.max_output, pages=len(req.pages))


def _pages(llm: LLM) -> Pages:
    owner = llm.cache.allocator.owner
    cached = llm.cache.cached_pages()
    states = ["."] * llm.num_pages
    for page in owner:
        states[page] = "R"
    for page, locked in cached.items():
        states[page] = "L" if locked else "c"
    locked_count = sum(cached.values())
    return Pages(page_size=llm.config.page_size, states="".join(states), owners=dict(owner),
                 free=llm.cache.allocator.num_free, held=len(owner), cached=len(cached) - locked_count,
                 locked=locked_count, total=llm.num_pages)


def format_stats(stats: Stats, info: Info | None = None, max_rows: int = 20) -> str:
    """A plain-text view of one snapshot, for `minichat status`."""
    c, p = stats.counters, stats.pages
    busy = sum(h is not None for h in stats.slots)
    head = f"model {stats.model}, up {stats.uptime:.1f}s"
    if info is not None:
        head = f"minichat {info.version} at {info.address} (pid {info.pid}): {head}, max {info.max_seq_len} tokens"
    lines = [
        head,
        f"request slots {busy}/{len(stats.slots)} busy; waiting {len(stats.waiting)}; running {len(stats.running)}",
        f"KV pages ({p.page_size} tokens each): {p.free} free, {p.held} held, {p.cached} cached, "
        f"{p.locked} locked, {p.total} total",
        f"rates: prefill {c.prefill_tokens_per_s:.1f} tok/s, decode {c.decode_tokens_per_s:.1f} tok/s, "
        f"{c.steps_per_s:.1f} steps/s",
        f"totals: {c.submitted} submitted, {c.finished} finished, {c.aborted} aborted, {c.errors} errors, "
        f"{c.steps} steps ({c.prefill_tokens} prefill + {c.decode_tokens} decode tokens)",
    ]
    if stats.waiting:
        lines.append("waiting queue (oldest first):")
        lines += [f"  {w.rid}  {w.prompt_tokens} prompt tokens, waited {w.waited:.2f}s"
                  for w in stats.waiting[:max_rows]]
    if stats.running:
        lines.append("running set:")
        lines += [f"  slot {r.slot:>3}  {r.rid}  {r.state}: prefilled {r.prefilled}/{r.prompt_tokens}, "
                  f"generated {r.generated}/{r.max_tokens}, {r.pages} pages" for r in stats.running[:max_rows]]
    lines.append("page map (. free, R held, c cached, L locked):")
    lines += [f"  {p.states[i:i + 64]}" for i in range(0, len(p.states), 64)][:max_rows]
    if stats.steps:
        lines.append("last steps:")
        lines += [f"  #{s.index} {s.kind:<7} {len(s.rids)} req, {s.num_tokens} tokens, {s.duration * 1e3:.1f} ms"
                  for s in stats.steps[-max_rows:]]
    return "\n".join(lines)
