"""A catalogue server's two costs of loading on demand: the first token of a model that is not loaded (cold) against
one that is (warm), and how long a running stream of another model stalls while one loads.

    python scripts/bench_model_load.py                 # SmolLM2 Q4_1 and Gemma 3 270M (tests/real_model.py), demo
    python scripts/bench_model_load.py --rounds 5 --busy

One `minichat serve --http --model NAME=PATH ...` (disk KV tier off, so every run starts cold), driven with httpx:
- cold / warm TTFT: per model, a streamed completion of 8 tokens right after unloading it, then again;
- stream gap: a SmolLM2 stream of 2,000 tokens runs while Gemma 3 is loaded by `POST /v1/models/gemma3/load`; the
  longest gap between two of the stream's chunks while the load runs, against the longest in the same stretch
  before it (no load).
--busy runs it all beside one busy process (a `while True: pass` loop, as scripts/bench_contention.py does).
Medians over --rounds; JSON lines and a table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.config import DEMO_MODEL_DIR  # noqa: E402
from scripts.bench_llamacpp import cpu  # noqa: E402
from tests.real_model import gemma3_gguf, smollm2_gguf  # noqa: E402
from tui.bench.fleet import free_port, minichat, stop, wait_up  # noqa: E402


def first_token(root: str, model: str) -> float:
    """Seconds from sending a streamed completion to its first chunk with text."""
    began = time.perf_counter()
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "stream": True, "temperature": 0}
    with httpx.stream("POST", root + "/v1/completions", json=body, timeout=300) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - began
    raise RuntimeError(f"{model}: no chunk came")


def stream_gaps(root: str, streamed: str, loaded: str) -> tuple[float, float, float]:
    """(longest gap before the load, longest gap during it, the load's seconds)."""
    arrivals: list[float] = []
    window: dict[str, float] = {}

    def load() -> None:
        time.sleep(1.0)  # the stream runs a while first (a benchmark's schedule, not synchronisation)
        window["start"] = time.perf_counter()
        httpx.post(f"{root}/v1/models/{loaded}/load", timeout=300).raise_for_status()
        window["end"] = time.perf_counter()

    body = {"model": streamed, "prompt": "Once upon a time", "max_tokens": 2000, "stream": True, "temperature": 0,
            "ignore_eos": True}
    loader = threading.Thread(target=load)
    with httpx.stream("POST", root + "/v1/completions", json=body, timeout=300) as reply:
        loader.start()
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.perf_counter())
                if "end" in window and arrivals[-1] > window["end"] + 0.5:
                    break
    loader.join()
    start, end = window["start"], window["end"]
    span = end - start

    def worst(lo: float, hi: float) -> float:
        times = [t for t in arrivals if lo <= t <= hi]
        return max((b - a for a, b in itertools.pairwise(times)), default=float("nan"))

    return worst(start - min(span, start - arrivals[0]), start), worst(start, end + 0.05), span


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--busy", action="store_true", help="beside one busy process")
    args = parser.parse_args()
    models = {"smollm2": smollm2_gguf(), "gemma3": gemma3_gguf(), "demo": DEMO_MODEL_DIR}
    port = free_port()
    named = [a for name, path in models.items() for a in ("--model", f"{name}={path}")]
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "bench_model_load.log"
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    with open(log, "w") as out:
        server = subprocess.Popen(minichat("serve", "--http", f"127.0.0.1:{port}", *named, "--kv-disk-gib", "0",
                                           "--keep-alive", "-1"), stdout=out, stderr=subprocess.STDOUT)
    root = f"http://127.0.0.1:{port}"
    rows: dict[str, list[float]] = {}
    try:
        wait_up(server, lambda: httpx.get(root + "/health", timeout=2).status_code == 200, root, log.read_text)
        for _ in range(args.rounds):
            for name in models:
                httpx.post(f"{root}/v1/models/{name}/unload", timeout=60)
                rows.setdefault(f"{name} cold TTFT s", []).append(first_token(root, name))
                rows.setdefault(f"{name} warm TTFT s", []).append(first_token(root, name))
            httpx.post(f"{root}/v1/models/gemma3/unload", timeout=60)
            before, during, span = stream_gaps(root, "smollm2", "gemma3")
            rows.setdefault("smollm2 worst gap, no load, s", []).append(before)
            rows.setdefault("smollm2 worst gap while gemma3 loads, s", []).append(during)
            rows.setdefault("gemma3 load s", []).append(span)
            print(json.dumps({k: round(v[-1], 4) for k, v in rows.items()}), flush=True)
    finally:
        stop(server)
        if busy is not None:
            busy.kill()
    print(f"\n{cpu()['model']}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
          f"{', beside one busy process' if args.busy else ''}; medians of {args.rounds}")
    for name, values in rows.items():
        print(f"| {name} | {statistics.median(values):.3f} |")


if __name__ == "__main__":
    main()
