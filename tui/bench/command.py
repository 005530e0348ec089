"""`minichat bench`: build the workload, run it against the engine (and optionally transformers), report."""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from engine.service.addresses import default_address
from engine.service.client import EngineClient, probe
from engine.service.launcher import EngineHandle, find_or_start
from tui.bench.engine_run import run_engine_bench
from tui.bench.metrics import Summary, summarize
from tui.bench.workload import BenchRequest, make_workload

console = Console(stderr=True)


class BenchError(RuntimeError):
    """A benchmark that cannot run (no engine, bad options); the CLI prints it without a traceback."""


def ordinary_vocab(model_path: str) -> list[int]:
    """Token ids a prompt may use: the tokenizer's vocabulary minus special tokens (or every id)."""
    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer(Path(model_path))
    if tok is not None:
        special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
        return [i for i in range(len(tok)) if i not in special]
    config = json.loads((Path(model_path) / "config.json").read_text())
    return list(range(config["vocab_size"]))


def connect(address: str | None, engine_options: dict[str, object]) -> EngineHandle:
    """Attach to the engine at `address`; start one only when given engine options (or no address)."""
    if address is not None and not engine_options:
        pong = probe(address, timeout=2.0)
        if pong is None:
            raise BenchError(f"no engine answers at {address}; start one with `minichat serve --address {address}` "
                             f"or pass --model to let bench start it")
        return EngineHandle(address, pong.pid)
    return find_or_start(address or default_address(), **engine_options)  # type: ignore[arg-type]


def render(title: str, s: Summary) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("completed / failed", f"{s.completed} / {s.failed}"),
        ("duration (s)", f"{s.duration:.2f}"),
        ("request throughput (req/s)", f"{s.request_throughput:.2f}"),
        ("input throughput (tok/s)", f"{s.input_throughput:.1f}"),
        ("output throughput (tok/s)", f"{s.output_throughput:.1f}"),
        ("total throughput (tok/s)", f"{s.total_throughput:.1f}"),
        ("peak concurrency", str(s.peak_concurrency)),
    ]
    for name, dist in (("TTFT", s.ttft_ms), ("TPOT", s.tpot_ms), ("ITL", s.itl_ms), ("E2E", s.e2e_ms)):
        if not math.isnan(dist["mean"]):
            rows.append((f"{name} mean / median / p90 / p99 (ms)",
                         " / ".join(f"{dist[k]:.1f}" for k in ("mean", "median", "p90", "p99"))))
    for row in rows:
        table.add_row(*row)
    return table


def run_bench(*, concurrency: int, num_requests: int, input_len: int, output_len: int, range_ratio: float,
              request_rate: float, seed: int, warmup: int, ignore_eos: bool, temperature: float, address: str | None,
              timeout: float, baseline: str | None, json_path: Path | None, engine_options: dict[str, object]) -> dict:
    if concurrency < 1:
        raise BenchError("--concurrency must be at least 1")
    if baseline not in (None, "hf"):
        raise BenchError(f"--baseline must be 'hf'; got {baseline!r}")
    handle = connect(address, engine_options)
    try:
        with EngineClient(handle.address, timeout=10.0) as client:
            info = client.info()
        workload = make_workload(ordinary_vocab(info.model), num_requests + warmup, input_len, output_len,
                                 range_ratio, seed)
        too_long = [r for r in workload if len(r.prompt_ids) + r.output_len > info.max_seq_len]
        if too_long:
            raise BenchError(f"{len(too_long)} requests exceed the engine's max_seq_len {info.max_seq_len}; "
                             f"lower --input-len/--output-len")
        warm, measured = workload[:warmup], workload[warmup:]
        records, duration, peak = asyncio.run(run_engine_bench(
            handle.address, warm + measured, concurrency, request_rate, seed, ignore_eos, temperature, timeout,
            warmup=len(warm)))
        records = records[len(warm):] if warm else records
        result: dict = {
            "config": {"concurrency": concurrency, "num_requests": num_requests, "input_len": input_len,
                       "output_len": output_len, "range_ratio": range_ratio, "request_rate": request_rate,
                       "seed": seed, "ignore_eos": ignore_eos, "temperature": temperature, "model": info.model,
                       "engine_config": info.config},
            "engine": summarize(records, duration, peak).to_dict(),
            "records": [asdict(r) | {"tpot": r.tpot} for r in records],
        }
        console.print(render(f"minichat engine ({Path(info.model).name})", summarize(records, duration, peak)))
        if baseline == "hf":
            result |= _baseline(info, measured, concurrency, ignore_eos, temperature, seed, result["engine"])
    finally:
        handle.stop()
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2, allow_nan=True))
        console.print(f"wrote {json_path}")
    return result


def _baseline(info, workload: list[BenchRequest], concurrency: int, ignore_eos: bool, temperature: float,
              seed: int, engine_summary: dict) -> dict:
    from tui.bench.hf_baseline import run_hf_baseline

    records, duration = run_hf_baseline(info.model, workload, concurrency, str(info.config.get("dtype", "float32")),
                                        str(info.config.get("device", "cpu")), ignore_eos, temperature, seed)
    summary = summarize(records, duration, min(concurrency, len(workload)))
    console.print(render("transformers generate, static batches (baseline)", summary))
    ratio = engine_summary["output_throughput"] / summary.output_throughput if summary.output_throughput else math.inf
    console.print(f"output throughput engine / baseline: [bold]{ratio:.2f}x[/bold]")
    return {"baseline": summary.to_dict(), "ratio_output_throughput": ratio}
