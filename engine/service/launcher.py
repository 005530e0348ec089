"""Find-or-start: attach to the engine at an address, or start `minichat serve` in the background.

Readiness is a handshake (the engine answers a Ping only once its model is loaded and its loop
runs), never a sleep. A background engine logs to a known file (addresses.log_path), and when it
fails to come up the error carries the log's tail, so "bad model path" or "port in use" reads
as such instead of as a timeout.

    handle = find_or_start(model="path/to/ckpt")      # EngineHandle
    with handle.client() as client: ...
    handle.stop()                                     # only stops an engine this handle started

`stop_engine` (what `minichat stop` runs) asks the engine to shut down through the protocol, and
signals a process only after checking it really is that engine (see `is_engine_process`): a listener
claiming any pid must not get an innocent process killed.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.service.addresses import check_bindable, default_address, log_path, split
from engine.service.client import (
    AUTH_ENV,
    AsyncEngineClient,
    EngineClient,
    EngineError,
    EngineUnavailable,
    probe,
    resolve_auth_token,
)
from engine.service.parent import PARENT_ENV

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
    auth_token: str | None = None

    @property
    def started(self) -> bool:
        return self.process is not None

    def client(self, timeout: float = 30.0, name: str | None = None) -> EngineClient:
        return EngineClient(self.address, timeout=timeout, auth_token=self.auth_token, name=name)

    def async_client(self, timeout: float = 30.0, name: str | None = None) -> AsyncEngineClient:
        return AsyncEngineClient(self.address, timeout=timeout, auth_token=self.auth_token, name=name)

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


def find(address: str | None = None, timeout: float = 0.5, auth_token: str | None = None) -> EngineHandle | None:
    """A handle on the engine answering at `address`, or None."""
    address = address or default_address()
    token = resolve_auth_token(auth_token)
    pong = probe(address, timeout, token)
    return EngineHandle(address, pong.pid, auth_token=token) if pong is not None else None


def start(address: str | None = None, *, model: str | None = None, timeout: float = START_TIMEOUT,
          auth_token: str | None = None, own_session: bool = True, **options: object) -> EngineHandle:
    """Start `minichat serve` detached (own session, log file) and wait until it answers a ping.

    The `auth_token` (or $MINICHAT_AUTH_TOKEN) reaches the engine through its environment, never
    its command line, which every local user can read. Without `own_session` the engine gets only its own
    process group (a terminal's Ctrl-C still does not reach it) and stays in the caller's session, and so in its
    scheduler autogroup: engines that share one weigh against each other by their threads' priorities, which a
    low-priority load (`--background-load`) needs; across autogroups each gets an even share whatever they run."""
    address = address or default_address()
    token = resolve_auth_token(auth_token)
    check_bindable(address, bool(options.get("allow_remote", False)), token is not None)
    log = log_path(address)
    cmd = serve_command(address, model, **options)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", PARENT_ENV: str(os.getpid())}  # it stops when we die
    if token is not None:
        env[AUTH_ENV] = token
    # Append: never truncate a log that a running engine may still be writing to.
    with open(log, "ab") as out:
        began = out.seek(0, os.SEEK_END)  # this start's lines begin here: older runs' errors are not its cause
        out.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {shlex.join(cmd)}\n".encode())
        out.flush()
        process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=own_session, process_group=None if own_session else 0,
                                   env=env)
    pid = _wait_ready(process, address, timeout, log, began, token)
    if pid != process.pid:  # another launcher won the race for this address: use its engine
        return EngineHandle(address, pid, auth_token=token)
    return EngineHandle(address, pid, process, log, token)


def find_or_start(address: str | None = None, *, model: str | None = None, timeout: float = START_TIMEOUT,
                  auth_token: str | None = None, **options: Any) -> EngineHandle:
    """Attach to the engine at `address` if one answers, else start one (see `start`)."""
    return find(address, auth_token=auth_token) or start(address, model=model, timeout=timeout,
                                                         auth_token=auth_token, **options)


def _wait_ready(process: subprocess.Popen[bytes], address: str, timeout: float, log: Path, began: int,
                token: str | None) -> int:
    end = time.monotonic() + timeout
    with EngineClient(address, auth_token=token) as client:
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


def stop_engine(address: str | None = None, timeout: float = 10.0, auth_token: str | None = None) -> int | None:
    """Stop the engine at `address` (as `minichat stop` does); returns its pid, or None if none answered.

    It sends the protocol's `shutdown` and waits for the address to be released. Only if the engine
    does not comply in time is its pid signalled (SIGTERM, then SIGKILL), and only once
    `is_engine_process` vouches for it; otherwise RuntimeError says why nothing was killed."""
    address = address or default_address()
    token = resolve_auth_token(auth_token)
    if probe(address, auth_token=token) is None:
        return None
    with EngineClient(address, auth_token=token) as client:
        try:
            pid = client.shutdown(timeout=2.0)
        except (EngineUnavailable, EngineError):  # wedged, or too old to know `shutdown`
            pid = client.ping(timeout=2.0).pid
    if _wait_released(address, timeout, token):
        return pid
    if not is_engine_process(pid, address):
        raise RuntimeError(f"the engine at {address} did not stop, and pid {pid} (which it claims to be) is not "
                           f"verifiably a minichat engine of this user holding that address; not signalling it")
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        if _wait_released(address, timeout, token):
            break
    return pid


def _wait_released(address: str, timeout: float, token: str | None) -> bool:
    end = time.monotonic() + timeout
    while not _released(address, token):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)  # polling for the socket to go away; there is nothing to wait on
    return True


def is_engine_process(pid: int, address: str) -> bool:
    """True only if process `pid` belongs to this user, runs minichat's engine (`engine.service` or
    `minichat serve` on its command line) and holds the listening socket of `address` (Linux /proc)."""
    proc = Path(f"/proc/{pid}")
    try:
        if proc.stat().st_uid != os.getuid():
            return False
        argv = (proc / "cmdline").read_bytes().split(b"\0")
        held = {os.readlink(fd) for fd in (proc / "fd").iterdir()}
    except OSError:
        return False
    joined = b" ".join(argv)
    if b"engine.service" not in joined and not (b"minichat" in joined and b"serve" in argv):
        return False
    return any(f"socket:[{inode}]" in held for inode in _listening_inodes(address))


def _listening_inodes(address: str) -> set[str]:
    """Inodes of the sockets listening at `address`, from /proc/net/{unix,tcp,tcp6}."""
    scheme, rest = split(address)
    inodes = set()
    if scheme == "ipc":
        with contextlib.suppress(OSError), open("/proc/net/unix") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if len(fields) >= 8 and fields[7] == rest:
                    inodes.add(fields[6])
        return inodes
    port = f"{int(rest.rpartition(':')[2]):04X}"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if len(fields) >= 10 and fields[1].endswith(":" + port) and fields[3] == "0A":  # 0A: LISTEN
                    inodes.add(fields[9])
    return inodes


def _released(address: str, token: str | None = None) -> bool:
    """The engine has let go of its address (its last act before exiting)."""
    scheme, path = split(address)
    if scheme == "ipc":
        return not os.path.exists(path)
    return probe(address, 0.2, token) is None
