"""What one stats snapshot costs the engine loop: `StatsRecorder.snapshot()` plus its encoding, in ms
and bytes, on KV pools of 2k to 600k pages half held by 256 requests (issue 25 item 15).

    .venv/bin/python scripts/bench_stats_snapshot.py                 # 2,048 / 65,536 / 262,144 / 600,000 pages
    .venv/bin/python scripts/bench_stats_snapshot.py --pages 600000 --repeat 50

The pool is built through the engine's own scheduler, cache and allocator (a `Scheduler` without a model:
schedule() and process() need none, the tokens come from here): a finished warm-up leaves an eighth of
the pool in the prefix cache, 256 requests share one cached page (locked while they run) and hold half
the pool between them, each one's prompt in one piece. Then they decode, one page each at a time and
interleaved: "steady" times snapshots taken between decode steps as the publisher takes them while
anyone subscribes (a step moves a page or two per request); "fragmented" does the same after each
request has decoded `--decode-pages` more pages, so held pages no longer lie in one run per request;
"full" times a snapshot that must list every page (what a new subscriber gets) on the fragmented pool,
where the recorder makes that distinction ("runs": how many it lists). Medians of `--repeat` snapshots
each. It runs on the code before issue 25's item 15 too (every snapshot was a full one then).
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time
from types import SimpleNamespace

import torch

from engine.batch import ForwardOutput
from engine.config import SchedulerConfig
from engine.kv import RequestTable, make_cache_manager
from engine.params import SamplingParams
from engine.request import Req
from engine.scheduler.admission import FLOOR
from engine.scheduler.scheduler import Scheduler
from engine.scheduler.views import SchedulerView
from engine.service import protocol
from engine.service import stats as stats_module
from engine.service.stats import StatsRecorder

PAGE_SIZE = 16
REQUESTS = 256
TOKEN = 7  # what every sampled token is (no request stops on it)


class Pool:
    """A real scheduler over a pool of `num_pages` pages, filled as the module docstring says."""

    def __init__(self, num_pages: int, decode_pages: int, timed_steps: int) -> None:
        held = max(4, num_pages // 2 // REQUESTS)  # pages each request holds once it has decoded
        self.decode_pages = min(decode_pages, held // 4)
        output = self.decode_pages * PAGE_SIZE + timed_steps + PAGE_SIZE  # more than it will generate
        self.cache = make_cache_manager("radix", num_pages, PAGE_SIZE)
        self.table = RequestTable(REQUESTS, (held + 1) * PAGE_SIZE + output, torch.device("cpu"))
        self.scheduler = Scheduler(None, self.cache, self.table, eos_ids=set(),
                                   config=SchedulerConfig(max_prefill_tokens=1 << 20))
        self.uid = 0
        warm = max(1, num_pages // 8 // held)  # finished prompts that leave an eighth of the pool cached
        self.run([[1000 + i] + [1] * (held * PAGE_SIZE - 1) for i in range(warm)], max_tokens=1)
        shared = [2] * PAGE_SIZE
        self.run([shared], max_tokens=1)  # the page all 256 share (locked while they run)
        self.scheduler.admission.ratio = FLOOR  # admit all 256 at once (the warm-up taught it to expect more)
        prompt = max(1, held - self.decode_pages - timed_steps // PAGE_SIZE - 1) * PAGE_SIZE
        self.add([shared + [3000 + i] * (prompt - 1) for i in range(REQUESTS)], max_tokens=output)
        while len(self.scheduler.decode_manager.running) < REQUESTS:  # prefill
            self.step()

    def decode(self) -> None:
        """Each request decodes its `decode_pages`, one page each at a time, interleaved with the others'."""
        for _ in range(self.decode_pages * PAGE_SIZE):
            self.step()

    def add(self, prompts: list[list[int]], max_tokens: int) -> list[str]:
        rids = []
        for prompt in prompts:
            self.uid += 1
            rid = f"{self.uid:032x}"  # as long as a client's uuid4().hex
            self.scheduler.add_request(Req(rid=rid, uid=self.uid, input_ids=prompt, max_output=max_tokens,
                                           params=SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
            rids.append(rid)
        return rids

    def run(self, prompts: list[list[int]], max_tokens: int) -> None:
        self.add(prompts, max_tokens)
        while self.scheduler.has_unfinished():
            self.step()

    def step(self) -> None:
        batch = self.scheduler.schedule()
        assert batch is not None
        self.scheduler.process(batch, ForwardOutput(next_tokens=torch.full((len(batch.sample_rows),), TOKEN)))


def timed(recorder: StatsRecorder, pool: Pool | None, repeat: int, **kwargs: bool) -> tuple[float, int, int, int]:
    """Median ms and bytes (the whole Stats, its pages part) of snapshot + encode, a decode step before each
    when `pool` is given; and the most page runs one listed."""
    times, sizes, page_sizes, runs = [], [], [], 0
    for _ in range(repeat):
        if pool is not None:
            pool.step()
        start = time.perf_counter()
        stats = recorder.snapshot(**kwargs)
        data = protocol.encode(stats)
        times.append(time.perf_counter() - start)
        sizes.append(len(data))
        page_sizes.append(len(protocol.encode(stats.pages)))
        runs = max(runs, len(getattr(stats.pages, "runs", ())))
    return statistics.median(times) * 1e3, int(statistics.median(sizes)), int(statistics.median(page_sizes)), runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, nargs="+", default=[2048, 65536, 262144, 600000])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--decode-pages", type=int, default=8, help="pages each request decodes before "
                        "'fragmented' (at most a quarter of its pages)")
    args = parser.parse_args()
    has_full = "full" in inspect.signature(StatsRecorder.snapshot).parameters
    if has_full:
        stats_module.FULL_SPACING = 0.0  # each snapshot asked for a complete list gets one
    print("ms and bytes per snapshot + encoding (median), the whole Stats and (in brackets) its pages")
    print(f"{'pages':>8} {'held':>7} {'cached':>7} {'locked':>6} |{'steady':^28}|{'fragmented':^28}|"
          f"{'full (fragmented)':^28}| runs listed")
    for num_pages in args.pages:
        pool = Pool(num_pages, args.decode_pages, 2 * args.repeat)
        view = SchedulerView(pool.scheduler)
        llm = SimpleNamespace(stats=view.snapshot, watch_pages=view.watch_pages,
                              checkpoint=SimpleNamespace(name="synthetic"))
        recorder = StatsRecorder(llm)  # type: ignore[arg-type]  # all it asks of an LLM is these
        recorder.snapshot()  # the first one lists every page
        steady = timed(recorder, pool, args.repeat)
        pool.decode()
        fragmented = timed(recorder, pool, args.repeat)
        full = timed(recorder, None, args.repeat, full=True) if has_full else fragmented
        p = recorder.snapshot().pages
        row = "".join(f"| {ms:8.2f} {size:>9} ({pages:>8}) " for ms, size, pages, _ in (steady, fragmented, full))
        runs = f"{steady[3]} / {fragmented[3]} / {full[3]}" if has_full else "(a character per page)"
        print(f"{num_pages:>8} {p.held:>7} {p.cached:>7} {p.locked:>6} {row}| {runs}")


if __name__ == "__main__":
    main()
