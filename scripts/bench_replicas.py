"""One replica against two behind SGLang's Model Gateway (smg, round_robin and cache_aware), side by side
in one run, on a shared-prefix workload: `minichat bench --backend openai` against each setup, one table of
output throughput, TTFT p50 / p95 and the prompt tokens the replicas' prefix caches served.

    python scripts/bench_replicas.py                               # the table in docs/benchmarks.md (demo model)
    python scripts/bench_replicas.py --num-requests 8 --prefix-len 64 --input-len 8 --output-len 4   # smoke
    python scripts/bench_replicas.py --rounds 3 --serve-args "--model /tmp/qwen05b --dtype bfloat16"

Every setup starts from fresh replicas (`minichat serve --http`, one short request each to warm them), so
each meets the same prefixes cold; within a round the setups run in turn, their order alternating between
rounds. smg runs with its defaults (plus --smg-args): what the recipe in docs/replicas.md gives. "from
cache" is what the replicas' `vllm:prefix_cache_hits` counters moved by over the run, of the prompt tokens
they were sent (`vllm:prefix_cache_queries`); "spread" is each replica's share of the requests
(`vllm:request_success`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import httpx

from tui.bench.fleet import Replica, gateway, replica, vllm_counters

SETUPS = {"1 replica": (1, None), "2 replicas, smg round_robin": (2, "round_robin"),
          "2 replicas, smg cache_aware": (2, "cache_aware")}
COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:request_success_total")


def warm(rep: Replica) -> str:
    """One short request; returns the replica's checkpoint, for the benchmark's --tokenizer (smg's
    /v1/models does not pass on the `root` that bench reads it from)."""
    card = httpx.get(rep.url + "/v1/models", timeout=30).json()["data"][0]
    reply = httpx.post(rep.url + "/v1/completions", json={"model": card["id"], "prompt": "Warm up",
                                                          "max_tokens": 2}, timeout=120)
    reply.raise_for_status()
    return card["root"]


def run_setup(setup: str, args: argparse.Namespace, smg: str) -> dict:
    """Fresh replicas (and a gateway), the benchmark through them, and what their counters moved by."""
    replicas, policy = SETUPS[setup]
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        reps = [stack.enter_context(replica(*shlex.split(args.serve_args))) for _ in range(replicas)]
        checkpoints = [warm(rep) for rep in reps]
        url = reps[0].url if policy is None else stack.enter_context(
            gateway(smg, reps, policy, *shlex.split(args.smg_args)))
        before = [vllm_counters(r.url) for r in reps]
        out = Path(tmp) / "bench.json"
        run = subprocess.run([sys.executable, "-m", "tui.cli", "bench", "--backend", "openai", "--base-url",
                              url + "/v1", "--concurrency", str(args.concurrency), "--num-requests",
                              str(args.num_requests), "--input-len", str(args.input_len), "--output-len",
                              str(args.output_len), "--prefix-len", str(args.prefix_len), "--num-prefixes",
                              str(args.num_prefixes), "--warmup", "0", "--seed", str(args.seed), "--json", str(out),
                              "--tokenizer", checkpoints[0]],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if run.returncode not in (0, 1) or not out.exists():  # 1: some requests failed, which the table shows
            sys.exit(f"minichat bench against {setup} exited {run.returncode}:\n{run.stderr}")
        moved = [{k: a[k] - b[k] for k in COUNTERS} for a, b in zip((vllm_counters(r.url) for r in reps), before,
                                                                    strict=True)]
        engine = json.loads(out.read_text())["engine"]
    return {"setup": setup, "completed": engine["completed"], "failed": engine["failed"] + engine["aborted"],
            "output_throughput": engine["output_throughput"], "ttft_p50_ms": engine["ttft_ms"]["median"],
            "ttft_p95_ms": engine["ttft_ms"]["p95"], "bench_cached_tokens": engine["cached_prompt_tokens"],
            "cache_hits": sum(m[COUNTERS[0]] for m in moved), "cache_queries": sum(m[COUNTERS[1]] for m in moved),
            "requests_per_replica": [m[COUNTERS[2]] for m in moved]}


def cell(values: list[float], fmt: str) -> str:
    """The median, and the range when there are several."""
    text = format(statistics.median(values), fmt)
    return text if len(values) == 1 else f"{text} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def table(rows: list[dict]) -> str:
    lines = ["| setup | completed / failed | out tok/s | TTFT p50 ms | TTFT p95 ms | prompt tokens from cache "
             "| spread |", "|---|---|---|---|---|---|---|"]
    for setup in SETUPS:
        runs = [r for r in rows if r["setup"] == setup]
        share = [100 * r["cache_hits"] / r["cache_queries"] if r["cache_queries"] else 0.0 for r in runs]
        spread = " / ".join(f"{statistics.median(n):.0f}" for n in zip(*(r["requests_per_replica"] for r in runs),
                                                                        strict=True))
        lines.append(f"| {setup} | {sum(r['completed'] for r in runs)} / {sum(r['failed'] for r in runs)} | "
                     f"{cell([r['output_throughput'] for r in runs], ',.0f')} | "
                     f"{cell([r['ttft_p50_ms'] for r in runs], ',.0f')} | "
                     f"{cell([r['ttft_p95_ms'] for r in runs], ',.0f')} | "
                     f"{cell([r['cache_hits'] for r in runs], ',.0f')} ({cell(share, '.0f')}%) | {spread} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prefix-len", type=int, default=512, help="tokens of each shared prefix")
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=64, help="each prompt's own tokens, after its prefix")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1, help="runs of every setup (the table gives medians)")
    parser.add_argument("--serve-args", default="", help="extra `minichat serve --http` arguments, e.g. --model")
    parser.add_argument("--smg-args", default="", help="extra `smg launch` arguments")
    parser.add_argument("--json", type=Path, help="also write every run's figures here")
    args = parser.parse_args()
    smg = shutil.which("smg", path=str(Path(sys.executable).parent)) or shutil.which("smg")
    if smg is None:
        sys.exit("smg is not installed (pip install '.[dev]' installs it)")
    rows = []
    for r in range(args.rounds):
        for setup in (list(SETUPS) if r % 2 == 0 else list(reversed(SETUPS))):
            rows.append(run_setup(setup, args, smg))
            row = rows[-1]
            print(f"round {r + 1} {setup:28s} {row['output_throughput']:8.1f} out tok/s, TTFT p50 "
                  f"{row['ttft_p50_ms']:.0f} ms, {row['cache_hits']:.0f} of {row['cache_queries']:.0f} prompt "
                  f"tokens from cache (bench saw {row['bench_cached_tokens']})", flush=True)
    print(f"\n{args.num_requests} requests at concurrency {args.concurrency}: {args.num_prefixes} shared prefixes of "
          f"{args.prefix_len} tokens + {args.input_len} own, {args.output_len} out; {args.rounds} round(s)\n")
    print(table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "runs": rows}, indent=2))
    if any(r["failed"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
