"""Offline throughput on nano-vllm's and mini-sglang's workload: in-process `LLM.generate`.

    python scripts/bench_offline.py /tmp/qwen05b --dtype bfloat16 --device cuda        # the anchors' run
    python scripts/bench_offline.py engine/demo_model --num-seqs 16 --max-len 128      # a quick CPU look

The workload is theirs: `--num-seqs` sequences (256) of random token ids, input and output lengths
drawn uniformly from [100, `--max-len`] (1024) with a fixed seed, EOS ignored, everything submitted
at once. Prints output tokens/s over the timed run (after one warm-up request), the engine's
execution options, and the scheduler's step counts, so a figure can be set beside nano-vllm's and
vLLM's published ones on the same workload.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from engine import LLM, SamplingParams


def workload(num_seqs: int, min_len: int, max_len: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """Prompts and output lengths as nano-vllm's bench.py draws them (uniform lengths, random ids)."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, vocab - 1) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_seqs)]
    outputs = [rng.randint(min_len, max_len) for _ in range(num_seqs)]
    return prompts, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="checkpoint directory")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-running-requests", type=int, default=256)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_running_requests=args.max_running_requests,
              max_model_len=2 * args.max_len + 1, kv_disk_gib=0)  # compute: no prompt loaded from an earlier run
    prompts, outputs = workload(args.num_seqs, args.min_len, args.max_len, llm.model.spec.vocab_size, args.seed)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up: kernels, graphs
    steps_before = llm.stats().counters.steps
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in outputs]
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    generated = sum(len(r.token_ids) for r in results)
    snap = llm.stats()
    figures = {"model": args.model, "device": args.device, "dtype": args.dtype, "num_seqs": args.num_seqs,
               "lengths": [args.min_len, args.max_len], "prompt_tokens": sum(map(len, prompts)),
               "output_tokens": generated, "seconds": elapsed, "output_tokens_per_s": generated / elapsed,
               "steps": snap.counters.steps - steps_before, "retractions": snap.counters.retractions,
               "execution": llm.execution}
    print(f"{generated} output tokens in {elapsed:.2f} s: {generated / elapsed:,.0f} output tok/s "
          f"({figures['steps']} steps, {figures['retractions']} retractions; {llm.execution})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    llm.close()


if __name__ == "__main__":
    main()
