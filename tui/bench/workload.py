"""Synthetic workloads with exact token lengths, like `vllm bench serve --dataset-name random`."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class BenchRequest:
    prompt_ids: list[int]
    output_len: int


def draw_len(rng: random.Random, length: int, range_ratio: float) -> int:
    """Uniform in [len * (1 - r), len * (1 + r)], at least 1."""
    low = max(1, round(length * (1 - range_ratio)))
    high = max(low, round(length * (1 + range_ratio)))
    return rng.randint(low, high)


def make_workload(vocab: list[int], num_requests: int, input_len: int, output_len: int, range_ratio: float,
                  seed: int) -> list[BenchRequest]:
    """Prompts sent as token ids drawn from `vocab` (ordinary tokens only), so lengths are exact."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1); got {range_ratio}")
    if input_len < 1 or output_len < 1 or num_requests < 1:
        raise ValueError("--input-len, --output-len and --num-requests must be at least 1")
    rng = random.Random(seed)
    return [
        BenchRequest([rng.choice(vocab) for _ in range(draw_len(rng, input_len, range_ratio))],
                     draw_len(rng, output_len, range_ratio))
        for _ in range(num_requests)
    ]


def arrival_gaps(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: all at once for `inf`, else Poisson arrivals."""
    if request_rate == float("inf"):
        return [0.0] * num_requests
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 or inf; got {request_rate}")
    rng = random.Random(seed + 1)
    return [0.0] + [rng.expovariate(request_rate) for _ in range(num_requests - 1)]
