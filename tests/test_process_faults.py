"""Faults between processes (issue 25, items 6 and 7): an engine dies with the process that launched it
(even a SIGKILLed `minichat serve --http`); `serve --http` starts its own engine and refuses an address
someone else's engine holds; when its engine dies, `serve --http` says so and exits 1."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time

from engine.service.client import probe
from engine.service.launcher import start
from tests.test_http_api import free_port, minichat, stop, wait_http


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def wait_until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # each check waits on a probe or a syscall, not a sleep
        assert time.monotonic() < deadline, f"{what} within {timeout:.0f} s"


def address() -> str:
    return f"ipc://{tempfile.mkdtemp(prefix='mcp')}/engine.sock"


def serve_http(addr: str) -> tuple[subprocess.Popen[str], int]:
    port = free_port()
    process = subprocess.Popen(minichat("serve", "--http", f"127.0.0.1:{port}", "--address", addr),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_http(process, f"http://127.0.0.1:{port}/health")
    pong = probe(addr, 5.0)
    assert pong is not None
    return process, pong.pid


def test_a_sigkilled_serve_http_takes_its_engine_with_it():
    addr = address()
    process, engine_pid = serve_http(addr)
    try:
        process.kill()
        process.wait()
        wait_until(lambda: probe(addr, 0.5) is None and gone(engine_pid), "the orphaned engine to stop")
    finally:
        stop(process)
        if not gone(engine_pid):
            os.kill(engine_pid, signal.SIGKILL)


def test_serve_http_refuses_an_address_another_engine_holds():
    addr = address()
    with start(addr, timeout=120) as other:
        run = subprocess.run(minichat("serve", "--http", f"127.0.0.1:{free_port()}", "--address", addr),
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 1 and "minichat api --address" in run.stderr, run.stderr
        assert probe(addr, 2.0).pid == other.pid  # left alone


def test_serve_http_exits_1_when_its_engine_dies():
    addr = address()
    process, engine_pid = serve_http(addr)
    try:
        os.kill(engine_pid, signal.SIGKILL)
        assert process.wait(60) == 1
        assert f"the engine (pid {engine_pid}) exited" in process.stderr.read()
    finally:
        stop(process)
