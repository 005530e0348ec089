"""A replica's `/metrics` (Prometheus text) read into what the fleet view needs: totals and gauges, and
histograms as cumulative buckets, each summed over its labels (a replica serves one model, which vLLM's
names label `model_name`; finish reasons and the like add up). prometheus_client's own parser reads
the text; what is computed here is what Prometheus would compute from two scrapes: a counter's rate,
and a quantile from the buckets a histogram gained in between (`histogram_quantile` over `increase`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

Buckets = tuple[tuple[float, float], ...]
"""A histogram as (upper bound, observations at or below it), bounds ascending, +Inf last."""


@dataclass(frozen=True)
class Scrape:
    """One read of `/metrics`, taken at `at` (monotonic seconds)."""

    at: float
    values: dict[str, float]  # sample name (counters with their `_total`) -> value over every label
    histograms: dict[str, Buckets]  # family name -> its buckets over every label
    models: tuple[str, ...] = ()  # the `model_name` labels seen

    def first(self, *names: str) -> float | None:
        """The first of `names` this replica exports (minichat's own name, then the one vLLM also has)."""
        return next((self.values[n] for n in names if n in self.values), None)


def parse(text: str, at: float) -> Scrape:
    """Read Prometheus text; ValueError when it is not that."""
    values: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    models: dict[str, None] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):  # when a series began: a timestamp, not a number to show
                continue
            if model := sample.labels.get("model_name"):
                models[model] = None
            if family.type == "histogram" and sample.name.endswith("_bucket"):
                per_bound = buckets.setdefault(family.name, {})
                bound = float(sample.labels["le"])
                per_bound[bound] = per_bound.get(bound, 0.0) + sample.value
            else:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return Scrape(at, values, {name: tuple(sorted(b.items())) for name, b in buckets.items()}, tuple(models))


def rate(new: Scrape, old: Scrape, *names: str) -> float | None:
    """Per second between two scrapes, of the first counter of `names` the replica exports; None without
    a span or across a restart (the counter went down)."""
    now, before = new.first(*names), old.first(*names)
    span = new.at - old.at
    if now is None or before is None or span <= 0 or now < before:
        return None
    return (now - before) / span


def gained(new: Buckets, old: Buckets) -> Buckets:
    """The observations a histogram gained since `old`; all of `new` across a restart (a count went down)."""
    before = dict(old)
    diff = tuple((bound, count - before.get(bound, 0.0)) for bound, count in new)
    return new if any(count < 0 for _, count in diff) else diff


def quantile(q: float, buckets: Buckets) -> float | None:
    """Prometheus' `histogram_quantile`: the bucket the q-th observation falls in, linearly inside it (from 0
    for the first); the highest finite bound when it falls above them all; None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower = below = 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower
