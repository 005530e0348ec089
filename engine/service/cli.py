"""`minichat serve` as a typer command, owned by the service layer so the engine never imports the TUI.

The engine options are generated from `EngineConfig`'s fields, so a new engine knob reaches `serve`,
the console and `minichat bench` by itself. `python -m engine.service` runs this command alone; it is
what the launcher starts in the background.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import typing

import typer

from engine.config import EngineConfig
from engine.service.client import AUTH_ENV

ADDRESS_HELP = "Engine address: ipc:///path or tcp://127.0.0.1:PORT (default: a per-user ipc socket)."
ENGINE_HELP = {
    "model": "HF checkpoint directory or cached hub id (default: the embedded demo model).",
    "device": "cpu, cuda or cuda:N.",
    "dtype": "float32, bfloat16 or float16.",
    "page_size": "Tokens per KV page.",
    "kv_memory_gb": "Memory for the KV pool when --num-pages is not given.",
    "max_model_len": "Cap on prompt + output tokens (default: the model's context).",
    "seed": "Seed for requests that sample without their own seed.",
    "attention_backend": "Attention kernels: torch, triton, flashinfer, or auto (the best available).",
    "prefix_cache": "radix (reuse cached prompt prefixes) or naive.",
    "num_pages": "KV pool size in pages (default: what the request slots can use, within memory).",
    "max_running_requests": "Request slots: how many requests may hold KV at once.",
    "max_prefill_tokens": "Prefill token budget per step; longer prompts are chunked.",
}


def option(name: str, annotation: object, default: object, help_text: str, *flags: str) -> inspect.Parameter:
    """A keyword-only typer option, for commands whose signatures are assembled from parts."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                             default=typer.Option(default, *flags, help=help_text))


def engine_parameters() -> list[inspect.Parameter]:
    """One --option per EngineConfig field (booleans as --x/--no-x)."""
    hints = typing.get_type_hints(EngineConfig)
    params = []
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        if hints[f.name] is bool:
            flag += "/--no-" + f.name.replace("_", "-")
        params.append(option(f.name, hints[f.name], f.default, ENGINE_HELP.get(f.name, f"EngineConfig.{f.name}"),
                             flag))
    return params


def engine_options_given(options: dict[str, typing.Any]) -> dict[str, typing.Any]:
    """The engine options that differ from EngineConfig's defaults (what a launcher must pass on)."""
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    return {k: v for k, v in options.items() if v != defaults[k]}


def serve(address: str | None, allow_remote: bool, auth_token: str | None, max_waiting_requests: int,
          max_message_bytes: int, max_connections: int, client_buffer_messages: int, log_level: str,
          **engine_options: typing.Any) -> None:
    """Run the engine in the foreground (logs to stderr) until Ctrl-C, SIGTERM or `minichat stop`."""
    from engine.service.server import ServerOptions, StartupError, run_server

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        options = ServerOptions(address, allow_remote, max_waiting_requests, max_message_bytes, auth_token or None,
                                max_connections, client_buffer_messages)
        run_server(EngineConfig(**engine_options), options)
    except (StartupError, ValueError) as e:
        typer.echo(f"minichat serve: error: {e}", err=True)
        raise typer.Exit(1) from e


serve.__signature__ = inspect.Signature([  # type: ignore[attr-defined]
    option("address", str | None, None, ADDRESS_HELP, "--address"),
    option("allow_remote", bool, False, "Allow a non-loopback tcp address (needs --auth-token).",
           "--allow-remote/--no-allow-remote"),
    inspect.Parameter("auth_token", inspect.Parameter.KEYWORD_ONLY, annotation=str | None,
                      default=typer.Option(None, "--auth-token", envvar=AUTH_ENV, show_envvar=True,
                                           help="Shared secret clients must present (ZeroMQ PLAIN); prefer the "
                                                "environment variable, which other users cannot read.")),
    option("max_waiting_requests", int, 1024, "Refuse new requests ('overloaded') beyond this queue."),
    option("max_message_bytes", int, 1 << 20, "Largest accepted message; bigger ones drop the peer."),
    option("max_connections", int, 4096, "Connections beyond this (or the open-file limit) are closed at once."),
    option("client_buffer_messages", int, 1000, "Replies queued for a client that does not read them before "
                                                "its requests are aborted."),
    option("log_level", str, "info", "debug, info, warning or error."),
    *engine_parameters(),
])


def main() -> None:
    """`python -m engine.service`: the serve command on its own."""
    app = typer.Typer(add_completion=False)
    app.command()(serve)
    app()
