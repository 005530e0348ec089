"""The `minichat` command line (typer)."""

from __future__ import annotations

import typer

import engine

app = typer.Typer(add_completion=False, no_args_is_help=False, help="minichat: a small LLM serving engine and console.")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"minichat {engine.__version__}")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def root(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Chat with a local model and watch the continuous-batching scheduler serve it."""
    if ctx.invoked_subcommand is None:
        typer.echo(ctx.get_help())


def main() -> None:
    app()
