"""Prometheus metrics for `GET /metrics` (prometheus_client), one registry per app (no global state).

Two sources:
- the engine's own stats stream (queues, slots, KV pages, its request and token totals), exported by a
  custom collector from the newest snapshot, so the numbers are the engine's and include requests
  that did not come through HTTP (the console, `minichat bench`);
- what the front end observes per HTTP request: token counters from each request's usage, finish
  reasons, and histograms of TTFT, inter-token latency and end-to-end latency as the client sees them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.service.protocol import Stats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


class EngineStatsCollector(Collector):
    """Exports the newest engine stats snapshot; `minichat_engine_up` says whether there is a fresh one."""

    def __init__(self) -> None:
        self.stats: Stats | None = None
        self.received_at = -float("inf")

    def update(self, stats: Stats) -> None:
        self.stats, self.received_at = stats, time.monotonic()

    def fresh(self, within: float) -> bool:
        """A snapshot arrived in the last `within` seconds (the engine publishes about ten a second)."""
        return time.monotonic() - self.received_at < within

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        yield GaugeMetricFamily("minichat_engine_up", "1 while the engine publishes stats, else 0.",
                                value=int(self.fresh(5.0)))
        if s is None:
            return
        gauges = {
            "minichat_requests_waiting": ("Requests in the engine's waiting queue.", len(s.waiting)),
            "minichat_requests_running": ("Requests holding a request slot.", len(s.running)),
            "minichat_request_slots_free": ("Request slots nobody holds.", sum(r is None for r in s.slots)),
            "minichat_kv_pages_free": ("KV pages free.", s.pages.free),
            "minichat_kv_pages_used": ("KV pages running requests use (held, or cached and locked).",
                                       s.pages.held + s.pages.locked),
            "minichat_kv_pages_cached": ("KV pages holding reusable prefixes nobody is using.", s.pages.cached),
            "minichat_kv_pages_total": ("KV pages in the pool.", s.pages.total),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        c = s.counters
        totals = {
            "minichat_engine_requests_submitted": ("Requests the engine accepted.", c.submitted),
            "minichat_engine_requests_finished": ("Requests that ended with stop or length.", c.finished),
            "minichat_engine_requests_aborted": ("Requests aborted (client gone, abort, shutdown).", c.aborted),
            "minichat_engine_errors": ("Messages the engine refused.", c.errors),
            "minichat_engine_prefill_tokens": ("Prompt tokens the engine computed (prefix-cache hits excluded).",
                                               c.prefill_tokens),
            "minichat_engine_decode_tokens": ("Tokens the engine generated.", c.decode_tokens),
            "minichat_retractions": ("Running requests sent back to the waiting queue when the KV pool ran dry "
                                     "(they resume where they were).", c.retractions),
        }
        for name, (doc, value) in totals.items():
            yield CounterMetricFamily(name, doc, value=value)


class Metrics:
    """The app's registry: engine stats plus the front end's own counters and histograms."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.engine = EngineStatsCollector()
        self.registry.register(self.engine)
        self.prompt_tokens = Counter("minichat_prompt_tokens", "Prompt tokens of finished HTTP requests.",
                                     registry=self.registry)
        self.generation_tokens = Counter("minichat_generation_tokens", "Tokens generated for HTTP requests.",
                                         registry=self.registry)
        self.requests = Counter("minichat_http_requests", "HTTP generation requests by endpoint and outcome: "
                                "stop, length or abort for each of a request's prompts, or the error status "
                                "once for a refused request.", ["endpoint", "outcome"], registry=self.registry)
        self.ttft = Histogram("minichat_time_to_first_token_seconds", "Request arrival to first token, at the "
                              "front end.", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("minichat_inter_token_latency_seconds", "Gap between consecutive streamed outputs.",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("minichat_e2e_request_latency_seconds", "Request arrival to its last token.",
                             buckets=LATENCY_BUCKETS, registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Times one request's outputs into the histograms: the first token, each gap, the whole."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.start = self.last = time.perf_counter()
        self.first = True

    def tokens(self) -> None:
        """Call when an output carrying tokens arrives."""
        now = time.perf_counter()
        (self.metrics.ttft if self.first else self.metrics.itl).observe(now - (self.start if self.first else self.last))
        self.first, self.last = False, now

    def done(self) -> None:
        self.metrics.e2e.observe(time.perf_counter() - self.start)
