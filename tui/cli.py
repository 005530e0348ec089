"""The `minichat` command line (typer). Thin: the work happens in engine.service and the tui modules."""

from __future__ import annotations

import inspect
import time
import typing
from pathlib import Path

import click
import typer
from rich.markup import escape

import engine

if typing.TYPE_CHECKING:
    from tui.fleet import Fleet
    from tui.link import EngineLink
    from tui.shelf import ModelShelf
from engine.service.cli import (
    ADDRESS_HELP,
    api,
    catalogue_of,
    catalogue_parameters,
    engine_options_given,
    engine_parameters,
    names_catalogue,
    option,
    prose,
    serve,
    set_signature,
)
from tui.models import render as render_models

HELP = """minichat: a small LLM serving engine and console.

Commands (each with its own --help; listed again at the end): serve (the engine, or with --http the OpenAI API in
front of its own engine, or of a catalogue of models with --models-dir), api (the HTTP API for a running engine),
status, stop, bench, models and ps (a server's models, and the loaded ones). Without a command: the
console, on the engine at --address or on one it starts with the engine options below."""
app = typer.Typer(add_completion=False, no_args_is_help=False, help=prose(HELP))


def _version(value: bool) -> None:
    if value:
        typer.echo(f"minichat {engine.__version__}")
        raise typer.Exit()


app.command("serve")(serve)
app.command("api")(api)


def root(ctx: typer.Context, version: bool, address: str | None, engines: str | None, models_dir: list[str] | None,
         **engine_options: typing.Any) -> None:
    """Chat with a local model and watch the continuous-batching scheduler serve it.

    Without a command: open the terminal UI, attached to the engine at --address, or to one it starts
    in the background with the engine options given here (and stops again on exit). With --engines it
    watches those replicas (f4) and starts no engine; its chats and ops panels go to --address, else to
    the first ZeroMQ replica listed. With --models-dir (or several models named NAME=PATH) each chat picks its model
    (f9, /model, /compare), whose engine starts the first time one does.
    """
    if ctx.invoked_subcommand is not None:
        return
    from engine.service.addresses import AddressError, split
    from tui.app import MinichatApp
    from tui.fleet import Fleet, parse_engines

    def fail(message: str) -> typing.NoReturn:
        typer.echo(f"minichat: error: {message}", err=True)
        raise typer.Exit(2)

    try:
        fleet = Fleet(parse_engines(engines)) if engines is not None else None
        if address is not None:
            split(address)
    except (AddressError, ValueError) as e:
        fail(str(e))
    models = engine_options.pop("model") or []
    options = engine_options_given(engine_options)
    if fleet is not None and (models or models_dir or options):
        fail("with --engines the console starts no engine: drop the engine options (`minichat serve` starts one)")
    try:
        link, shelf = _home(address, fleet, models_dir, models, options)
    except ValueError as e:
        fail(str(e))
    app = MinichatApp(link, fleet=shelf.fleet if shelf is not None else fleet, models=shelf)
    try:
        app.run()
    finally:
        started = [link.handle.pid] if link.handle is not None else []
        link.stop_engine()  # a catalogue's home is among the shelf's: stopped once, said once
        for pid in dict.fromkeys(started + (shelf.stop_engines() if shelf is not None else [])):
            typer.echo(f"minichat: stopping the engine it started (pid {pid})")
    if app.return_code:  # quit while the engine link had failed: say why once more, where a shell sees it
        typer.echo(f"minichat: error: {link.state.detail}", err=True)
        raise typer.Exit(app.return_code)


def _home(address: str | None, fleet: Fleet | None, models_dir: list[str] | None, models: list[str],
          options: dict[str, typing.Any]) -> tuple[EngineLink, ModelShelf | None]:
    """The console's home engine link, and its catalogue of models if the options name one (ValueError)."""
    from engine.service.addresses import default_address
    from tui.fleet import Fleet
    from tui.link import EngineLink
    from tui.shelf import ModelShelf

    if names_catalogue(models_dir, models):
        if address is not None:
            raise ValueError("--address: each model of a catalogue gets its own engine (and address)")
        shelf = ModelShelf(catalogue_of(models_dir, models), options, Fleet([]))
        return shelf.link(shelf.catalogue.ids()[0])[0], shelf  # the first model's engine: the console's home
    home = fleet.engine(address) if fleet and address else fleet.engines[0] if fleet and fleet.engines else None
    if home is not None:
        return home.link, None
    return EngineLink(address=address or default_address(), model=models[0] if models else None,
                      engine_options=options, autostart=fleet is None), None


set_signature(root, [
    inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context),
    inspect.Parameter("version", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                      default=typer.Option(False, "--version", callback=_version, is_eager=True,
                                           help="Print the version.")),
    inspect.Parameter("address", inspect.Parameter.KEYWORD_ONLY, annotation=str | None,
                      default=typer.Option(None, "--address", help=ADDRESS_HELP)),
    inspect.Parameter("engines", inspect.Parameter.KEYWORD_ONLY, annotation=str | None, default=typer.Option(
        None, "--engines", metavar="ADDR1,ADDR2,...", help="Watch these replicas in the fleet view (f4): engines' "
        "ZeroMQ addresses and HTTP replicas' URLs (their /metrics), comma-separated.")),
    *catalogue_parameters("Chat with the .gguf files and checkpoint folders in this directory (repeatable): f9 or "
                          "/model picks each chat's model, /compare sends one prompt to several."),
])
app.callback(invoke_without_command=True)(root)


@app.command()
def status(
    address: str | None = typer.Option(None, "--address", help=ADDRESS_HELP),
    timeout: float = typer.Option(2.0, help="Seconds to wait for the engine."),
    pages: bool = typer.Option(False, "--pages", help="Also print the KV page map (a character a page; "
                               "several pages a character in a big pool)."),
    requests: bool = typer.Option(False, "--requests", help="Also list the waiting and running requests and the "
                                  "last steps."),
    watch: bool = typer.Option(False, "--watch", help="Print again every --interval seconds until Ctrl-C."),
    interval: float = typer.Option(1.0, "--interval", help="Seconds between two prints with --watch."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Also say the engine's threads, OpenMP wait and "
                                 "oneDNN caches."),
) -> None:
    """Print the engine's current stats: request slots, queues, KV pages, admission, rates, totals.

    An engine started with --auth-token needs it here too: set MINICHAT_AUTH_TOKEN."""
    from engine.service.addresses import AddressError
    from engine.service.client import EngineClient, EngineRefused, EngineUnavailable
    from tui.status import render

    try:
        client = EngineClient(address, timeout=timeout)
    except AddressError as e:
        typer.echo(f"minichat status: error: {e}", err=True)
        raise typer.Exit(2) from e
    with client:
        try:
            info = client.info()  # first: a refused token says so here, where stats would only time out
            while True:
                try:
                    text = render(client.stats(timeout), info, show_requests=requests, show_pages=pages,
                                  verbose=verbose)
                except EngineUnavailable:  # no stats go out during a step: a long one still answers pings
                    pong = client.ping(timeout)
                    if pong.busy_for is None:
                        raise
                    text = (f"engine pid {pong.pid} is busy: its current step has run {pong.busy_for:.1f} s; "
                            f"stats resume when it ends")
                if watch:
                    click.clear()  # only on a terminal; piped, the prints follow one another
                typer.echo(text)
                if not watch:
                    return
                typer.echo("")
                time.sleep(interval)
        except KeyboardInterrupt:  # how --watch ends: not an error
            return
        except EngineRefused as e:
            typer.echo(f"minichat status: error: {e}", err=True)
            raise typer.Exit(1) from e
        except EngineUnavailable as e:
            typer.echo(f"minichat status: no engine answers at {client.address} ({e})", err=True)
            raise typer.Exit(1) from e


@app.command()
def stop(
    address: str | None = typer.Option(None, "--address", help=ADDRESS_HELP),
    timeout: float = typer.Option(10.0, help="Seconds to wait for it to stop before signalling it."),
) -> None:
    """Stop the engine at the address (in-flight requests end with finish reason "abort").

    It asks through the protocol; a process is signalled only if it verifiably is this user's engine."""
    from engine.service.addresses import AddressError, default_address
    from engine.service.client import EngineRefused
    from engine.service.launcher import stop_engine

    address = address or default_address()
    try:
        pid = stop_engine(address, timeout)
    except (AddressError, EngineRefused, RuntimeError) as e:
        typer.echo(f"minichat stop: error: {e}", err=True)
        raise typer.Exit(2) from e
    if pid is None:
        typer.echo(f"minichat stop: no engine answers at {address}", err=True)
        raise typer.Exit(1)
    typer.echo(f"stopped the engine at {address} (pid {pid})")


URL_HELP = "The HTTP server's root URL (its key from MINICHAT_API_KEY)."


@app.command()
def models(
    url: str = typer.Option("http://127.0.0.1:8000", "--url", help=URL_HELP),
    models_dir: list[str] = typer.Option([], "--models-dir", help="Read this directory's models here instead of "
                                         "asking a server (repeatable)."),
    model: list[str] = typer.Option([], "--model", help="NAME=PATH: one more model to read here (repeatable)."),
) -> None:
    """List the models a server may run (`serve --http --models-dir`), loaded or not, with format and size; or,
    with --models-dir / --model, the catalogue those make, read here without a server."""
    from engine.service.catalogue import Catalogue, CatalogueError

    if models_dir or model:
        try:
            catalogue = Catalogue.of(models_dir, model)
        except CatalogueError as e:
            typer.echo(f"minichat models: error: {e}", err=True)
            raise typer.Exit(2) from e
        typer.echo(render_models([{**entry.describe(), "loaded": None} for entry in catalogue]))
        return
    typer.echo(render_models(_server_models(url, "models")))


@app.command()
def ps(url: str = typer.Option("http://127.0.0.1:8000", "--url", help=URL_HELP)) -> None:
    """List the models a server has loaded: memory, requests in flight, idle time, when each unloads."""
    typer.echo(render_models(_server_models(url, "ps"), loaded_only=True))


def _server_models(url: str, command: str) -> list[dict[str, typing.Any]]:
    """The server's /v1/models cards; exit 1 saying why when it cannot be asked."""
    import os

    import httpx

    from engine.service.cli import API_KEY_ENV

    key = os.environ.get(API_KEY_ENV)
    try:
        reply = httpx.get(url.rstrip("/") + "/v1/models", timeout=10,
                          headers={"Authorization": f"Bearer {key}"} if key else {})
        reply.raise_for_status()
        return list(reply.json()["data"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        typer.echo(f"minichat {command}: error: {url}/v1/models: {e}", err=True)
        raise typer.Exit(1) from e


def bench(concurrency: int, num_requests: int, input_len: int, output_len: int, range_ratio: float,
          request_rate: float, seed: int, warmup: int, ignore_eos: bool, temperature: float, address: str | None,
          timeout: float, baseline: str | None, json_path: Path | None, backend: str, base_url: str | None,
          tokenizer: str | None, api_key: str | None, json_schema: Path | None, prefix_len: int, num_prefixes: int,
          endpoint: str, warm_cache: bool, **engine_options: typing.Any) -> None:
    """Serving benchmark: throughput and TTFT / TPOT / ITL / E2E latency.

    --backend minichat (default) speaks the engine's protocol: it attaches to the engine at --address;
    if none answers and an engine option (such as --model) is given, or no --address is, it starts one
    with those options and stops it afterwards. --backend openai runs the same workload against any
    OpenAI-compatible server at --base-url (minichat's HTTP API, vLLM, SGLang, llama.cpp), where --model
    names the served model, streamed from /v1/completions or the --endpoint named (chat, Anthropic's
    messages, the responses API).

    An engine bench starts has an empty disk KV tier of its own (removed after), so that each run measures
    the same thing; --warm-cache keeps the usual one. An attached engine is as warm as its past requests
    left it. The results go to stdout; notes, warnings and progress to stderr.

    Exit status: 0 when every request completed, 1 when some failed, 3 when none failed but some were
    aborted by someone else (an operator, a shutdown); the figures cover the completed ones only.
    """
    from tui.bench.command import BenchError, run_bench

    try:
        result = run_bench(concurrency=concurrency, num_requests=num_requests, input_len=input_len,
                           output_len=output_len, range_ratio=range_ratio, request_rate=request_rate, seed=seed,
                           warmup=warmup, ignore_eos=ignore_eos, temperature=temperature, address=address,
                           timeout=timeout, baseline=baseline, json_path=json_path,
                           engine_options=engine_options_given(engine_options), backend=backend, base_url=base_url,
                           tokenizer=tokenizer, api_key=api_key, json_schema=json_schema, prefix_len=prefix_len,
                           num_prefixes=num_prefixes, endpoint=endpoint, warm_cache=warm_cache)
    except (BenchError, ValueError) as e:
        typer.echo(f"minichat bench: error: {e}", err=True)
        raise typer.Exit(2) from e
    runs = [result["engine"], *([result["baseline"]] if "baseline" in result else [])]
    if any(run["failed"] for run in runs):
        raise typer.Exit(1)
    if any(run["aborted"] for run in runs):
        raise typer.Exit(3)


set_signature(bench, [
    option("concurrency", int, 32, "Requests in flight at once."),
    option("num_requests", int, 64, "Measured requests (after warmup)."),
    option("input_len", int, 128, "Prompt tokens per request (exact, before --range-ratio)."),
    option("output_len", int, 64, "Output tokens per request."),
    # help is Rich markup, which takes anything in brackets for a tag: escape them
    option("range_ratio", float, 0.0, escape("Draw lengths uniformly in [len*(1-r), len*(1+r)].")),
    option("prefix_len", int, 0, "Shared prefix: each prompt starts with one of --num-prefixes random prefixes of "
           "this many tokens, then its own --input-len."),
    option("num_prefixes", int, 1, "How many shared prefixes (with --prefix-len)."),
    option("request_rate", float, float("inf"), "Requests/s with Poisson arrivals; inf sends all at once."),
    option("seed", int, 0, "Seed for the workload and for sampling."),
    option("warmup", int, 2, "Unmeasured requests sent first."),
    option("warm_cache", bool, False, "An engine bench starts keeps the user's disk KV tier (pages earlier runs "
           "left) instead of an empty one of its own.", "--warm-cache/--cold-cache"),
    option("ignore_eos", bool, True, "Generate exactly --output-len.", "--ignore-eos/--no-ignore-eos"),
    option("temperature", float, 0.0, "Sampling temperature (0 = greedy)."),
    option("address", str | None, None, ADDRESS_HELP, "--address"),
    option("timeout", float, 600.0, "Seconds before one request counts as failed."),
    option("baseline", str | None, None, "'hf': also run transformers generate in static batches; 'unconstrained': "
           "run the workload again without --json-schema."),
    option("json_schema", Path | None, None, "Constrain every output to the JSON schema in this file (structured "
           "output).", "--json-schema"),
    option("json_path", Path | None, None, "Write the figures and per-request records here.", "--json"),
    option("backend", str, "minichat", "minichat (the engine's protocol) or openai (any OpenAI-compatible server).",
           "--backend"),
    option("base_url", str | None, None, "openai backend: the API's base URL, e.g. http://127.0.0.1:8000/v1.",
           "--base-url"),
    option("endpoint", str, "completions", "openai backend: the API streamed: completions, chat, messages "
           "(Anthropic's) or responses (prompts as one user message on the last three).", "--endpoint"),
    option("tokenizer", str | None, None, "openai backend: checkpoint whose vocabulary the prompts use (default: "
           "the `root` the server reports for the model, else --model).", "--tokenizer"),
    inspect.Parameter("api_key", inspect.Parameter.KEYWORD_ONLY, annotation=str | None, default=typer.Option(
        None, "--api-key", envvar="OPENAI_API_KEY", help="openai backend: bearer key for the server.")),
    # bench's --seed seeds the workload and every sampled request, so the engine's default seed is moot
    *[p for p in engine_parameters() if p.name != "seed"],
])
app.command("bench")(bench)


for _command in app.registered_commands:  # every command's docstring wrapped as prose in --help
    if _command.help is None and _command.callback is not None:
        _command.help = prose(_command.callback.__doc__ or "")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
