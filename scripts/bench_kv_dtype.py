"""float32 KV pages against int8 ones (--kv-cache-dtype) on the same model and pool bytes, side by side in one run.

    python scripts/bench_kv_dtype.py                      # SmolLM2-135M-Instruct's Q4_1 file (tests/real_model.py)
    python scripts/bench_kv_dtype.py --model PATH --kv-memory-gb 0.4 --rounds 3

Per KV dtype, in turn, each in a fresh process (the machine is shared and noisy: medians over rounds, ratios within
a round):
- capacity: 64 requests of 1,000-token prompts and 64 output tokens each (ignore_eos) into a pool of
  --kv-memory-gb: the most requests running at once, and the pool's pages;
- long-context decode: one request with a 4,000-token prompt, 128 greedy tokens: decode tok/s after the first token;
- throughput: 32 requests of 128-token prompts, 64 output tokens each, all at once: output tok/s.
Figures as JSON lines and a table; the disk KV tier is off (each run starts cold).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RUN = """
import json, sys, time
from engine import LLM, SamplingParams
model, kv_dtype, memory = sys.argv[1], sys.argv[2], float(sys.argv[3])

def prompt(n, seed):
    return [(i * 7919 + seed * 104729) % 20000 + 1000 for i in range(n)]

llm = LLM(model, kv_cache_dtype=kv_dtype, kv_memory_gb=memory, max_running_requests=64, kv_disk_gib=0, seed=0,
          max_prefill_tokens=2048)
out = {"kv": llm.kv.dtype_name, "pages": llm.num_pages, "page_bytes": llm.kv.page_bytes}
params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
for i in range(64):
    llm.add_request(prompt(1000, i), params)
most = 0
while llm.has_unfinished():
    llm.step()
    most = max(most, len(llm.stats().running))
out["most_running"] = most
llm.add_request(prompt(4000, 99), SamplingParams(max_tokens=1, temperature=0))
while llm.has_unfinished():
    llm.step()
first, tokens = None, 0
llm.add_request(prompt(4000, 98), SamplingParams(max_tokens=128, temperature=0, ignore_eos=True))
while llm.has_unfinished():
    result = llm.step()
    if result.num_decode_tokens:
        tokens += result.num_decode_tokens
        first = first or time.perf_counter()
out["decode_4k"] = (tokens - 1) / (time.perf_counter() - first)
for i in range(32):
    llm.add_request(prompt(128, 200 + i), params)
start, tokens = time.perf_counter(), 0
while llm.has_unfinished():
    tokens += llm.step().num_decode_tokens
out["throughput_c32"] = tokens / (time.perf_counter() - start)
print(json.dumps(out))
"""


def run(model: str, kv_dtype: str, memory: float) -> dict:
    done = subprocess.run([sys.executable, "-c", RUN, model, kv_dtype, str(memory)], capture_output=True, text=True,
                          cwd=ROOT, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="default: SmolLM2-135M-Instruct's Q4_1 file, fetched once")
    parser.add_argument("--kv-memory-gb", type=float, default=0.4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.model is None:
        from tests.real_model import smollm2_gguf

        args.model = str(smollm2_gguf())
    rows: dict[str, list[dict]] = {"float32": [], "int8": []}
    for round_ in range(args.rounds):
        for kv_dtype in rows:
            figures = run(args.model, kv_dtype, args.kv_memory_gb)
            rows[kv_dtype].append(figures)
            print(json.dumps({"round": round_ + 1, **figures}), flush=True)
    print(f"\n{Path(args.model).name}, KV pool {args.kv_memory_gb} GB, {time.strftime('%F %T %Z')}\n")
    print("| KV pages | pages (bytes each) | most running of 64 x 1,000-token prompts | decode at 4,000 tokens, tok/s "
          "| 32 at once, output tok/s |")
    print("|---|---|---|---|---|")
    base = {k: statistics.median(r[k] for r in rows["float32"]) for k in ("most_running", "decode_4k",
                                                                            "throughput_c32")}
    for kv_dtype, runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs) for k in base}
        ratio = {k: f" ({med[k] / base[k]:.2f}x)" if kv_dtype != "float32" else "" for k in base}
        print(f"| {kv_dtype} | {runs[0]['pages']:,} ({runs[0]['page_bytes'] / 1024:.0f} KiB) | "
              f"{med['most_running']:.0f}{ratio['most_running']} | {med['decode_4k']:.1f}{ratio['decode_4k']} | "
              f"{med['throughput_c32']:.1f}{ratio['throughput_c32']} |")


if __name__ == "__main__":
    main()
