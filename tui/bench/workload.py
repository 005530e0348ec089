"""Synthetic workloads with exact token lengths, like `vllm bench serve --dataset-name random`, optionally
with shared prefixes, like its `prefix_repetition` dataset: each prompt is one of K random prefixes followed
by a random suffix of its own, the shape that prefix caches (and cache-aware routing) are for."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

Spell = Callable[[list[int]], "str | None"]
"""The prompt as text that the tokenizer reads back as exactly these ids, or None where it would not."""


@dataclass
class BenchRequest:
    prompt_ids: list[int]
    output_len: int
    text: str | None = None  # the prompt spelled out (reads back as exactly prompt_ids); None: send the ids


def draw_len(rng: random.Random, length: int, range_ratio: float) -> int:
    """Uniform in [len * (1 - r), len * (1 + r)], at least 1."""
    low = max(1, round(length * (1 - range_ratio)))
    high = max(low, round(length * (1 + range_ratio)))
    return rng.randint(low, high)


def make_workload(vocab: list[int], num_requests: int, input_len: int, output_len: int, range_ratio: float,
                  seed: int, prefix_len: int = 0, num_prefixes: int = 1,
                  spell: Spell | None = None) -> list[BenchRequest]:
    """Prompts of token ids drawn from `vocab` (ordinary tokens only), so lengths are exact: with `prefix_len`,
    one of `num_prefixes` shared prefixes of that many tokens (as many prompts on each, shuffled), then
    `input_len` tokens of its own. `spell` adds each prompt's text, for servers that take no ids."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1); got {range_ratio}")
    if input_len < 1 or output_len < 1 or num_requests < 1:
        raise ValueError("--input-len, --output-len and --num-requests must be at least 1")
    if prefix_len < 0 or num_prefixes < 1:
        raise ValueError("--prefix-len must be at least 0 and --num-prefixes at least 1")
    rng = random.Random(seed)
    workload = [
        BenchRequest([rng.choice(vocab) for _ in range(draw_len(rng, input_len, range_ratio))],
                     draw_len(rng, output_len, range_ratio))
        for _ in range(num_requests)
    ]
    if prefix_len:  # drawn after the suffixes: without a prefix, a seed gives the workload it always gave
        prefixes = [[rng.choice(vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]
        groups = [i % num_prefixes for i in range(num_requests)]
        rng.shuffle(groups)
        for req, group in zip(workload, groups, strict=True):
            req.prompt_ids = prefixes[group] + req.prompt_ids
    if spell is not None:
        for req in workload:
            req.text = spell(req.prompt_ids)
    return workload


def arrival_gaps(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: all at once for `inf`, else Poisson arrivals."""
    if request_rate == float("inf"):
        return [0.0] * num_requests
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 or inf; got {request_rate}")
    rng = random.Random(seed + 1)
    return [0.0] + [rng.expovariate(request_rate) for _ in range(num_requests - 1)]
