"""Replicas behind a gateway, as processes: `minichat serve --http` replicas, SGLang's Model Gateway (`smg`)
in front of them, and the vLLM-named counters a replica's `/metrics` exports. Used by
scripts/bench_replicas.py and tests/test_fleet_tools.py, so the benchmark and the tests start them alike.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tui.scrape import parse

START_TIMEOUT = 120.0
PACE = 0.05  # seconds between two readiness checks of a starting process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], what: str) -> tuple[subprocess.Popen, Path]:
    """Start a process with its output in a log file (a pipe nobody reads would stall it once full)."""
    log = Path(tempfile.mkdtemp(prefix="mcf")) / f"{what}.log"
    with log.open("wb") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT), log


def minichat(*args: str) -> list[str]:
    """The command line of `minichat ARGS` with this interpreter (the venv's, whatever is on PATH)."""
    return [sys.executable, "-m", "tui.cli", *args]


def wait_up(process: subprocess.Popen, ready: Callable[[], bool], what: str, output: Callable[[], str],
            timeout: float = START_TIMEOUT) -> None:
    """Until `ready()` holds, or the process died (`output()`, the end of what it printed, in the error), or
    `timeout` passed."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if ready():
                return
        except httpx.TransportError:
            pass  # not listening yet
        if exited(process, PACE):  # a refused connect returns at once: without a pause this loop takes a core
            raise RuntimeError(f"{what} exited with {process.returncode}: {output()}")
    raise TimeoutError(f"{what} did not come up within {timeout:.0f} s")


def log_tail(log: Path) -> Callable[[], str]:
    return lambda: log.read_text()[-2000:]


def exited(process: subprocess.Popen, within: float) -> bool:
    """Whether `process` exits within `within` seconds (waiting on it meanwhile)."""
    try:
        process.wait(within)
    except subprocess.TimeoutExpired:
        return False
    return True


def stop(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it is still there after 30 s."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class Replica:
    url: str  # http://127.0.0.1:PORT
    address: str  # its engine's
    process: subprocess.Popen  # `minichat serve --http`; its engine is a child that exits with it
    log: Path


@contextmanager
def replica(*serve_args: str) -> Iterator[Replica]:
    """`minichat serve --http` on a free port (the demo model unless `serve_args` name another)."""
    address = f"ipc://{tempfile.mkdtemp(prefix='mcf')}/engine.sock"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process, log = launch(minichat("serve", "--http", f"127.0.0.1:{port}", "--address", address, *serve_args),
                          "serve")
    try:
        wait_up(process, lambda: httpx.get(url + "/health", timeout=2.0).status_code == 200, f"serve (log: {log})",
                log_tail(log))
        yield Replica(url, address, process, log)
    finally:
        stop(process)


@contextmanager
def gateway(smg: str, replicas: Sequence[Replica], policy: str, *options: str) -> Iterator[str]:
    """`smg launch` in front of the replicas; yields its URL once it has registered every one of them
    (its /health answers before its background registration is done, and a request routed meanwhile
    goes to whichever replica registered first)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # smg's own Prometheus endpoint binds 0.0.0.0:29000 unless told otherwise: two gateways would collide
    process, log = launch([smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
                           "--prometheus-port", str(free_port()), "--policy", policy, *options, "--worker-urls",
                           *(r.url for r in replicas)], "smg")

    def registered() -> bool:
        workers = httpx.get(url + "/workers", timeout=2.0).json().get("workers") or []
        return len(workers) == len(replicas) and all(w.get("is_healthy") for w in workers)

    try:
        wait_up(process, registered, f"smg (log: {log})", log_tail(log))
        yield url
    finally:
        process.kill()  # stateless; SIGTERM would hold the port for smg's 5 s load-balancer settle window
        process.wait()


def vllm_counters(url: str) -> defaultdict[str, float]:
    """A replica's `vllm:*_total` counters from its /metrics, each summed over its labels (0 for one that
    has no sample yet: a labelled counter has none before its first request)."""
    values = parse(httpx.get(url + "/metrics", timeout=10.0).text, time.monotonic()).values
    return defaultdict(float, {name: value for name, value in values.items()
                               if name.startswith("vllm:") and name.endswith("_total")})
