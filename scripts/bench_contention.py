"""The serving benchmark of docs/benchmarks.md on an idle machine and beside a fixed, bounded competing
load, with the engine's thread settings of before (all cores, libgomp's spinning waits) and of now
(passive waits, a team that shrinks while others want the cores), side by side.

    python scripts/bench_contention.py                         # demo model, loads 0 and 1, 3 rounds
    python scripts/bench_contention.py --loads 0,1,2 --rounds 2 --model /tmp/qwen2.5-0.5b-random

A competing load is N processes that each spin a CPU for at most --load-seconds (they end by themselves
if this script dies). Within a round every (load, setting) pair runs once, settings alternating, so a
noisy machine hurts both alike; the table gives each cell's median output tok/s and its ratio to the
same setting's idle median, then now / before.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = ["--concurrency", "32", "--num-requests", "64", "--input-len", "64", "--output-len", "48"]
# before: every usable core, always, and libgomp's default wait (it spins ~300k times before sleeping)
SETTINGS = {
    "before": ({"GOMP_SPINCOUNT": "300000"}, ["--threads", str(len(os.sched_getaffinity(0)))]),
    "now": ({}, []),
}
SPIN = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


def run_bench(setting: str, model: list[str], extra: list[str]) -> float:
    env_extra, flags = SETTINGS[setting]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | env_extra
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        subprocess.run([sys.executable, "-m", "tui.cli", "bench", *BENCH, *extra, *model, *flags, "--json", str(out)],
                       env=env, check=True, stdout=subprocess.DEVNULL)
        return float(json.loads(out.read_text())["engine"]["output_throughput"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint directory (default: the demo model)")
    parser.add_argument("--loads", default="0,1", help="competing busy processes, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--load-seconds", type=float, default=900.0, help="the longest a busy process lives")
    parser.add_argument("--bench-args", default="", help="extra `minichat bench` arguments, space-separated")
    args = parser.parse_args()
    model = ["--model", args.model] if args.model else []
    loads = [int(n) for n in args.loads.split(",")]
    figures: dict[tuple[int, str], list[float]] = {}
    for r in range(args.rounds):
        for load in loads:
            spinners = [subprocess.Popen([sys.executable, "-c", SPIN.format(seconds=args.load_seconds)])
                        for _ in range(load)]
            try:
                for setting in (SETTINGS if r % 2 == 0 else reversed(SETTINGS)):
                    tps = run_bench(setting, model, args.bench_args.split())
                    figures.setdefault((load, setting), []).append(tps)
                    print(f"round {r + 1} load {load} {setting:6s} {tps:8.1f} output tok/s", flush=True)
            finally:
                for p in spinners:
                    p.kill()
                    p.wait()
    median = {k: statistics.median(v) for k, v in figures.items()}
    print(f"\nmedian output tok/s over {args.rounds} rounds ({'demo model' if not args.model else args.model}; "
          f"minichat bench {' '.join(BENCH)})")
    print(f"{'busy processes':>14} | {'before':>8} {'of idle':>7} | {'now':>8} {'of idle':>7} | now/before")
    for load in loads:
        cells = []
        for setting in SETTINGS:
            idle = median.get((0, setting))
            share = f"{median[load, setting] / idle:7.0%}" if idle else f"{'':7}"
            cells.append(f"{median[load, setting]:8.0f} {share}")
        print(f"{load:>14} | {cells[0]} | {cells[1]} | {median[load, 'now'] / median[load, 'before']:9.2f}x")


if __name__ == "__main__":
    main()
