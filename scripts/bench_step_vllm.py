"""The vLLM CPU side of `bench_step.py`: run by the vLLM venv's interpreter, one round per line on stdin.

It cannot import minichat (it runs under another venv's torch), so it takes its shape as one JSON
argument from `bench_step.py` and answers on stdout: `READY {"startup": s}` once the engine is built,
then `ROUND {"prefill": s, "decode": s}` for every line read from stdin. vLLM's own log lines go to
the same stream; the caller skips them.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the caller), so that
`llm.llm_engine.step()` is exactly one scheduler step and one forward, like minichat's `LLM.step()`:
prefill = the step that takes `n` fresh prompts of `len` tokens at once; decode = the median step
with `b` requests running, each step giving every one of them a token.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import time

import torch
import vllm
from vllm import LLM, SamplingParams

KV_CACHE_BYTES = 1 << 30
"""Asked for outright: by default vLLM on CPU sizes its KV cache by a fraction of all memory."""

a = json.loads(sys.argv[1])
n, b, length, steps = a["n"], a["b"], a["len"], a["steps"]
start = time.perf_counter()
llm = LLM(a["model"], dtype=a["dtype"], skip_tokenizer_init=True, enable_prefix_caching=False,
          max_num_seqs=max(n, b), max_num_batched_tokens=max(n, b) * length,
          max_model_len=length + steps + 8, kv_cache_memory_bytes=KV_CACHE_BYTES, seed=0)
engine = llm.llm_engine
print("READY " + json.dumps({"version": vllm.__version__, "startup": time.perf_counter() - start,
                                 "threads": torch.get_num_threads()}), flush=True)
params = SamplingParams(max_tokens=steps + 2, ignore_eos=True, temperature=0.0, detokenize=False)
ids = (str(i) for i in itertools.count())


def add(count: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, a["vocab"], (count, length), generator=g).tolist()
    return [engine.add_request(next(ids), {"prompt_token_ids": p}, params) for p in prompts]


def timed_step() -> tuple[float, list]:
    start = time.perf_counter()
    outputs = engine.step()
    return time.perf_counter() - start, outputs


for rep, _ in enumerate(sys.stdin):
    running = add(n, rep)
    took, outputs = timed_step()
    assert len(outputs) == n and all(len(o.outputs[0].token_ids) == 1 for o in outputs), \
        "the prefill did not fit one step"
    # Decode with exactly `b` running: top up (or trim) the batch first, untimed.
    if b > n:
        running += add(b - n, 1000 + rep)
        engine.step()
    engine.abort_request(running[b:], internal=True)
    decode = []
    for _ in range(steps):
        step, outputs = timed_step()
        decode.append(step)
        assert len(outputs) == b, f"a decode step gave {len(outputs)} tokens, not {b}"
    engine.abort_request(running[:b], internal=True)
    assert not engine.has_unfinished_requests()
    print("ROUND " + json.dumps({"prefill": took, "decode": statistics.median(decode)}), flush=True)
