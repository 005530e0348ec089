"""The `minichat` command line (typer). Thin: the work happens in engine.server / engine.launcher."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import typing
from pathlib import Path

import typer

import engine
from engine.config import EngineConfig

app = typer.Typer(add_completion=False, no_args_is_help=False, help="minichat: a small LLM serving engine and console.")

ADDRESS_HELP = "Engine address: ipc:///path or tcp://127.0.0.1:PORT (default: a per-user ipc socket)."
ENGINE_HELP = {
    "model": "HF checkpoint directory or cached hub id (default: the embedded demo model).",
    "device": "cpu, cuda or cuda:N.",
    "dtype": "float32, bfloat16 or float16.",
    "page_size": "Tokens per KV page.",
    "kv_memory_gb": "Memory for the KV pool when --num-pages is not given.",
    "max_model_len": "Cap on prompt + output tokens (default: the model's context).",
    "seed": "Seed for requests that sample without their own seed.",
    "attention_backend": "Attention kernels; auto picks the best available for the device.",
    "prefix_cache": "radix (reuse cached prompt prefixes) or naive.",
    "num_pages": "KV pool size in pages (default: what the request slots can use, within memory).",
    "max_running_requests": "Request slots: how many requests may hold KV at once.",
    "max_prefill_tokens": "Prefill token budget per step; longer prompts are chunked.",
}


def _version(value: bool) -> None:
    if value:
        typer.echo(f"minichat {engine.__version__}")
        raise typer.Exit()


def serve(address: str | None, allow_remote: bool, max_waiting_requests: int, max_message_bytes: int,
          log_level: str, **engine_options: typing.Any) -> None:
    """Run the engine in the foreground (logs to stderr) until Ctrl-C or SIGTERM."""
    from engine.server import ServerOptions, StartupError, run_server

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run_server(EngineConfig(**engine_options), ServerOptions(address, allow_remote, max_waiting_requests,
                                                                 max_message_bytes))
    except StartupError as e:
        typer.echo(f"minichat serve: error: {e}", err=True)
        raise typer.Exit(1) from e


def _engine_parameters() -> list[inspect.Parameter]:
    """One --option per EngineConfig field, so new engine knobs reach `minichat serve` by themselves."""
    hints = typing.get_type_hints(EngineConfig)
    return [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=hints[f.name],
                              default=typer.Option(f.default, "--" + f.name.replace("_", "-"),
                                                   help=ENGINE_HELP.get(f.name, f"EngineConfig.{f.name}")))
            for f in dataclasses.fields(EngineConfig)]


serve.__signature__ = inspect.Signature([  # type: ignore[attr-defined]
    inspect.Parameter("address", inspect.Parameter.KEYWORD_ONLY, annotation=str | None,
                      default=typer.Option(None, "--address", help=ADDRESS_HELP)),
    inspect.Parameter("allow_remote", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                      default=typer.Option(False, "--allow-remote",
                                           help="Allow a non-loopback tcp address (the protocol has no auth).")),
    inspect.Parameter("max_waiting_requests", inspect.Parameter.KEYWORD_ONLY, annotation=int,
                      default=typer.Option(1024, help="Refuse new requests ('overloaded') beyond this queue.")),
    inspect.Parameter("max_message_bytes", inspect.Parameter.KEYWORD_ONLY, annotation=int,
                      default=typer.Option(1 << 20, help="Largest accepted message; bigger ones drop the peer.")),
    inspect.Parameter("log_level", inspect.Parameter.KEYWORD_ONLY, annotation=str,
                      default=typer.Option("info", help="debug, info, warning or error.")),
    *_engine_parameters(),
])
app.command("serve")(serve)


def root(ctx: typer.Context, version: bool, address: str | None, **engine_options: typing.Any) -> None:
    """Chat with a local model and watch the continuous-batching scheduler serve it.

    Without a command: open the terminal UI, attached to the engine at --address, or to one it starts
    in the background with the engine options given here (and stops again on exit).
    """
    if ctx.invoked_subcommand is not None:
        return
    from engine.addresses import AddressError, default_address, split
    from tui.app import MinichatApp
    from tui.link import EngineLink

    address = address or default_address()
    try:
        split(address)
    except AddressError as e:
        typer.echo(f"minichat: error: {e}", err=True)
        raise typer.Exit(2) from e
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    model = engine_options.pop("model")
    link = EngineLink(address=address, model=model,
                      engine_options={k: v for k, v in engine_options.items() if v != defaults[k]})
    try:
        MinichatApp(link).run()
    finally:
        if link.handle is not None:
            typer.echo(f"minichat: stopping the engine it started (pid {link.handle.pid})")
        link.stop_engine()


root.__signature__ = inspect.Signature([  # type: ignore[attr-defined]
    inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context),
    inspect.Parameter("version", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                      default=typer.Option(False, "--version", callback=_version, is_eager=True,
                                           help="Print the version.")),
    inspect.Parameter("address", inspect.Parameter.KEYWORD_ONLY, annotation=str | None,
                      default=typer.Option(None, "--address", help=ADDRESS_HELP)),
    *_engine_parameters(),
])
app.callback(invoke_without_command=True)(root)


@app.command()
def status(
    address: str | None = typer.Option(None, "--address", help=ADDRESS_HELP),
    timeout: float = typer.Option(2.0, help="Seconds to wait for the engine."),
) -> None:
    """Print the engine's current stats: queues, request slots, KV pages, rates, last steps."""
    from engine.client import EngineClient, EngineUnavailable
    from engine.stats import format_stats

    with EngineClient(address, timeout=timeout) as client:
        try:
            typer.echo(format_stats(client.stats(timeout), client.info()))
        except EngineUnavailable as e:
            typer.echo(f"minichat status: no engine answers at {client.address} ({e})", err=True)
            raise typer.Exit(1) from e


@app.command()
def stop(
    address: str | None = typer.Option(None, "--address", help=ADDRESS_HELP),
    timeout: float = typer.Option(10.0, help="Seconds to wait before killing it."),
) -> None:
    """Stop the engine at the address (in-flight requests end with finish reason "abort")."""
    from engine.addresses import default_address
    from engine.launcher import stop_engine

    address = address or default_address()
    pid = stop_engine(address, timeout)
    if pid is None:
        typer.echo(f"minichat stop: no engine answers at {address}", err=True)
        raise typer.Exit(1)
    typer.echo(f"stopped the engine at {address} (pid {pid})")


def bench(concurrency: int, num_requests: int, input_len: int, output_len: int, range_ratio: float,
          request_rate: float, seed: int, warmup: int, ignore_eos: bool, temperature: float, address: str | None,
          timeout: float, baseline: str | None, json_path: Path | None, **engine_options: typing.Any) -> None:
    """Serving benchmark over the engine's protocol: throughput and TTFT / TPOT / ITL / E2E latency.

    Attaches to the engine at --address; if none answers and an engine option (such as --model) is
    given, or no --address is, starts one with those options and stops it afterwards.
    """
    from tui.bench.command import BenchError, run_bench

    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    try:
        result = run_bench(concurrency=concurrency, num_requests=num_requests, input_len=input_len,
                           output_len=output_len, range_ratio=range_ratio, request_rate=request_rate, seed=seed,
                           warmup=warmup, ignore_eos=ignore_eos, temperature=temperature, address=address,
                           timeout=timeout, baseline=baseline, json_path=json_path,
                           engine_options={k: v for k, v in engine_options.items() if v != defaults[k]})
    except (BenchError, ValueError) as e:
        typer.echo(f"minichat bench: error: {e}", err=True)
        raise typer.Exit(2) from e
    if result["engine"]["failed"]:
        raise typer.Exit(1)


def _option(name: str, annotation: object, default: object, help_text: str, *flags: str) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                             default=typer.Option(default, *flags, help=help_text))


bench.__signature__ = inspect.Signature([  # type: ignore[attr-defined]
    _option("concurrency", int, 32, "Requests in flight at once."),
    _option("num_requests", int, 64, "Measured requests (after warmup)."),
    _option("input_len", int, 128, "Prompt tokens per request (exact, before --range-ratio)."),
    _option("output_len", int, 64, "Output tokens per request."),
    _option("range_ratio", float, 0.0, "Draw lengths uniformly in [len*(1-r), len*(1+r)]."),
    _option("request_rate", float, float("inf"), "Requests/s with Poisson arrivals; inf sends all at once."),
    _option("seed", int, 0, "Seed for the workload and for sampling."),
    _option("warmup", int, 2, "Unmeasured requests sent first."),
    _option("ignore_eos", bool, True, "Generate exactly --output-len.", "--ignore-eos/--no-ignore-eos"),
    _option("temperature", float, 0.0, "Sampling temperature (0 = greedy)."),
    _option("address", str | None, None, ADDRESS_HELP, "--address"),
    _option("timeout", float, 600.0, "Seconds before one request counts as failed."),
    _option("baseline", str | None, None, "'hf': also run transformers generate in static batches."),
    _option("json_path", Path | None, None, "Write the figures and per-request records here.", "--json"),
    # bench's --seed seeds the workload and every sampled request, so the engine's default seed is moot
    *[p for p in _engine_parameters() if p.name != "seed"],
])
app.command("bench")(bench)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
