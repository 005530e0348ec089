"""The fleet: several replicas watched at once (`minichat --engines ADDR1,ADDR2,...`), one row each.

A replica is either an engine's ZeroMQ address, watched through an EngineLink that never starts an
engine (the same link then feeds the ops panels when the view drills down to it, and the chats pinned
to it), or an HTTP replica's `/metrics` (minichat's `serve --http`, vLLM, anything with vLLM's
names), polled once a second. Both come down to a `Reading`, so the view and the imbalance line do not
care which. Over ZeroMQ the TTFT comes from the recent TTFTs the stats carry and the TPOT from the gaps
between the steps each request was in; over HTTP both come from the histograms.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import httpx

from engine.service.addresses import AddressError, split
from engine.service.cli import API_KEY_ENV
from engine.service.protocol import Stats
from tui.bench.metrics import percentile
from tui.link import EngineLink
from tui.scrape import Scrape, gained, parse, quantile, rate

STALE_AFTER = 3.0  # seconds without fresh numbers before a replica reads as stale
POLL_EVERY = 1.0  # seconds between two reads of an HTTP replica's /metrics
POLL_TIMEOUT = 2.0  # seconds for a whole answer, headers to last byte (httpx's own timeouts are per read)
MAX_BODY = 4 * 2**20  # bytes of /metrics read at most: vLLM's is ~30 KB; a replica sending more is not trusted
WATCH_EVERY = 1.0  # seconds between two snapshots taken from an engine the ops panels do not show
RATE_WINDOW = 2.0  # seconds of counters behind an HTTP replica's rates (the engine's own window)
LATENCY_WINDOW = 10.0  # seconds of observations behind a p95 (one second holds too few to rank)
Q = 0.95

State = Literal["connecting", "up", "stale", "down"]


@dataclass(frozen=True)
class Reading:
    """A replica's newest numbers; None where it has not said (or, down, says nothing). `kv_used` is a
    fraction, latencies are seconds."""

    state: State
    note: str = ""  # why it is down or stale, or what a column lacks
    model: str = ""
    running: int | None = None
    waiting: int | None = None
    kv_used: float | None = None
    prefill_tps: float | None = None
    decode_tps: float | None = None
    ttft_p95: float | None = None
    tpot_p95: float | None = None

    @property
    def load(self) -> int | None:
        """Requests it holds: running plus waiting."""
        return None if self.running is None or self.waiting is None else self.running + self.waiting


def sample_p95(values: list[float]) -> float | None:
    """The p95 of exact values, as `minichat bench` computes its percentiles; None without values."""
    return percentile(values, 100 * Q) if values else None


def step_gaps(stats: Stats, window: float) -> list[float]:
    """Time per output token at the engine: for each request, the time between consecutive steps it was in,
    over the snapshot's recent steps of the last `window` seconds."""
    last: dict[str, float] = {}
    gaps = []
    for step in stats.steps:
        if step.at < stats.uptime - window:
            continue
        for rid in step.rids:
            if rid in last:
                gaps.append(step.at - last[rid])
            last[rid] = step.at
    return gaps


@dataclass(eq=False)
class EngineReplica:
    """An engine at a ZeroMQ address, through its link."""

    link: EngineLink

    @property
    def name(self) -> str:
        return self.link.address

    async def run(self) -> None:
        await self.link.run()

    def reading(self, now: float) -> Reading:
        state, stats = self.link.state, self.link.stats
        note = state.detail.replace(f" at {self.name}", "")  # the row names it already
        if state.kind in ("connecting", "starting"):
            return Reading("connecting", note)
        if not state.connected or stats is None:
            return Reading("down", note)
        age = now - self.link.stats_at
        stale = state.kind == "stalled" or age > STALE_AFTER
        c = stats.counters
        return Reading("stale" if stale else "up", f"no stats for {age:.0f} s" if stale else "",
                       model=stats.model, running=len(stats.running), waiting=len(stats.waiting),
                       kv_used=stats.pages.usage, prefill_tps=c.prefill_tokens_per_s,
                       decode_tps=c.decode_tokens_per_s, ttft_p95=sample_p95(stats.ttfts),
                       tpot_p95=sample_p95(step_gaps(stats, LATENCY_WINDOW)))


class BodyTooLarge(Exception):
    """A replica's /metrics went past MAX_BODY."""


class HttpReplica:
    """An HTTP replica's /metrics, read once a second; the reads of the last few seconds are kept, since
    rates and quantiles come from what changed between two of them."""

    def __init__(self, url: str) -> None:
        self.name = url
        self.metrics_url = url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"
        self.scrapes: deque[Scrape] = deque()
        self.error = ""  # why the last read failed ("" when it did not)
        self.down = False  # the last read found nothing listening, or nothing to trust (the row is down)

    async def run(self) -> None:
        key = os.environ.get(API_KEY_ENV)  # a minichat replica with a key wants it for /metrics too
        headers = {"Authorization": f"Bearer {key}"} if key else None
        async with httpx.AsyncClient(timeout=POLL_TIMEOUT, headers=headers) as client:
            while True:
                began = time.monotonic()
                await self.poll(client)
                await asyncio.sleep(max(0.0, POLL_EVERY - (time.monotonic() - began)))

    async def poll(self, client: httpx.AsyncClient) -> None:
        """One read, trusting nothing the replica sends: the whole answer within POLL_TIMEOUT and MAX_BODY,
        parsed on a worker thread (a large valid body takes the parser seconds). A replica that is unreachable,
        too slow, too large or not Prometheus is down, with the reason."""
        try:
            async with asyncio.timeout(POLL_TIMEOUT):
                body = await self._read(client)
            at = time.monotonic()
            scrape = await asyncio.to_thread(parse, body.decode("utf-8", "replace"), at)
        except httpx.ConnectError as e:
            self.error, self.down = f"unreachable: {e}", True
        except httpx.HTTPStatusError as e:
            self.error, self.down = f"HTTP {e.response.status_code} from {self.metrics_url}", False
        except (httpx.TimeoutException, TimeoutError):
            self.error, self.down = f"too slow: no whole answer within {POLL_TIMEOUT:g} s", True
        except httpx.HTTPError as e:
            self.error, self.down = f"{type(e).__name__} from {self.metrics_url}", False
        except BodyTooLarge:
            self.error, self.down = f"too large: /metrics over {MAX_BODY // 2**20} MiB", True
        except ValueError as e:
            self.error, self.down = f"not Prometheus text: {str(e)[:80]}", True
        else:
            self.error, self.down = "", False
            self.scrapes.append(scrape)
            while scrape.at - self.scrapes[0].at > LATENCY_WINDOW:
                self.scrapes.popleft()

    async def _read(self, client: httpx.AsyncClient) -> bytes:
        """The body, read as it streams and given up on past MAX_BODY (BodyTooLarge)."""
        async with client.stream("GET", self.metrics_url) as response:
            response.raise_for_status()
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > MAX_BODY:
                raise BodyTooLarge
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > MAX_BODY:
                    raise BodyTooLarge
            return bytes(body)

    def back(self, seconds: float) -> Scrape | None:
        """The read about `seconds` before the newest (the oldest kept if none is that old); None with one."""
        if len(self.scrapes) < 2:
            return None
        newest = self.scrapes[-1].at
        return next((s for s in reversed(self.scrapes) if s.at <= newest - seconds), self.scrapes[0])

    def p95(self, *names: str) -> float | None:
        """The 95th percentile of what the first histogram of `names` observed over the latency window."""
        new, old = self.scrapes[-1], self.back(LATENCY_WINDOW)
        name = next((n for n in names if n in new.histograms), None)
        if name is None or old is None:
            return None
        return quantile(Q, gained(new.histograms[name], old.histograms.get(name, ())))

    def reading(self, now: float) -> Reading:
        if self.down or (not self.scrapes and self.error):
            return Reading("down", self.error)
        if not self.scrapes:
            return Reading("connecting", f"reading {self.metrics_url}…")
        new = self.scrapes[-1]
        age = now - new.at
        if age > STALE_AFTER:
            state: State = "stale"
            note = f"no fresh numbers for {age:.0f} s" + (f" ({self.error})" if self.error else "")
        elif new.values.get("minichat_engine_up") == 0:
            state, note = "stale", "its engine publishes no stats"
        else:
            state, note = "up", ""
        old = self.back(RATE_WINDOW)
        running, waiting = new.first("vllm:num_requests_running"), new.first("vllm:num_requests_waiting")
        return Reading(
            state, note, model=new.models[0] if new.models else "",
            running=None if running is None else int(running), waiting=None if waiting is None else int(waiting),
            kv_used=new.first("vllm:kv_cache_usage_perc"),
            prefill_tps=rate(new, old, "minichat_engine_prefill_tokens_total", "vllm:prompt_tokens_total")
            if old else None,
            decode_tps=rate(new, old, "minichat_engine_decode_tokens_total", "vllm:generation_tokens_total")
            if old else None,
            ttft_p95=self.p95("vllm:time_to_first_token_seconds"),
            tpot_p95=self.p95("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"))


Replica = EngineReplica | HttpReplica


def is_http(address: str) -> bool:
    return address.startswith(("http://", "https://"))


def parse_engines(text: str) -> list[str]:
    """`ADDR1,ADDR2,...` -> the addresses, each once, in order; ValueError naming one that is neither a
    ZeroMQ address nor an http(s) URL."""
    addresses = list(dict.fromkeys(a.strip() for a in text.split(",") if a.strip()))
    if not addresses:
        raise ValueError("--engines needs at least one address")
    for address in addresses:
        if is_http(address):
            if not httpx.URL(address).host:
                raise ValueError(f"{address!r} names no host")
            continue
        try:
            split(address)
        except AddressError as e:
            raise ValueError(f"{address!r} is neither a ZeroMQ address nor an http(s) URL: {e}") from e
    return addresses


class Fleet:
    """The replicas, numbered from 1 in the order given (their row, and what `/engine N` names)."""

    def __init__(self, addresses: Iterable[str]) -> None:
        self.replicas: list[Replica] = [HttpReplica(a) if is_http(a) else
                                        EngineReplica(EngineLink(address=a, autostart=False)) for a in addresses]

    @property
    def engines(self) -> list[EngineReplica]:
        return [r for r in self.replicas if isinstance(r, EngineReplica)]

    def engine(self, address: str) -> EngineReplica | None:
        return next((r for r in self.engines if r.name == address), None)

    def number(self, link: EngineLink) -> int | None:
        """The row of the replica `link` watches (None for an engine outside the fleet)."""
        return next((i for i, r in enumerate(self.replicas, 1) if isinstance(r, EngineReplica) and r.link is link),
                    None)

    def readings(self, now: float | None = None) -> list[Reading]:
        now = time.monotonic() if now is None else now
        return [r.reading(now) for r in self.replicas]

    async def run(self) -> None:
        """Watch every replica, for the life of the app."""
        await asyncio.gather(*(r.run() for r in self.replicas))

    async def close(self) -> None:
        await asyncio.gather(*(r.link.close() for r in self.engines))


def imbalance(readings: Sequence[Reading]) -> str:
    """How unevenly the replicas that are up carry their load: the busiest and idlest by running + waiting,
    and the spread of their KV use (replicas named by number)."""
    up = [(i, r) for i, r in enumerate(readings, 1) if r.state == "up" and r.load is not None]
    if len(up) < 2:
        return f"imbalance: needs two replicas up ({len(up)} of {len(readings)} up)"
    ordered = sorted(up, key=lambda x: x[1].load or 0)
    (lo, idlest), (hi, busiest) = ordered[0], ordered[-1]
    most, least = busiest.load or 0, idlest.load or 0
    if most == 0:
        load = "load: every replica idle"
    else:
        ratio = f"{most / least:.1f}x" if least else f"#{lo} idle"
        load = f"load (running + waiting): #{hi} {most} vs #{lo} {least} ({ratio})"
    kv = sorted((r.kv_used, i) for i, r in up if r.kv_used is not None)
    if len(kv) < 2:
        return load
    (low, at_low), (high, at_high) = kv[0], kv[-1]
    return f"{load} · KV used #{at_low} {100 * low:.0f}% to #{at_high} {100 * high:.0f}%, " \
           f"spread {100 * (high - low):.0f} points"
