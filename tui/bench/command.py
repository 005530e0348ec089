"""`minichat bench`: build the workload, run it against the engine or any OpenAI-compatible server (and
optionally transformers), report."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import tempfile
from collections.abc import Coroutine
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypedDict

import httpx
from rich.console import Console
from rich.table import Table

from engine.service.addresses import default_address
from engine.service.client import EngineClient, EngineRefused, probe
from engine.service.launcher import EngineHandle, find, start
from tui.bench.endpoints import ENDPOINTS
from tui.bench.engine_run import run_engine_bench
from tui.bench.metrics import RequestRecord, Summary, summarize
from tui.bench.openai_run import error_message, run_openai_bench
from tui.bench.workload import BenchRequest, Spell, make_workload

console = Console(stderr=True)
"""Notes, warnings and progress: stderr, so that `minichat bench > out` keeps only the results."""
results = Console()
"""The result tables and ratios: stdout."""


class BenchError(RuntimeError):
    """A benchmark that cannot run (no engine, bad options); the CLI prints it without a traceback."""


MIN_WORDS = 16  # fewer whole words than this and prompts are drawn from every ordinary token


def prompt_vocab(model_path: str) -> tuple[list[int], Spell | None]:
    """Token ids a prompt may use, and how to spell such a prompt as text (None: it goes as ids).

    Whole words with their leading space (`Ġthe`, `▁the`) that read back as themselves, where the tokenizer
    has enough: pre-tokenizers split before each space, so a run of them reads back as exactly those ids
    and the prompt can go as text, which is what `vllm bench serve` sends and all that a gateway like smg
    takes (it refuses token ids); each prompt is checked, and one that would not read back goes as ids.
    Otherwise the vocabulary minus special tokens (or every id, without a
    tokenizer). Both backends draw from the same ids, so one seed gives both the same workload."""
    from engine.model.loader import resolve_checkpoint  # a GGUF file's tokenizer is converted from its metadata
    from engine.tokenizer import load_tokenizer

    meta = resolve_checkpoint(model_path).meta
    tok = load_tokenizer(meta)
    if tok is None:
        config = json.loads((meta / "config.json").read_text())
        return list(range(config["vocab_size"])), None
    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    ordinary = [i for i in range(len(tok)) if i not in special]

    def say(ids: list[int]) -> str | None:
        """The ids as text, if it reads back as exactly them (the server may add its BOS, as to any text)."""
        text = tok.decode(ids)
        return text if isinstance(text, str) and tok.encode(text, add_special_tokens=False) == ids else None

    words = [i for i in ordinary if str(tok.convert_ids_to_tokens(i))[:1] in ("Ġ", "▁")
             and (word := say([i])) is not None and word.strip().isalpha()]
    return (ordinary, None) if len(words) < MIN_WORDS else (words, say)


class Machine(TypedDict):
    """How busy the machine was as the benchmark began: what its numbers can be compared with."""

    load_average_1m: float
    cpus: int  # those this process may run on
    busy: bool  # the load average exceeds them


def machine_load() -> Machine:
    """The 1-minute load average, read before the benchmark starts anything (its own engine and client would
    count in a later reading), against the CPUs this process may use."""
    load, cpus = os.getloadavg()[0], len(os.sched_getaffinity(0))
    return Machine(load_average_1m=round(load, 2), cpus=cpus, busy=load > cpus)


def load_warning(machine: Machine) -> str | None:
    """What a busy machine does to the numbers, said before them; None on a machine that is not busy."""
    if not machine["busy"]:
        return None
    return (f"this machine is busy: its load average ({machine['load_average_1m']:.1f}) exceeds its "
            f"{machine['cpus']} CPUs, so other processes take CPU time from the engine, and from the baseline at "
            f"other moments and by other amounts. The numbers understate what it does on an idle machine, and a "
            f"ratio between runs (or against --baseline) measures the load as much as the engines: compare runs "
            f"made on an idle machine.")


def announce_load(machine: Machine) -> str:
    """Print the warning of a busy machine before any number; returns the note each ratio then carries, on a line
    of its own (none on a machine that is not busy)."""
    if (warning := load_warning(machine)) is None:
        return ""
    console.print(f"[bold yellow]warning:[/bold yellow] {warning}")
    return "\n[yellow](measured on a busy machine: see the warning above)[/yellow]"


@dataclass
class Connection:
    """The engine a run measures, and the state of its cache as the run begins."""

    handle: EngineHandle
    cache: str  # said beside the results: cold (an empty tier of the run's own), or warm and why
    own_tier: Path | None = None  # the temporary disk tier this run's engine had, removed after it

    def close(self) -> None:
        """Stop the engine if this run started it (an attached one is left alone), and remove its own tier."""
        self.handle.stop()
        if self.own_tier is not None:
            shutil.rmtree(self.own_tier, ignore_errors=True)


def connect(address: str | None, engine_options: dict[str, Any], warm_cache: bool) -> Connection:
    """Attach to the engine at `address`; start one only when given engine options (or no address). An engine
    started here gets an empty disk tier of its own unless `warm_cache` (the prompts are the same every run with
    the same seed: the user's tier would serve a second run from the first one's pages)."""
    if address is not None and not engine_options:
        try:
            pong = probe(address, timeout=2.0)
        except EngineRefused as e:
            raise BenchError(str(e)) from e
        if pong is None:
            raise BenchError(f"no engine answers at {address}; start one with `minichat serve --address {address}` "
                             f"or pass --model to let bench start it")
        return Connection(EngineHandle(address, pong.pid), ATTACHED)
    address = address or default_address()
    running = find(address)
    if running is not None:
        return Connection(running, ATTACHED)
    if warm_cache or "kv_cache_dir" in engine_options or engine_options.get("kv_disk_gib") == 0:
        cache = "warm on purpose (--warm-cache): the disk tier holds what earlier runs left" if warm_cache else \
            "as the engine options set the disk tier"
        return Connection(start(address, **engine_options), cache)
    own = Path(tempfile.mkdtemp(prefix="minichat-bench-kv-"))
    try:
        handle = start(address, **engine_options, kv_cache_dir=str(own))
    except BaseException:
        shutil.rmtree(own, ignore_errors=True)
        raise
    return Connection(handle, f"cold: an empty disk tier of this run's own ({own}, removed after)", own)


ATTACHED = ("warm: attached to a running engine, whose prefix cache and tiers hold what earlier requests left "
            "(stop it, or start one elsewhere, to measure from cold)")


def render(title: str, s: Summary) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("completed / aborted / failed", f"{s.completed} / {s.aborted} / {s.failed}"),
        ("duration (s)", f"{s.duration:.2f}"),
        ("request throughput (req/s)", f"{s.request_throughput:.2f}"),
        ("input throughput (tok/s)", f"{s.input_throughput:.1f}"),
        ("output throughput (tok/s)", f"{s.output_throughput:.1f}"),
        ("total throughput (tok/s)", f"{s.total_throughput:.1f}"),
        ("peak concurrency", str(s.peak_concurrency)),
    ]
    if s.mean_running is not None:
        rows.append(("mean running set (requests)", f"{s.mean_running:.1f}"))
    if s.cached_prompt_tokens is not None:
        share = s.cached_prompt_tokens / s.input_tokens if s.input_tokens else 0.0
        rows.append(("prompt tokens from the prefix cache", f"{s.cached_prompt_tokens} of {s.input_tokens} "
                                                             f"({share:.0%})"))
    if s.draft_tokens:
        share = (s.accepted_tokens or 0) / s.draft_tokens
        rows.append(("speculative drafts accepted", f"{s.accepted_tokens} of {s.draft_tokens} ({share:.0%})"))
    for name, dist in (("TTFT", s.ttft_ms), ("TPOT", s.tpot_ms), ("ITL", s.itl_ms), ("E2E", s.e2e_ms)):
        if not math.isnan(dist["mean"]):
            rows.append((f"{name} mean / median / p90 / p99 (ms)",
                         " / ".join(f"{dist[k]:.1f}" for k in ("mean", "median", "p90", "p99"))))
    for row in rows:
        table.add_row(*row)
    if s.aborted:
        table.caption = (f"{s.aborted} request{'s were' if s.aborted > 1 else ' was'} aborted by someone else (an "
                         f"operator, a shutdown): the figures leave {'them' if s.aborted > 1 else 'it'} out")
    return table


class Shape(TypedDict):
    """How the workload is sent and sampled, the same for every backend."""

    concurrency: int
    request_rate: float
    seed: int
    ignore_eos: bool
    temperature: float
    timeout: float
    json_schema: str | None  # every output constrained to this JSON schema (structured output)


Measured = tuple[list[RequestRecord], float, int]  # per-request records, duration, peak concurrency


@dataclass
class Target:
    """What the workload runs against, as far as the report needs to know."""

    title: str
    tokenizer: str  # checkpoint path or hub id whose vocabulary the prompts are drawn from
    max_seq_len: int | None
    config: dict


def openai_target(base_url: str, model: str | None, tokenizer: str | None, api_key: str | None) -> tuple[Target, str]:
    """Ask the server's `/v1/models` for the model (the first one if --model is not given), its checkpoint
    (`root`, as minichat and vLLM report it) and context; returns the target and the model id to send."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(base_url.rstrip("/") + "/models", headers=headers, timeout=10.0)
    except httpx.HTTPError as e:
        raise BenchError(f"no OpenAI-compatible server answers at {base_url} ({e})") from e
    if response.status_code != 200:
        raise BenchError(f"{base_url}/models: {error_message(response)}")
    cards = response.json().get("data") or []
    card = next((c for c in cards if model in (None, c.get("id"))), None)
    if card is None:
        raise BenchError(f"{base_url} serves {[c.get('id') for c in cards]}, not {model!r}")
    tokenizer = tokenizer or card.get("root") or card["id"]
    config = {"backend": "openai", "base_url": base_url, "served_model": card["id"]}
    return Target(f"{base_url} ({card['id']})", tokenizer, card.get("max_model_len"), config), card["id"]


def engine_target(connection: Connection) -> tuple[Target, Any]:
    """What the engine says it runs (its EngineInfo too, for --baseline hf), with its cache's state said first."""
    console.print(f"cache: {connection.cache}")
    with EngineClient(connection.handle.address, timeout=10.0) as client:
        info = client.info()
    return Target(f"minichat engine ({Path(info.model).name})", info.model, info.max_seq_len,
                  {"backend": "minichat", "engine_config": info.config, "engine_execution": info.execution,
                   "cache": connection.cache}), info


def run_bench(*, concurrency: int, num_requests: int, input_len: int, output_len: int, range_ratio: float,
              request_rate: float, seed: int, warmup: int, ignore_eos: bool, temperature: float, address: str | None,
              timeout: float, baseline: str | None, json_path: Path | None, engine_options: dict[str, Any],
              backend: str = "minichat", base_url: str | None = None, tokenizer: str | None = None,
              api_key: str | None = None, json_schema: Path | None = None, prefix_len: int = 0,
              num_prefixes: int = 1, endpoint: str = "completions", warm_cache: bool = False) -> dict:
    schema = _checked_options(concurrency, baseline, json_schema, backend, endpoint)
    machine = machine_load()
    busy = announce_load(machine)
    shape = Shape(concurrency=concurrency, request_rate=request_rate, seed=seed, ignore_eos=ignore_eos,
                  temperature=temperature, timeout=timeout, json_schema=schema)
    connection: Connection | None = None
    try:
        if backend == "openai":
            model = engine_options.pop("model", None)
            if base_url is None or engine_options or address is not None or baseline == "hf":
                raise BenchError("--backend openai takes --base-url (and --model, --tokenizer, --api-key), not "
                                 "--address, engine options or --baseline")
            target, served = openai_target(base_url, model, tokenizer, api_key)
            target.config["endpoint"] = endpoint

            def launch(workload: list[BenchRequest], warm: int, shape: Shape) -> Coroutine[Any, Any, Measured]:
                return run_openai_bench(base_url, served, api_key, workload, warmup=warm, endpoint=endpoint, **shape)
        else:
            connection = connect(address, engine_options, warm_cache)
            target, info = engine_target(connection)
            engine_address = connection.handle.address

            def launch(workload: list[BenchRequest], warm: int, shape: Shape) -> Coroutine[Any, Any, Measured]:
                return run_engine_bench(engine_address, workload, warmup=warm, **shape)

        try:
            vocab, spell = prompt_vocab(target.tokenizer)
        except OSError as e:  # the checkpoint the server names is not here (or not readable)
            raise BenchError(f"cannot read the tokenizer of {target.tokenizer!r} ({e}); name the checkpoint "
                             f"with --tokenizer") from e

        def draw(workload_seed: int) -> list[BenchRequest]:
            return make_workload(vocab, num_requests + warmup, input_len, output_len, range_ratio, workload_seed,
                                 prefix_len, num_prefixes, spell if backend == "openai" else None)

        workload = draw(seed)
        too_long = [r for r in workload
                    if target.max_seq_len is not None and len(r.prompt_ids) + r.output_len > target.max_seq_len]
        if too_long:
            raise BenchError(f"{len(too_long)} requests exceed the server's max_seq_len {target.max_seq_len}; "
                             f"lower --input-len/--output-len/--prefix-len")
        warm, measured = workload[:warmup], workload[warmup:]
        records, duration, peak = asyncio.run(launch(warm + measured, len(warm), shape))
        records = records[len(warm):] if warm else records
        summary = summarize(records, duration, peak)
        result: dict = {
            "config": {"concurrency": concurrency, "num_requests": num_requests, "input_len": input_len,
                       "output_len": output_len, "range_ratio": range_ratio, "prefix_len": prefix_len,
                       "num_prefixes": num_prefixes, "request_rate": request_rate,
                       "seed": seed, "ignore_eos": ignore_eos, "temperature": temperature, "model": target.tokenizer,
                       "json_schema": schema, **target.config},
            "engine": summary.to_dict(),
            "records": [asdict(r) | {"tpot": r.tpot} for r in records],
            "machine": machine,
        }
        results.print(render(target.title + (" · JSON schema" if schema else ""), summary))
        if baseline == "unconstrained":  # the same workload again, free: what structure costs the batch
            # drawn anew (same lengths, other tokens): the first run's prompts are in the prefix cache now
            again = draw(seed + 1)
            records, duration, peak = asyncio.run(launch(again, len(warm), shape | {"json_schema": None}))
            free = summarize(records[len(warm):], duration, peak)
            results.print(render(target.title + " · unconstrained (baseline)", free))
            ratio = summary.output_throughput / free.output_throughput if free.output_throughput else math.inf
            results.print(f"output throughput JSON schema / unconstrained: [bold]{ratio:.2f}x[/bold]{busy}")
            result |= {"baseline": free.to_dict(), "ratio_output_throughput": ratio}
        if baseline == "hf":
            result |= _baseline(info, measured, concurrency, ignore_eos, temperature, seed, result["engine"], busy)
    finally:
        if connection is not None:
            connection.close()
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2, allow_nan=True))
        console.print(f"wrote {json_path}")
    return result


def _checked_options(concurrency: int, baseline: str | None, json_schema: Path | None, backend: str,
                     endpoint: str = "completions") -> str | None:
    """Refuse options that cannot work before anything starts; the JSON schema's text, if one is given."""
    if concurrency < 1:
        raise BenchError("--concurrency must be at least 1")
    if baseline not in (None, "hf", "unconstrained"):
        raise BenchError(f"--baseline must be 'hf' or 'unconstrained'; got {baseline!r}")
    if baseline == "unconstrained" and json_schema is None:
        raise BenchError("--baseline unconstrained compares a --json-schema run with the same workload without it")
    schema = None
    if json_schema is not None:
        try:
            schema = json.dumps(json.loads(json_schema.read_text()))
        except (OSError, ValueError) as e:
            raise BenchError(f"--json-schema {json_schema}: {e}") from e
    if backend not in ("minichat", "openai"):
        raise BenchError(f"--backend must be 'minichat' or 'openai'; got {backend!r}")
    if endpoint not in ENDPOINTS or (endpoint != "completions" and backend != "openai"):
        raise BenchError(f"--endpoint is one of {', '.join(ENDPOINTS)}, with --backend openai; got {endpoint!r}")
    return schema


def _baseline(info, workload: list[BenchRequest], concurrency: int, ignore_eos: bool, temperature: float,
              seed: int, engine_summary: dict, busy: str) -> dict:
    from tui.bench.hf_baseline import run_hf_baseline

    records, duration = run_hf_baseline(info.model, workload, concurrency, str(info.config.get("dtype", "float32")),
                                        str(info.config.get("device", "cpu")), ignore_eos, temperature, seed)
    summary = summarize(records, duration, min(concurrency, len(workload)))
    results.print(render("transformers generate, static batches (baseline)", summary))
    ratio = engine_summary["output_throughput"] / summary.output_throughput if summary.output_throughput else math.inf
    results.print(f"output throughput engine / baseline: [bold]{ratio:.2f}x[/bold]{busy}")
    return {"baseline": summary.to_dict(), "ratio_output_throughput": ratio}
