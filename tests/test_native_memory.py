"""Engine memory stays bounded when any client varies prompt lengths (issue 25, item 14): oneDNN keeps
a JIT-compiled primitive per GEMM row count in two caches, so prepacked GEMMs run on bucketed row
counts (engine/model/ops.py). Once every bucket has been met, rounds of random lengths add nothing."""

from __future__ import annotations

import random

import torch

from engine import LLM, SamplingParams
from engine.model.ops import row_bucket

DEMO = "engine/demo_model"


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def test_row_buckets_bound_the_row_counts_with_little_padding():
    buckets = {row_bucket(n) for n in range(1, 4097)}
    assert len(buckets) == 68
    assert all(row_bucket(n) == n for n in range(1, 9))
    assert all(n <= row_bucket(n) <= n * 1.125 for n in range(65, 5000))
    assert all(row_bucket(row_bucket(n)) == row_bucket(n) for n in range(1, 5000))


def test_rss_plateaus_across_rounds_of_varied_lengths():
    llm = LLM(DEMO, max_prefill_tokens=512, threads=1)  # one thread count: one primitive per bucket
    assert llm.model.layers[0].qkv_proj.weight.is_mkldnn, "the test is about prepacked weights"
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randint(10, 3000) for _ in range(n)]

    for n in sorted({row_bucket(n) for n in range(1, 513)}):  # meet every bucket a step can have
        llm.generate([tokens(n)], SamplingParams(max_tokens=2, ignore_eos=True))
    rounds = []
    for _ in range(7):
        prompts = [tokens(rng.randint(1, 500)) for _ in range(40)]
        llm.generate(prompts, SamplingParams(max_tokens=rng.randint(1, 8), ignore_eos=True))
        rounds.append(rss_mib())
    # unbucketed, each round met new row counts at ~0.7 MiB each and kept them: 13 MiB in 4 rounds
    assert rounds[-1] - rounds[0] < 10, f"RSS by round (MiB): {[round(r) for r in rounds]}"
    llm.check_integrity()
    assert torch.get_num_threads() == 1
