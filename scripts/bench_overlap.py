"""Overlap on vs off, in process: `LLM.generate` throughput with the same engine, alternating runs.

    python scripts/bench_overlap.py                       # the demo model
    python scripts/bench_overlap.py --model /tmp/qwen2.5-0.5b-random --dtype bfloat16

Each run submits `--concurrency` requests of `--input-len` fresh random prompt tokens (no prefix-cache
hits) and `--output-len` output tokens (EOS ignored); runs alternate between overlap off and on so a
noisy machine hurts both alike. Prints per-mode medians of output tokens/s and of the decode step time,
the median on/off ratio over back-to-back pairs, and checks that both modes produced the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine import LLM, SamplingParams


def run_once(llm: LLM, overlap: bool, prompts: list[list[int]], output_len: int) -> tuple[float, float, list]:
    """Output tokens/s, median decode step (s) and the outputs of one generate-like run."""
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    rids = [llm.add_request(p, params) for p in prompts]
    reqs = {rid: llm.request(rid) for rid in rids}
    decode_steps: list[float] = []
    last = start = time.perf_counter()
    while llm.has_unfinished():
        result = llm.step(overlap)
        now = time.perf_counter()
        if result.kind == "decode":
            decode_steps.append(now - last)  # wall time between results: what a client sees per token
        last = now
    elapsed = time.perf_counter() - start
    outputs = [list(reqs[r].output_ids) for r in rids]
    return sum(map(len, outputs)) / elapsed, statistics.median(decode_steps), outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(args.model, dtype=args.dtype, max_running_requests=args.concurrency, prefix_cache="naive")
    vocab = llm.model.spec.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.input_len,), generator=g).tolist() for _ in range(args.concurrency)]
    run_once(llm, False, prompts[:2], 4)  # warm-up
    results: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    reference = None
    for _ in range(args.repeats):
        for overlap in (False, True):
            tok_s, step_s, outputs = run_once(llm, overlap, prompts, args.output_len)
            results[overlap].append((tok_s, step_s))
            print(f"  run: overlap {'on ' if overlap else 'off'} {tok_s:8.1f} out tok/s, decode step "
                  f"{step_s * 1e3:6.2f} ms", flush=True)
            reference = reference if reference is not None else outputs
            assert outputs == reference, f"overlap={overlap} produced different tokens"
    print(f"model {llm.checkpoint.path}, {args.dtype}, "
          f"{args.concurrency} x {args.input_len} in / {args.output_len} out, {args.repeats} runs each, "
          f"torch threads {torch.get_num_threads()}")
    for overlap in (False, True):
        tok = statistics.median(r[0] for r in results[overlap])
        step = statistics.median(r[1] for r in results[overlap])
        label = "on " if overlap else "off"
        print(f"  overlap {label}: {tok:8.1f} out tok/s (median), decode step {step * 1e3:6.2f} ms")
    pairs = [on[0] / off[0] for off, on in zip(results[False], results[True], strict=True)]
    print(f"  on/off throughput ratio: median of {len(pairs)} back-to-back pairs {statistics.median(pairs):.3f} "
          f"(each: {', '.join(f'{r:.2f}' for r in pairs)})")


if __name__ == "__main__":
    main()
