"""Per-request records and the summary figures, with vLLM's definitions.

A request ends completed, aborted (someone else stopped it: an operator's abort, the engine's
shutdown) or failed (refused, cut off, timed out); the latency and throughput figures are over the
completed ones only, since an aborted request's output is as long as someone else chose.

TTFT: submit -> first token. TPOT: (E2E - TTFT) / (output tokens - 1), i.e. excluding the first
token. ITL: every gap between consecutive streamed tokens. E2E: submit -> final message. Mean running
set (minichat backend only): the seconds each request held a slot, from its engine timings (admission
to finish), summed and divided by the duration: how many requests ran at once, on average.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field


@dataclass
class RequestRecord:
    prompt_len: int
    output_len: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    error: str | None = None
    admitted: float | None = None  # seconds the engine ran it (admission to finish), where the backend says
    aborted: bool = False  # ended with finish reason "abort", not by this benchmark's doing
    cached: int | None = None  # prompt tokens the server's prefix cache served, where it says
    drafts: tuple[int, int] | None = None  # speculative draft tokens verified and accepted, where it says

    @property
    def outcome(self) -> str:
        """completed, aborted or failed."""
        return "failed" if self.error is not None else "aborted" if self.aborted else "completed"

    @property
    def ok(self) -> bool:
        return self.outcome == "completed"

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_len < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), without needing numpy."""
    s = sorted(values)
    if len(s) == 1:
        return s[0]
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def distribution(values: list[float]) -> dict[str, float]:
    """mean / median / p90 / p95 / p99 in milliseconds; NaN when there is nothing to measure."""
    if not values:
        return {k: float("nan") for k in ("mean", "median", "p90", "p95", "p99")}
    ms = [v * 1000 for v in values]
    return {"mean": statistics.fmean(ms), "median": statistics.median(ms), "p90": percentile(ms, 90),
            "p95": percentile(ms, 95), "p99": percentile(ms, 99)}


@dataclass
class Summary:
    completed: int
    aborted: int
    failed: int
    duration: float
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    peak_concurrency: int
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]
    mean_running: float | None = None
    input_tokens: int = 0  # prompt tokens of the completed requests
    cached_prompt_tokens: int | None = None  # of those, served by the prefix cache (None: the server does not say)
    draft_tokens: int | None = None  # speculative drafts the completed requests verified (None: none, or not said)
    accepted_tokens: int | None = None  # of them accepted

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(records: list[RequestRecord], duration: float, peak_concurrency: int) -> Summary:
    ok = [r for r in records if r.ok]
    inp = sum(r.prompt_len for r in ok)
    out = sum(r.output_len for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    return Summary(
        completed=len(ok),
        aborted=sum(r.outcome == "aborted" for r in records),
        failed=sum(r.outcome == "failed" for r in records),
        duration=duration,
        request_throughput=per_s(len(ok)),
        input_throughput=per_s(inp),
        output_throughput=per_s(out),
        total_throughput=per_s(inp + out),
        peak_concurrency=peak_concurrency,
        ttft_ms=distribution([r.ttft for r in ok if r.ttft is not None]),
        tpot_ms=distribution([t for r in ok if (t := r.tpot) is not None]),
        itl_ms=distribution([g for r in ok for g in r.itl]),
        e2e_ms=distribution([r.e2e for r in ok if r.e2e is not None]),
        mean_running=sum(r.admitted for r in ok if r.admitted is not None) / duration
        if duration > 0 and any(r.admitted is not None for r in ok) else None,
        input_tokens=inp,
        cached_prompt_tokens=sum(r.cached or 0 for r in ok) if any(r.cached is not None for r in ok) else None,
        draft_tokens=sum(d[0] for d in drafts) if (drafts := [r.drafts for r in ok if r.drafts]) else None,
        accepted_tokens=sum(d[1] for d in drafts) if drafts else None,
    )
