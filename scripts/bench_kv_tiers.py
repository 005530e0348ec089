"""KV tiers, measured: the first token of one new turn in a long conversation, cold, warm in the pool and after an
engine restart from the disk tier; what the disk tier costs per page written and read; and what writing every page
through costs a workload that never reuses anything.

    python scripts/bench_kv_tiers.py                      # the Qwen2.5-0.5B shape (bf16), a 4,000-token conversation
    python scripts/bench_kv_tiers.py --model PATH --conversation 300 --turn 20 --requests 4 --prompt-len 64 \\
        --output-len 8 --rounds 1                          # a quick check on any checkpoint

In process, token ids only (the weights are random: what is measured is shapes and bytes). Each round:
- `cold`: an engine without tiers (`kv_disk_gib=0`) gets the conversation plus a new turn; TTFT is the engine's own
  (RequestOutput.timings.ttft: arrival to first token), here the whole prompt's prefill;
- `pool`: an engine with the disk tier (a fresh directory) has the conversation (its first turns, then the whole
  history: every page written through), then a new turn arrives: TTFT with the history in the pool;
- `disk`: that engine is closed (its writes finished) and a new one opened on the directory (with
  `--drop-page-cache`, the page files are first dropped from the OS page cache with posix_fadvise, so they come
  from the device): TTFT of the same turn, the history loaded from disk while the request waits;
- the disk tier's own timings give the cost per page: the copy out of the pool on the scheduler's thread (timed
  here, `KVPool.read_pages`), the file write with its checksum on the writer thread, the read and check on the
  reader thread (TierUse.write_seconds / stored, read_seconds / loaded);
- `no reuse`: `--requests` distinct prompts of `--prompt-len` tokens, `--output-len` tokens each, `--slots` at a
  time (so that requests finish, and their pages are written through, while others compute), with the disk tier
  off and on, output tokens per second; the two run in turn each round so that the shared machine weighs on both
  alike.
Medians over `--rounds`. Measure on a quiet machine: `cold` and `no reuse` are compute, which a neighbour slows.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from kernels.cpu.build import cache_dir  # noqa: E402


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def shaped_checkpoint(dtype: str) -> Path:
    """The Qwen2.5-0.5B-shaped random checkpoint (scripts/make_random_checkpoint.py), made once into the cache."""
    out = cache_dir() / "bench-kv-tiers" / f"qwen2.5-0.5b-random-{dtype}"
    if not (out / "config.json").is_file():
        log(f"writing {out}")
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_random_checkpoint.py"), str(out), "--shape",
                        "qwen2.5-0.5b", "--dtype", dtype], check=True)
    return out


def tokens(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(100, vocab - 100, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def ttft(llm: LLM, prompt: list[int]) -> float:
    out = llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))[0]
    assert out.timings.ttft is not None
    return out.timings.ttft


def drop_page_cache(root: Path) -> None:
    """Each page file out of the OS page cache: written back first (the kernel drops only clean pages)."""
    for path in root.rglob("*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def copy_out_seconds(llm: LLM, pages: int = 64, repeats: int = 5) -> float:
    """Seconds per page the scheduler's thread spends copying pages out of the pool into the staging ring (what
    write-through adds to it)."""
    chosen = list(range(min(pages, llm.num_pages)))
    out = torch.empty((len(chosen), *llm.kv.page_shape), dtype=llm.kv.buffer.dtype)
    best = float("inf")
    for _ in range(repeats + 1):  # the first touches `out`'s memory, as the ring's first use does
        start = time.perf_counter()
        llm.kv.read_pages(chosen, out=out)
        best = min(best, (time.perf_counter() - start) / len(chosen))
    return best


def conversation_round(model: str, options: dict, history: list[int], turns: tuple[list[int], list[int]],
                       work: Path, drop: bool) -> dict[str, float]:
    """TTFT cold, from the pool and from disk after a restart; the disk tier's per-page timings. The pool's turn
    and the other two are different tokens, so that the restarted engine finds on disk the history alone, as the
    pool had it (not the pool's turn too)."""
    prompt = history + turns[1]
    with LLM(model, kv_disk_gib=0, **options) as cold_engine:
        cold = ttft(cold_engine, prompt)
    where = Path(tempfile.mkdtemp(prefix="kv-", dir=work))
    with LLM(model, kv_cache_dir=str(where), **options) as llm:
        ttft(llm, history[: len(history) // 2])  # the conversation so far, turn by turn
        ttft(llm, history)
        pool = ttft(llm, history + turns[0])
        copy = copy_out_seconds(llm)
        assert llm.flush_kv()
        (written,) = llm.stats().pages.tiers
    if drop:
        drop_page_cache(where)
    with LLM(model, kv_cache_dir=str(where), **options) as restarted:
        start = time.perf_counter()
        out = restarted.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))[0]
        wall = time.perf_counter() - start
        assert out.usage.cached_tokens == len(history) // 16 * 16, out.usage
        (read,) = restarted.stats().pages.tiers
    shutil.rmtree(where, ignore_errors=True)
    return {"cold": cold, "pool": pool, "disk": out.timings.ttft or wall, "copy_out": copy,
            "write": written.write_seconds / max(written.stored, 1), "read": read.read_seconds / max(read.loaded, 1),
            "pages": float(read.loaded), "page_bytes": float(written.bytes / max(written.pages, 1))}


def throughput(model: str, options: dict, tiers: bool, requests: int, slots: int, prompt_len: int, output_len: int,
               seed: int, work: Path, vocab: int) -> float:
    """Output tokens per second of `requests` distinct prompts, `slots` at a time, with the disk tier on or off."""
    where = Path(tempfile.mkdtemp(prefix="kv-", dir=work))
    extra = {"kv_cache_dir": str(where)} if tiers else {"kv_disk_gib": 0}
    prompts = [tokens(prompt_len, seed * 1000 + i, vocab) for i in range(requests)]
    with LLM(model, max_running_requests=slots, **extra, **options) as llm:
        llm.generate([tokens(prompt_len, 7, vocab)], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=output_len, ignore_eos=True))
        seconds = time.perf_counter() - start
    shutil.rmtree(where, ignore_errors=True)
    return sum(len(o.token_ids) for o in outs) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a checkpoint (default: the Qwen2.5-0.5B shape, made once)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--conversation", type=int, default=4000, help="tokens of history before the new turn")
    parser.add_argument("--turn", type=int, default=40, help="tokens of the new turn")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--drop-page-cache", action="store_true", help="read the page files from the device")
    parser.add_argument("--work", type=Path, default=cache_dir() / "bench-kv-tiers")
    args = parser.parse_args()
    model = args.model or str(shaped_checkpoint(args.dtype))
    args.work.mkdir(parents=True, exist_ok=True)
    options = {"dtype": args.dtype}
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    history, turns = tokens(args.conversation, 1, vocab), (tokens(args.turn, 2, vocab), tokens(args.turn, 3, vocab))
    rows: list[dict[str, float]] = []
    rates: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.rounds):
        rows.append(conversation_round(model, options, history, turns, args.work, args.drop_page_cache))
        log(f"round {r + 1}: " + ", ".join(f"{k} {v:.4g}" for k, v in rows[-1].items()))
        for tiers in (False, True) if r % 2 == 0 else (True, False):
            rates[tiers].append(throughput(model, options, tiers, args.requests, args.slots, args.prompt_len,
                                           args.output_len, r, args.work, vocab))
            log(f"round {r + 1}: no reuse, disk tier {'on' if tiers else 'off'}: {rates[tiers][-1]:.1f} out tok/s")

    def median(key: str) -> float:
        return statistics.median(row[key] for row in rows)

    cold = median("cold")
    print(f"model {model} ({args.dtype}); a new turn of {args.turn} tokens after {args.conversation} of history; "
          f"medians of {args.rounds} rounds")
    print("| TTFT of the new turn | seconds | of cold |\n|---|---|---|")
    for key, name in (("cold", "cold (no tiers: the whole prompt computed)"), ("pool", "warm in the pool"),
                      ("disk", "after a restart, from the disk tier" + (" (page cache dropped)"
                                                                        if args.drop_page_cache else ""))):
        print(f"| {name} | {median(key):.3f} | {median(key) / cold:.1%} |")
    page = median("page_bytes")
    print(f"\nper page ({page / 2**10:.0f} KiB file, {median('pages'):.0f} pages read back): copy out of the pool "
          f"{median('copy_out') * 1e3:.3f} ms (scheduler thread), file write with checksum {median('write') * 1e3:.3f} "
          f"ms (writer thread), read and check {median('read') * 1e3:.3f} ms (reader thread)")
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"no reuse ({args.requests} x {args.prompt_len} prompt, {args.output_len} out, {args.slots} at a time): "
          f"disk tier off {off:.1f}, on {on:.1f} out tok/s ({on / off - 1:+.1%})")


if __name__ == "__main__":
    main()
