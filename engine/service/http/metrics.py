"""Prometheus metrics for `GET /metrics` (prometheus_client), one registry per app (no global state).

Two sources:
- the engine's own stats stream (queues, slots, KV pages, its request and token totals), exported by a
  custom collector from the newest snapshot, so the numbers are the engine's and include requests
  that did not come through HTTP (the console, `minichat bench`);
- what the front end observes per HTTP request: token counters from each request's usage, finish
  reasons, and histograms of TTFT, inter-token latency and end-to-end latency as the client sees them.

Both are exported twice: under minichat's names, and under vLLM's (`vllm:num_requests_running`,
`vllm:kv_cache_usage_perc` as a fraction, `vllm:prompt_tokens_total`, `vllm:time_to_first_token_seconds`,
... labelled `model_name`), so tools built for a vLLM fleet (llm-d's endpoint picker, vllm-htop,
vLLM's Grafana dashboard) read a minichat replica as they read vLLM. vLLM counts prompt tokens and
prefix-cache hits in its engine; here they are the HTTP requests' (usage), which is all a replica
behind a gateway serves.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.outputs import Final
from engine.pages import REJECTIONS
from engine.service.protocol import Stats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


class EngineStatsCollector(Collector):
    """Exports the newest engine stats snapshot; `minichat_engine_up` says whether there is a fresh one."""

    def __init__(self) -> None:
        self.stats: Stats | None = None
        self.received_at = -float("inf")
        self.model_name = ""  # vLLM's `model_name` label, once the front end knows the served name

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
                                       s.pages.used),
            "minichat_kv_pages_cached": ("KV pages holding reusable prefixes nobody is using.", s.pages.cached),
            "minichat_kv_pages_total": ("KV pages in the pool.", s.pages.total),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        if s.pages.dtype:
            dtype = GaugeMetricFamily("minichat_kv_cache_dtype", "1, labelled with what the KV pages hold "
                                      "(--kv-cache-dtype: int8 or a float dtype).", labels=["dtype"])
            dtype.add_metric([s.pages.dtype], 1)
            yield dtype
            yield GaugeMetricFamily("minichat_kv_page_bytes", "Bytes of one KV page (every layer's K and V).",
                                    value=s.pages.page_bytes)
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
            "minichat_spec_drafts": ("Verifications of speculative drafts (one per request and step).", c.spec_drafts),
            "minichat_spec_draft_tokens": ("Speculative draft tokens verified.", c.spec_draft_tokens),
            "minichat_spec_accepted_tokens": ("Speculative draft tokens accepted.", c.spec_accepted_tokens),
        }
        for name, (doc, value) in totals.items():
            yield CounterMetricFamily(name, doc, value=value)
        yield from self._tiers(s)
        yield from self._vllm(s)

    @staticmethod
    def _tiers(s: Stats) -> Iterator[Metric]:
        """The KV tiers: pages and bytes each holds (the pool's are above), prompt tokens each served, pages
        stored and loaded, and the disk's refused files and failed writes."""
        c = s.counters
        hits = CounterMetricFamily("minichat_kv_hit_tokens", "Prompt tokens admission found cached, by the tier that "
                                   "held them (pool, host, disk).", labels=["tier"])
        for name, value in (("pool", c.hit_tokens_pool), ("host", c.hit_tokens_host), ("disk", c.hit_tokens_disk)):
            hits.add_metric([name], value)
        yield hits
        per_tier = {
            "pages": (GaugeMetricFamily, "minichat_kv_tier_pages", "KV pages a tier below the pool holds."),
            "capacity": (GaugeMetricFamily, "minichat_kv_tier_capacity_pages", "KV pages a tier below the pool "
                         "can hold."),
            "bytes": (GaugeMetricFamily, "minichat_kv_tier_bytes", "Bytes a tier below the pool holds (the disk: "
                      "every model's page files in its directory)."),
            "stored": (CounterMetricFamily, "minichat_kv_tier_stored_pages", "KV pages stored into a tier."),
            "loaded": (CounterMetricFamily, "minichat_kv_tier_loaded_pages", "KV pages loaded back to the pool."),
            "skipped": (CounterMetricFamily, "minichat_kv_tier_skipped_pages", "KV pages not stored: the write "
                        "queue was full, or writing was paused after a failure."),
        }
        for field, (kind, name, doc) in per_tier.items():
            family = kind(name, doc, labels=["tier"])
            for tier in s.pages.tiers:
                family.add_metric([tier.name], getattr(tier, field))
            yield family
        rejected = CounterMetricFamily("minichat_kv_disk_rejected_files", "KV page files not used (and deleted), by "
                                       "why: truncated, corrupt, foreign (another model or layout), missing.",
                                       labels=["reason"])
        errors = CounterMetricFamily("minichat_kv_disk_write_errors", "KV page files that could not be written "
                                     "(a full disk, say).")
        for tier in s.pages.tiers:
            if tier.name == "disk":
                for reason in REJECTIONS:
                    rejected.add_metric([reason], tier.rejected.get(reason, 0))
                errors.add_metric([], tier.write_errors)
        yield rejected
        yield errors

    def _vllm(self, s: Stats) -> Iterator[Metric]:
        """The same numbers under vLLM's names and label."""
        label = {"model_name": self.model_name}
        gauges = {
            "vllm:num_requests_running": ("Requests in the running set.", len(s.running)),
            "vllm:num_requests_waiting": ("Requests in the waiting queue.", len(s.waiting)),
            "vllm:kv_cache_usage_perc": ("KV-cache usage; 1 means 100 percent.", s.pages.usage),
        }
        for name, (doc, value) in gauges.items():
            family = GaugeMetricFamily(name, doc, labels=list(label))
            family.add_metric(list(label.values()), value)
            yield family
        c = s.counters
        totals = {
            "vllm:num_preemptions": ("Requests preempted (retracted to the waiting queue) since the engine started.",
                                     c.retractions),
            "vllm:spec_decode_num_drafts": ("Requests' steps that verified speculative drafts.", c.spec_drafts),
            "vllm:spec_decode_num_draft_tokens": ("Speculative draft tokens verified.", c.spec_draft_tokens),
            "vllm:spec_decode_num_accepted_tokens": ("Speculative draft tokens accepted.", c.spec_accepted_tokens),
        }
        for name, (doc, value) in totals.items():
            counter = CounterMetricFamily(name, doc, labels=list(label))
            counter.add_metric(list(label.values()), value)
            yield counter


class Metrics:
    """The app's registry: engine stats plus the front end's own counters and histograms. A multi-model server's
    front has no engine of its own (`engine=False`: its stats are not exported; each model's Metrics has them)."""

    def __init__(self, engine: bool = True) -> None:
        self.registry = CollectorRegistry()
        self.engine = EngineStatsCollector()
        if engine:
            self.registry.register(self.engine)
        self.prompt_tokens = Counter("minichat_prompt_tokens", "Prompt tokens of finished HTTP requests.",
                                     registry=self.registry)
        self.generation_tokens = Counter("minichat_generation_tokens", "Tokens generated for HTTP requests.",
                                         registry=self.registry)
        self.requests = Counter("minichat_http_requests", "HTTP requests by endpoint and outcome: stop, length, "
                                "abort or cut (the engine failed mid-way) for each prompt of a generation request, "
                                "or the error status once for any refused request (the API key, body and field "
                                "checks included).",
                                ["endpoint", "outcome"], registry=self.registry)
        self.ttft = Histogram("minichat_time_to_first_token_seconds", "Request arrival to first token, at the "
                              "front end.", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("minichat_inter_token_latency_seconds", "Gap between consecutive streamed outputs.",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("minichat_e2e_request_latency_seconds", "Request arrival to its last token.",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.vllm = VllmMetrics(self.registry)

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @model_name.setter
    def model_name(self, name: str) -> None:
        self.engine.model_name = name

    def finished(self, final: Final) -> None:
        """A generation request's Final: its tokens and outcome, under both names."""
        u = final.usage
        self.prompt_tokens.inc(u.prompt_tokens)
        self.generation_tokens.inc(u.completion_tokens)
        v, name = self.vllm, self.model_name
        v.prompt_tokens.labels(name).inc(u.prompt_tokens)
        v.generation_tokens.labels(name).inc(u.completion_tokens)
        v.prefix_cache_queries.labels(name).inc(u.prompt_tokens)
        v.prefix_cache_hits.labels(name).inc(u.cached_tokens)
        v.request_success.labels(name, final.finish_reason).inc()
        if final.timings.queue is not None:
            v.queue.labels(name).observe(final.timings.queue)

    def render(self) -> bytes:
        return generate_latest(self.registry)


ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/messages": "messages",
             "/v1/messages/count_tokens": "count_tokens", "/v1/responses": "responses", "/tokenize": "tokenize",
             "/detokenize": "detokenize", "/v1/models": "models", "/health": "health", "/metrics": "metrics"}


def endpoint_label(path: str) -> str:
    """The `endpoint` label of a request path: one of a few names (a label per path a client invents would
    let it grow the registry without bound)."""
    return ENDPOINTS.get(path) or ("models" if path.startswith("/v1/models/") else "other")


class VllmMetrics:
    """The front end's counters and histograms under vLLM's names (the engine's gauges are the collector's)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, ["model_name", *labels], registry=registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=LATENCY_BUCKETS, registry=registry)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens of finished requests.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                            "cache.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prompt tokens the prefix cache served.")
        self.request_success = counter("vllm:request_success", "Finished requests by finish reason.",
                                       "finished_reason")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to the first token.")
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between streamed outputs.")
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Time per output token after the first "
                              "(vLLM's older name for the same).")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Request arrival to its last token.")
        self.queue = histogram("vllm:request_queue_time_seconds", "Time in the engine's waiting queue.")


class RequestTimer:
    """Times one request's outputs into the histograms, under both names: the first token, each gap,
    the whole."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.start = self.last = time.perf_counter()
        self.first = True

    def tokens(self) -> None:
        """Call when an output carrying tokens arrives."""
        now = time.perf_counter()
        m, v, name = self.metrics, self.metrics.vllm, self.metrics.model_name
        if self.first:
            m.ttft.observe(now - self.start)
            v.ttft.labels(name).observe(now - self.start)
        else:
            m.itl.observe(now - self.last)
            v.itl.labels(name).observe(now - self.last)
            v.tpot.labels(name).observe(now - self.last)
        self.first, self.last = False, now

    def done(self) -> None:
        self.metrics.e2e.observe(time.perf_counter() - self.start)
        self.metrics.vllm.e2e.labels(self.metrics.model_name).observe(time.perf_counter() - self.start)
