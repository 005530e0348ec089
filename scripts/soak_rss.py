"""The engine's memory over a long mixed load: is its RSS flat after warm-up, or does something grow?

    python scripts/soak_rss.py --minutes 30                 # demo model, 8 clients, JSON + table at the end

An engine (`minichat serve`, loopback ipc) takes requests from CLIENTS threads for MINUTES: prompts of
1-400 tokens (at most half the context), outputs of 1-200, a fifth of them n=2 choices, a tenth aborted
mid-stream, a tenth JSON-schema constrained (when xgrammar is installed). Every SAMPLE seconds the engine's
RSS (its /proc status) and the requests done so far are recorded; at the end the series is written as
JSON with the growth per minute after the warm-up (the first 5 minutes, by a least-squares line), and the
engine is checked idle with every page free.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

from engine.params import SamplingParams
from engine.service.client import EngineClient, EngineError
from engine.service.launcher import start
from engine.structured import GrammarSpec

SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                     "n": {"type": "integer"}}, "required": ["name", "n"]})


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def client_loop(address: str, seed: int, stop: threading.Event, done: list[int], structured: bool) -> None:
    rng = random.Random(seed)
    with EngineClient(address, timeout=120) as client:
        longest = min(400, client.info().max_seq_len // 2)
        while not stop.is_set():
            prompt = [rng.randrange(3, 300) for _ in range(rng.randint(1, longest))]
            params = SamplingParams(max_tokens=rng.randint(1, 200), temperature=rng.choice([0.0, 0.8]),
                                    ignore_eos=rng.random() < 0.5, n=2 if rng.random() < 0.2 else 1,
                                    structured=GrammarSpec(kind="json_schema", value=SCHEMA)
                                    if structured and rng.random() < 0.1 else None)
            try:
                rid = client.submit(prompt, params)
                for i, _ in enumerate(client.stream(rid)):
                    if i == 3 and rng.random() < 0.1:
                        client.abort(rid)
            except EngineError as e:
                if e.code not in ("unknown_request", "overloaded"):
                    raise
            done[0] += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint (default: the demo model)")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--sample", type=float, default=10.0, help="seconds between RSS samples")
    parser.add_argument("--warmup", type=float, default=5.0, help="minutes left out of the growth fit")
    parser.add_argument("--json", type=Path, default=Path("soak_rss.json"))
    parser.add_argument("--kv-disk-gib", type=float, help="the engine's disk tier cap (0: off; default: the engine's)")
    args = parser.parse_args()
    address = f"ipc://{tempfile.mkdtemp(prefix='soak')}/engine.sock"
    options: dict[str, object] = {"model": args.model} if args.model else {}
    if args.kv_disk_gib is not None:
        options["kv_disk_gib"] = args.kv_disk_gib
    handle = start(address, timeout=300, **options)
    stop, done = threading.Event(), [0]
    structured = importlib.util.find_spec("xgrammar") is not None
    threads = [threading.Thread(target=client_loop, args=(address, i, stop, done, structured), daemon=True)
               for i in range(args.clients)]
    series: list[tuple[float, float, int]] = []  # (minutes, RSS MiB, requests done)
    began = time.monotonic()
    try:
        for thread in threads:
            thread.start()
        while (elapsed := time.monotonic() - began) < args.minutes * 60:
            series.append((elapsed / 60, rss_mib(handle.pid), done[0]))
            print(f"{elapsed / 60:6.1f} min  RSS {series[-1][1]:7.1f} MiB  {done[0]:6d} requests", flush=True)
            stop.wait(args.sample)
        stop.set()
        for thread in threads:
            thread.join(timeout=300)
        with EngineClient(address) as client:
            stats = client.wait_stats(lambda s: not s.running and not s.waiting, timeout=120)
            assert stats.pages.held == 0 and all(s is None for s in stats.slots), "pages or slots still held"
        series.append(((time.monotonic() - began) / 60, rss_mib(handle.pid), done[0]))
    finally:
        stop.set()
        handle.stop()
    late = [(m, r) for m, r, _ in series if m >= args.warmup]
    slope = statistics.linear_regression([m for m, _ in late], [r for _, r in late]).slope if len(late) > 2 else 0.0
    report = {"minutes": args.minutes, "clients": args.clients, "requests": done[0], "series": series,
              "warmup_minutes": args.warmup, "mib_per_minute_after_warmup": slope}
    args.json.write_text(json.dumps(report, indent=1))
    print(f"# {done[0]} requests; RSS {series[0][1]:.0f} -> {series[-1][1]:.0f} MiB; after {args.warmup:g} min: "
          f"{slope:+.2f} MiB/min; wrote {args.json}")


if __name__ == "__main__":
    main()
