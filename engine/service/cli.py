"""`minichat serve` as a typer command, owned by the service layer so the engine never imports the TUI.

The engine options are generated from `EngineConfig`'s parts' fields, so a new engine knob reaches `serve`,
the console and `minichat bench` by itself. `python -m engine.service` runs this command alone; it is
what the launcher starts in the background.
"""

from __future__ import annotations

import inspect
import logging
import os
import signal
import threading
import typing
from collections.abc import Callable
from pathlib import Path

import typer

from engine.config import EngineConfig, model_id, option_fields
from engine.onednn import prepare_onednn
from engine.service.client import AUTH_ENV
from engine.service.options import ApiOptions
from engine.threads import prepare_openmp

if typing.TYPE_CHECKING:  # the launcher is imported where it is used: `minichat --help` stays quick
    from engine.service.catalogue import Catalogue
    from engine.service.launcher import EngineHandle

ADDRESS_HELP = "Engine address: ipc:///path or tcp://127.0.0.1:PORT (default: a per-user ipc socket)."
def prose(text: str) -> str:
    """A docstring as --help should wrap it: each paragraph one line (typer keeps a docstring's line breaks, so at 80
    columns a sentence broke mid-way); a paragraph with indented lines (an example) is kept as it is."""
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(p if any(line.startswith(" ") for line in p.splitlines()) else " ".join(p.split())
                       for p in paragraphs)


ENGINE_PANEL = "Engine options (docs/engine-options.md)"
"""Where --help groups the engine's options, after the command's own."""


def option(name: str, annotation: object, default: object, help_text: str, *flags: str,
           panel: str | None = None, metavar: str | None = None) -> inspect.Parameter:
    """A keyword-only typer option, for commands whose signatures are assembled from parts (in --help's `panel`)."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                             default=typer.Option(default, *flags, help=help_text, rich_help_panel=panel,
                                                  metavar=metavar))


def set_signature(command: Callable[..., None], parameters: list[inspect.Parameter]) -> None:
    """Give a command the parameters typer reads its options from (`inspect.signature` honours a
    function's `__signature__`)."""
    command.__dict__["__signature__"] = inspect.Signature(parameters)


def engine_parameters() -> list[inspect.Parameter]:
    """One --option per engine option (booleans as --x/--no-x), its help the field's own."""
    params = []
    for name, (f, hint, _) in option_fields().items():
        flag = "--" + name.replace("_", "-")
        if hint in (bool, bool | None):
            flag += "/--no-" + name.replace("_", "-")
        params.append(option(name, hint, f.default, f.metadata["help"], flag, *f.metadata["aliases"],
                             panel=ENGINE_PANEL))
    return params


def catalogue_parameters(dir_help: str) -> list[inspect.Parameter]:
    """The engine options with --model repeatable (one PATH, or NAME=PATH for each model of a catalogue), and
    --models-dir: for the commands that can run several models (`serve --http`, the console)."""
    model_help = ("HF checkpoint directory, .gguf file or cached hub id; NAME=PATH, repeated, names a catalogue of "
                  "models (as --models-dir does).")
    return [option("models_dir", list[str] | None, None, dir_help, "--models-dir", metavar="DIR"),
            *[p if p.name != "model" else option("model", list[str] | None, None, model_help, "--model",
                                                 panel=ENGINE_PANEL, metavar="PATH") for p in engine_parameters()]]


def names_catalogue(models_dir: list[str] | None, models: list[str]) -> bool:
    """Whether the options name a catalogue rather than one model: a directory, several models, or NAME=PATH
    (a path that exists with an = in it is one model)."""
    return bool(models_dir) or len(models) > 1 or any("=" in m and not Path(m).exists() for m in models)


def catalogue_of(dirs: list[str] | None, models: list[str]) -> Catalogue:
    """The catalogue the options name (a bare PATH among them is named as it would be served); CatalogueError."""
    from engine.service.catalogue import Catalogue

    return Catalogue.of(dirs or [], [m if "=" in m and not Path(m).exists() else f"{model_id(m)}={m}"
                                     for m in models])


def engine_options_given(options: dict[str, typing.Any]) -> dict[str, typing.Any]:
    """The engine options that differ from EngineConfig's defaults (what a launcher must pass on)."""
    defaults = {name: f.default for name, (f, _, _) in option_fields().items()}
    return {k: v for k, v in options.items() if v != defaults[k]}


API_KEY_ENV = "MINICHAT_API_KEY"


def http_parameters() -> list[inspect.Parameter]:
    """Options the HTTP front end takes in both `serve --http` and `api` (ApiOptions' fields)."""
    defaults = ApiOptions("")
    return [
        inspect.Parameter("api_key", inspect.Parameter.KEYWORD_ONLY, annotation=str | None, default=typer.Option(
            None, "--api-key", envvar=API_KEY_ENV, show_envvar=True,
            help=f"Require `Authorization: Bearer KEY` on every HTTP request but /health. Set {API_KEY_ENV} "
                 f"rather than passing the flag, which every local user can read in the process list.")),
        option("served_model_name", str | None, None, "Model id the API answers to (default: the checkpoint "
               "directory's name).", "--served-model-name"),
        option("engine_timeout", float, defaults.engine_timeout, "Seconds an open stream's engine may stay silent "
               "before the stream is cut (with an error).", "--engine-timeout"),
        option("ping_timeout", float, defaults.ping_timeout, "Seconds the engine has to answer a liveness ping "
               "(/health, and a new request once its stats have gone quiet).", "--ping-timeout"),
        option("max_body_bytes", int, defaults.max_body_bytes, "Largest HTTP request body; bigger ones get a 413 "
               "before they are read.", "--max-body-bytes"),
        option("read_timeout", float, defaults.read_timeout, "Seconds a request's headers and body have to arrive "
               "in; a slower connection is closed.", "--read-timeout"),
        option("max_http_connections", int, defaults.max_http_connections, "Open HTTP connections (fewer if the "
               "open-file limit is lower); beyond them a connection gets a 503 and is closed.",
               "--max-http-connections"),
        option("drain_timeout", int, defaults.drain_timeout, "On SIGTERM or Ctrl-C, seconds requests in flight "
               "have to finish before they are cut.", "--drain-timeout"),
    ]


def api_options(address: str, host: str, port: int, given: dict[str, typing.Any]) -> ApiOptions:
    """ApiOptions from the `http_parameters()` options (popped from `given`), warning about a key passed as
    a flag."""
    chosen = {p.name: given.pop(p.name) for p in http_parameters()}
    chosen["api_key"] = chosen["api_key"] or None
    if chosen["api_key"] is not None and os.environ.get(API_KEY_ENV) != chosen["api_key"]:
        typer.echo(f"minichat: warning: --api-key on the command line is visible to every local user (ps); "
                   f"set {API_KEY_ENV} instead", err=True)
    try:
        return ApiOptions(address, host=host, port=port, **chosen)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e


def split_host_port(value: str) -> tuple[str, int]:
    """'HOST:PORT' (or '[v6]:PORT') -> (host, port)."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise typer.BadParameter(f"expected HOST:PORT such as 127.0.0.1:8000; got {value!r}", param_hint="--http")
    return host.strip("[]"), int(port)


def serve(address: str | None, allow_remote: bool, auth_token: str | None, max_waiting_requests: int,
          max_message_bytes: int, max_connections: int, client_buffer_messages: int, grammar_time_limit: float,
          client_stall_seconds: float, log_level: str, http: str | None, models_dir: list[str] | None,
          max_loaded_models: int, models_memory_gib: float | None, keep_alive: float,
          **engine_options: typing.Any) -> None:
    """Run the engine in the foreground (logs to stderr) until Ctrl-C, SIGTERM or `minichat stop`.

    With --http HOST:PORT, run the engine as a child process instead and the OpenAI-compatible HTTP
    API in the foreground; stopping the API stops that engine.

    With --models-dir DIR (or several --model NAME=PATH) and --http, serve a catalogue of models: each is
    started as its own engine on its first request and stopped when idle for --keep-alive seconds or when
    another needs its place (--max-loaded-models, --models-memory-gib).
    """
    prepare_openmp()  # before torch loads libgomp and oneDNN, here and in the engine child or the TP workers
    prepare_onednn()
    models = engine_options.pop("model") or []
    catalogue = names_catalogue(models_dir, models)
    engine_options["model"] = None if catalogue or not models else models[0]
    unused = [flag for flag, given in (("--max-loaded-models", max_loaded_models != 3), ("--keep-alive",
              keep_alive != 300.0), ("--models-memory-gib", models_memory_gib is not None)) if given]
    if unused and not catalogue:
        typer.echo(f"minichat serve: error: {', '.join(unused)}: only with a catalogue of models (--models-dir, "
                   f"--model NAME=PATH); one model stays loaded for the server's whole life", err=True)
        raise typer.Exit(2)
    if engine_options.get("node_rank"):  # another node of a multi-node engine: only its ranks run here
        _serve_node(log_level, engine_options)
        return
    if http is not None:  # the HTTP front: the engine runs in a child process, so torch is never imported here
        server_options = {"allow_remote": allow_remote, "max_waiting_requests": max_waiting_requests,
                          "max_message_bytes": max_message_bytes, "max_connections": max_connections,
                          "client_buffer_messages": client_buffer_messages, "grammar_time_limit": grammar_time_limit,
                          "client_stall_seconds": client_stall_seconds, "log_level": log_level}
        if auth_token:  # the engine child and the API's clients both read it from the environment
            os.environ[AUTH_ENV] = auth_token
        if catalogue:
            limits = {"max_loaded": max_loaded_models, "keep_alive": keep_alive,
                      "memory_bytes": None if models_memory_gib is None else int(models_memory_gib * (1 << 30))}
            _serve_catalogue(http, address, models_dir or [], models, limits, server_options, engine_options)
        else:
            _serve_http(http, address, server_options, engine_options)
        return
    if catalogue:
        typer.echo("minichat serve: error: a catalogue of models (--models-dir, --model NAME=PATH) is served "
                   "through the HTTP API: add --http HOST:PORT", err=True)
        raise typer.Exit(2)
    from engine.distributed.workers import WorkerFailed
    from engine.service.options import ServerOptions
    from engine.service.server import StartupError, run_server

    for p in http_parameters():  # they only concern --http
        engine_options.pop(p.name)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        options = ServerOptions(address, allow_remote, max_waiting_requests, max_message_bytes, auth_token or None,
                                max_connections, client_buffer_messages, grammar_time_limit, client_stall_seconds)
        run_server(EngineConfig.of(**engine_options), options)
    except (StartupError, WorkerFailed, ValueError) as e:
        typer.echo(f"minichat serve: error: {e}", err=True)
        raise typer.Exit(1) from e


def _serve_node(log_level: str, engine_options: dict[str, typing.Any]) -> None:
    """`serve --node-rank N` (N > 0): this node's tensor-parallel ranks, until node 0 ends them."""
    from engine.distributed.node import run_node

    for p in http_parameters():
        engine_options.pop(p.name)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code = run_node(EngineConfig.of(**engine_options).parallel)
    except ValueError as e:
        typer.echo(f"minichat serve: error: {e}", err=True)
        raise typer.Exit(1) from e
    raise typer.Exit(code)


set_signature(serve, [
    option("address", str | None, None, ADDRESS_HELP, "--address"),
    option("allow_remote", bool, False, "Allow a non-loopback tcp address (needs --auth-token) or --http host.",
           "--allow-remote/--no-allow-remote"),
    inspect.Parameter("auth_token", inspect.Parameter.KEYWORD_ONLY, annotation=str | None,
                      default=typer.Option(None, "--auth-token", envvar=AUTH_ENV, show_envvar=True,
                                           help="Shared secret clients must present (ZeroMQ PLAIN); prefer the "
                                                "environment variable, which other users cannot read.")),
    option("max_waiting_requests", int, 1024, "Refuse new requests ('overloaded') beyond this queue."),
    option("max_message_bytes", int, 1 << 20, "Largest accepted message; bigger ones are refused (too_large), and "
           "beyond 4 times this ZeroMQ drops the connection."),
    option("max_connections", int, 4096, "Engine connections beyond this (or the open-file limit) are closed at "
           "once."),
    option("client_buffer_messages", int, 1000, "Replies ZeroMQ queues for a client that reads slowly; beyond "
                                                "them the engine holds its replies itself."),
    option("client_stall_seconds", float, 10.0, "Seconds a client may read none of its replies before its "
                                                "requests are aborted."),
    option("grammar_time_limit", float, 2.0, "Seconds a request's grammar (JSON schema, regex, EBNF) may compile, "
           "off the engine's loop, before the request is refused (invalid_grammar)."),
    option("log_level", str, "info", "debug, info, warning or error."),
    option("http", str | None, None, "Also serve the OpenAI-compatible HTTP API at HOST:PORT (e.g. 127.0.0.1:8000), "
           "with the engine in a child process.", "--http"),
    option("max_loaded_models", int, 3, "With a catalogue: models loaded at once; the least recently used idle one "
           "is unloaded to load another.", "--max-loaded-models"),
    option("models_memory_gib", float | None, None, "With a catalogue: memory the loaded models' weights and KV "
           "pools may take together (default: no limit).", "--models-memory-gib"),
    option("keep_alive", float, 300.0, "With a catalogue: seconds a model stays loaded after its last request (0: "
           "unloaded after each reply; -1: until it must make room). A request's keep_alive overrides it.",
           "--keep-alive"),
    *http_parameters(),
    *catalogue_parameters("Serve every .gguf file and checkpoint folder in this directory (repeatable; with --http), "
                          "each loaded on its first request."),
])


def _serve_http(http: str, address: str | None, server_options: dict[str, typing.Any],
                engine_options: dict[str, typing.Any]) -> None:
    """The engine as a child process (own interpreter, so generation never competes with the HTTP event loop
    for the GIL; its log goes to a file) and the API in the foreground; the engine stops with the API,
    and the API with the engine: an engine that exits ends `serve` with status 1, said in its log.

    It starts its own engine: an engine that already answers at the address belongs to someone else
    (another console, other options, another model) and is refused; `minichat api` attaches to one."""
    from engine.service.addresses import AddressError, default_address
    from engine.service.client import EngineRefused, probe
    from engine.service.http import check_host, listen, run_api
    from engine.service.launcher import EngineStartError, start

    host, port = split_host_port(http)
    address = address or default_address()
    options = api_options(address, host, port, engine_options)
    model = engine_options.pop("model")
    taken = f"an engine someone else started already answers at {address}; give --address for this one, or " \
            f"put the HTTP API in front of that one with `minichat api --address {address}`"
    try:
        check_host(host, server_options["allow_remote"])
        if probe(address, timeout=1.0) is not None:
            raise EngineStartError(taken)
        sock = listen(host, port)
    except (AddressError, EngineStartError, EngineRefused) as e:
        typer.echo(f"minichat serve: error: {e}", err=True)
        raise typer.Exit(1) from e
    try:
        typer.echo(f"minichat serve: starting the engine at {address} ...", err=True)
        handle = start(address, model=model, **server_options, **engine_options_given(engine_options))
    except (AddressError, EngineStartError, EngineRefused) as e:
        sock.close()
        typer.echo(f"minichat serve: error: {e}", err=True)
        raise typer.Exit(1) from e
    stopping = threading.Event()  # set before we stop the engine ourselves
    died = threading.Event()
    try:
        if not handle.started:  # another launcher won the race for the address
            raise EngineStartError(taken)
        typer.echo(f"minichat serve: engine ready at {address} (pid {handle.pid}, log {handle.log_path})", err=True)
        threading.Thread(target=_watch_engine, args=(handle, stopping, died), name="minichat-engine-watch",
                         daemon=True).start()
        run_api(options, server_options["log_level"], sock)
    except EngineStartError as e:
        typer.echo(f"minichat serve: error: {e}", err=True)
        raise typer.Exit(1) from e
    finally:
        stopping.set()
        handle.stop()
    if died.is_set():
        typer.echo(f"minichat serve: the engine (pid {handle.pid}) exited; see its log {handle.log_path}", err=True)
        raise typer.Exit(1)


def _serve_catalogue(http: str, address: str | None, dirs: list[str], named: list[str], limits: dict[str, typing.Any],
                     server_options: dict[str, typing.Any], engine_options: dict[str, typing.Any]) -> None:
    """The API in the foreground for a catalogue of models (engine/service/http/models.py), each model's engine
    started by the launcher when a request first names it and stopped with the API."""
    from engine.service.addresses import AddressError
    from engine.service.catalogue import CatalogueError, Entry
    from engine.service.http import check_host, listen, run_api
    from engine.service.http.models import Limits, ModelRouter
    from engine.service.launcher import start

    host, port = split_host_port(http)
    options = api_options("", host, port, engine_options)
    logging.basicConfig(level=server_options["log_level"].upper(), format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")  # each load, unload and its reason
    try:
        if address is not None:
            raise CatalogueError("--address: each model of a catalogue gets its own private engine address")
        if options.served_model_name is not None:
            raise CatalogueError("--served-model-name: a catalogue's models are named by their ids (--model NAME=PATH)")
        catalogue = catalogue_of(dirs, named)
        check_host(host, server_options["allow_remote"])
        sock = listen(host, port)
    except (AddressError, CatalogueError) as e:
        typer.echo(f"minichat serve: error: {e}", err=True)
        raise typer.Exit(1) from e
    given = engine_options_given({k: v for k, v in engine_options.items() if k != "model"})
    kv_gib = engine_options.get("kv_memory_gb")

    def start_engine(entry: Entry, where: str, beside_others: bool) -> EngineHandle:
        """Every engine in this session (one scheduler autogroup), and beside others one loads in the background:
        a load at full priority in an autogroup of its own stalled a running stream for a second
        (scripts/bench_model_load.py)."""
        quiet = {"background_load": True} if beside_others else {}
        return start(where, model=str(entry.path), own_session=False, **server_options, **{**given, **quiet})

    router = ModelRouter(catalogue, options, start_engine,
                         Limits(**limits, dtype=engine_options["dtype"], kv_bytes=int((kv_gib or 0) * (1 << 30))))
    typer.echo(f"minichat serve: {len(catalogue.ids())} models ({', '.join(catalogue.ids())}); each starts on its "
               f"first request", err=True)
    run_api(options, server_options["log_level"], sock, router)


def _watch_engine(handle: EngineHandle, stopping: threading.Event, died: threading.Event) -> None:
    """If the engine `handle` started exits while the API runs, set `died` and stop the API (SIGTERM to
    ourselves: uvicorn's graceful exit), so `serve` never sits there answering 503."""
    assert handle.process is not None  # started by this handle
    code = handle.process.wait()
    if not stopping.is_set():
        died.set()
        logging.getLogger("minichat").error("the engine (pid %d) exited with %s; stopping the API", handle.pid, code)
        os.kill(os.getpid(), signal.SIGTERM)


def api(address: str | None, host: str, port: int, allow_remote: bool, log_level: str,
        **http_options: typing.Any) -> None:
    """Serve the OpenAI-compatible HTTP API for the engine running at --address."""
    from engine.service.addresses import AddressError, default_address
    from engine.service.client import EngineRefused, probe
    from engine.service.http import check_host, listen, run_api

    address = address or default_address()
    options = api_options(address, host, port, http_options)
    try:
        check_host(host, allow_remote)
    except AddressError as e:
        typer.echo(f"minichat api: error: {e}", err=True)
        raise typer.Exit(2) from e
    try:
        pong = probe(address, timeout=2.0)
    except EngineRefused as e:
        typer.echo(f"minichat api: error: {e}", err=True)
        raise typer.Exit(1) from e
    if pong is None:
        typer.echo(f"minichat api: error: no engine answers at {address}; start one with "
                   f"`minichat serve --address {address}`", err=True)
        raise typer.Exit(1)
    try:
        sock = listen(host, port)
    except AddressError as e:
        typer.echo(f"minichat api: error: {e}", err=True)
        raise typer.Exit(1) from e
    run_api(options, log_level, sock)


set_signature(api, [
    option("address", str | None, None, ADDRESS_HELP, "--address"),
    option("host", str, "127.0.0.1", "Interface to listen on.", "--host"),
    option("port", int, 8000, "TCP port to listen on.", "--port"),
    option("allow_remote", bool, False, "Allow a non-loopback --host.", "--allow-remote/--no-allow-remote"),
    option("log_level", str, "info", "debug, info, warning or error."),
    *http_parameters(),
])


def main() -> None:
    """`python -m engine.service`: the serve command on its own."""
    app = typer.Typer(add_completion=False)
    app.command(help=prose(serve.__doc__ or ""))(serve)
    app()
