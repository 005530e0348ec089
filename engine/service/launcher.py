"""Find-or-start: attach to the engine at an address, or start `minichat serve` in the background.

Readiness is a handshake (the engine answers a Ping only once its model is loaded and its loop
runs), never a sleep. A background engine logs to a known file (addresses.log_path), and when it
fails to come up the error carries the log's tail, so "bad model path" or "port in use" reads
as such instead of as a timeout.

    handle = find_or_start(model="path/to/ckpt")      # EngineHandle
    with handle.client() as client: ...
    handle.stop()                                     # only stops an engine this handle started
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from engine.service.addresses import check_bindable, default_address, log_path, split
from engine.service.client import AsyncEngineClient, EngineClient, EngineUnavailable, probe

START_TIMEOUT = 120.0  # loading a real checkpoint on CPU can take a while


class EngineStartError(RuntimeError):
    """The background engine exited or never answered; the message ends with its log's tail."""


@dataclass
class EngineHandle:
    """An engine at `address`: started by us (`process` set, `stop()` stops it) or merely attached."""

    address: str
    pid: int
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def started(self) -> bool:
        return self.process is not None

    def client(self, timeout: float = 30.0) -> EngineClient:
        return EngineClient(self.address, timeout=timeout)

    def async_client(self, timeout: float = 30.0) -> AsyncEngineClient:
        return AsyncEngineClient(self.address, timeout=timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine if this handle started it: SIGTERM (in-flight requests get a final "abort"
        message), then SIGKILL after `timeout`. An attached engine belongs to someone else: left alone."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> EngineHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_command(address: str, model: str | None = None, **options: object) -> list[str]:
    """The `minichat serve` command line; `options` are EngineConfig / ServerOptions field names."""
    cmd = [sys.executable, "-m", "engine.service", "--address", address]
    if model is not None:
        cmd += ["--model", str(model)]
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is False:
            cmd.append("--no-" + name.replace("_", "-"))
        elif value is not None:
            cmd += [flag, str(value)]
    return cmd


def find(address: str | None = None, timeout: float = 0.5) -> EngineHandle | None:
    """A handle on the engine answering at `address`, or None."""
    address = address or default_address()
    pong = probe(address, timeout)
    return EngineHandle(address, pong.pid) if pong is not None else None


def start(address: str | None = None, *, model: str | None = None, timeout: float = START_TIMEOUT,
          **options: object) -> EngineHandle:
    """Start `minichat serve` detached (own session, log file) and wait until it answers a ping."""
    address = address or default_address()
    check_bindable(address, bool(options.get("allow_remote", False)))
    log = log_path(address)
    cmd = serve_command(address, model, **options)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # Append: never truncate a log that a running engine may still be writing to.
    with open(log, "ab") as out:
        began = out.seek(0, os.SEEK_END)  # this start's lines begin here: older runs' errors are not its cause
        out.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {shlex.join(cmd)}\n".encode())
        out.flush()
        process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True, env=env)
    pid = _wait_ready(process, address, timeout, log, began)
    if pid != process.pid:  # another launcher won the race for this address: use its engine
        return EngineHandle(address, pid)
    return EngineHandle(address, pid, process, log)


def find_or_start(address: str | None = None, *, model: str | None = None, timeout: float = START_TIMEOUT,
                  **options: object) -> EngineHandle:
    """Attach to the engine at `address` if one answers, else start one (see `start`)."""
    return find(address) or start(address, model=model, timeout=timeout, **options)


def _wait_ready(process: subprocess.Popen[bytes], address: str, timeout: float, log: Path, began: int) -> int:
    end = time.monotonic() + timeout
    with EngineClient(address) as client:
        while True:
            if process.poll() is not None:
                raise EngineStartError(f"the engine exited with code {process.returncode} before it was ready; "
                                       f"the end of {log}:\n{tail(log, began=began)}")
            if time.monotonic() > end:
                process.kill()
                process.wait()
                raise EngineStartError(f"the engine did not answer at {address} within {timeout:g}s; "
                                       f"the end of {log}:\n{tail(log, began=began)}")
            try:
                return client.ping(0.2).pid
            except EngineUnavailable:
                continue


def tail(path: Path, lines: int = 20, began: int = 0) -> str:
    """The last lines of a log file written from byte `began` on ('' if it is missing)."""
    try:
        with open(path, "rb") as f:
            f.seek(began)
            text = f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def stop_engine(address: str | None = None, timeout: float = 10.0) -> int | None:
    """Stop whatever engine answers at `address` (as `minichat stop` does); returns its pid, or None if
    none answered. It must run on this host: the engine is signalled like `kill`, then `kill -9`."""
    address = address or default_address()
    if probe(address) is None:
        return None
    with EngineClient(address) as client:
        info = client.info(timeout=2.0)
    if info.host != socket.gethostname():
        raise RuntimeError(f"the engine at {address} runs on {info.host}, not here; stop it there")
    os.kill(info.pid, signal.SIGTERM)
    end = time.monotonic() + timeout
    while not _released(address):
        if time.monotonic() > end:
            with contextlib.suppress(ProcessLookupError):
                os.kill(info.pid, signal.SIGKILL)
            break
        time.sleep(0.05)  # polling for the socket to go away; there is nothing to wait on
    return info.pid


def _released(address: str) -> bool:
    """The engine has let go of its address (its last act before exiting)."""
    scheme, path = split(address)
    if scheme == "ipc":
        return not os.path.exists(path)
    return probe(address, 0.2) is None
