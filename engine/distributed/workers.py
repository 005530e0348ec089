"""Rank 0's handle on the worker ranks: start them with the engine, feed them each step, watch them, stop them.

Each worker is a `python -m engine.distributed.worker` process with a socket pair to rank 0 (a
subprocess rather than multiprocessing's spawn, which would re-run the caller's main script). The
pipe carries start-up messages and each step's small header; the step's tensors and every collective
go over the tensor-parallel group (gloo or NCCL). A worker that dies closes its sockets, so rank 0's
next collective fails at once, and `guard` turns that failure into a `WorkerFailed` naming the rank;
while the engine is idle, `check` (called by the server loop) notices a dead worker through its
process handle (a Linux pidfd). Either way the engine stops rather than hangs: collectives also
carry a timeout, for a rank that hangs alive. Ranks on other nodes (engine/distributed/node.py) join
over an authenticated TCP connection instead of a pipe, and its end is how their death shows.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.distributed.group import LOOPBACK, TensorParallel, host_store, interface_toward, join_group
from engine.distributed.handshake import HANDSHAKE_LIMIT, HandshakeFailed, handshake
from engine.distributed.node import Meeting
from engine.distributed.step import StepInputs
from engine.distributed.worker import WorkerSpec
from engine.model.decoder import ModelSpec

TIMEOUT = 120.0
"""Seconds for the rendezvous, for a worker's start-up stages, and for any one collective."""
DEATH_GRACE = 2.0
"""After a collective fails, how long to wait for the worker whose death caused it to be reaped."""
ACCEPT_POLL = 0.2  # seconds node 0's control listener waits for a dialer before it looks at the greeted ones
MAX_GREETERS = 32  # handshakes under way at once; a connection beyond them is closed unread

log = logging.getLogger(__name__)


class WorkerFailed(RuntimeError):
    """A tensor-parallel worker rank died or failed; the engine cannot go on without it."""


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: the CPU for everyone, or the r-th GPU counting from the one asked for."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return str(dev)
    first = dev.index or 0
    return f"cuda:{first + rank}"


class WorkerPool:
    """Ranks 1..N-1: this node's as processes started from `specs` (one per rank), other nodes' as they
    join (`admit_remote`)."""

    def __init__(self, specs: list[WorkerSpec]) -> None:
        self.ranks = [s.rank for s in specs]
        self.procs: list[subprocess.Popen[bytes] | None] = []  # None: a rank on another node
        self.conns: list[Connection] = []
        # readable once that rank is gone: a pidfd for a local process, the connection for a remote rank
        self.sentinels: list[int | Connection] = []
        self.failed: WorkerFailed | None = None  # why the workers are gone, once they are
        self.steps = 0
        self.threads: list[str] = []  # each rank's compute threads and OpenMP wait, as it reported them
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns, self.sentinels)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(Path(__file__).parents[2]),
                                                                        os.environ.get("PYTHONPATH"))))}
        for spec in specs:
            ours, theirs = socket.socketpair()
            with theirs:
                proc = subprocess.Popen([sys.executable, "-m", "engine.distributed.worker", str(theirs.fileno())],
                                        pass_fds=(theirs.fileno(),), env=env)
            self.procs.append(proc)
            self.sentinels.append(os.pidfd_open(proc.pid))
            self.conns.append(Connection(ours.detach()))
            self.conns[-1].send_bytes(pickle.dumps(spec))  # plain pickle: tensors by value, not shared memory

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p is not None]

    def admit_remote(self, specs: list[WorkerSpec], meeting: Meeting, timeout: float) -> None:
        """Wait for the other nodes' ranks at `meeting.control`: each proves the token, says its rank, and
        gets its spec. Every dialer is greeted on a thread of its own within HANDSHAKE_LIMIT (handshake.py), so a
        silent, slow or garbage one is dropped and logged without holding up the others; one that names no
        expected rank (or a rank already joined) is turned away."""
        expected = {s.rank: s for s in specs}
        joined: dict[int, Connection] = {}
        greeted: queue.Queue[tuple[Connection, int]] = queue.Queue()
        greeters = threading.BoundedSemaphore(MAX_GREETERS)
        deadline = time.monotonic() + timeout
        with socket.create_server(meeting.control) as server:
            server.settimeout(ACCEPT_POLL)  # between accepts, collect what the greeters admitted
            while True:
                while not greeted.empty():
                    conn, rank = greeted.get()
                    if rank not in expected or rank in joined:
                        log.warning("a node dialed as rank %d, which is not expected or has joined; turned away", rank)
                        conn.close()
                    else:
                        joined[rank] = conn
                if not expected.keys() - joined.keys():
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(expected.keys() - joined.keys())
                    raise self._fail(f"tensor-parallel rank(s) {missing} on other nodes did not join at "
                                     f"{meeting.host}:{meeting.port} within {timeout:.0f} s")
                try:
                    sock, peer = server.accept()
                except TimeoutError:
                    continue
                if not greeters.acquire(blocking=False):
                    log.warning("dropped a connection from %s: %d handshakes under way already", peer[0], MAX_GREETERS)
                    sock.close()
                    continue
                threading.Thread(target=_greet, args=(sock, peer, meeting.authkey(), min(HANDSHAKE_LIMIT, left),
                                                      greeted, greeters), daemon=True).start()
        for rank in sorted(joined):
            conn = joined[rank]
            conn.send_bytes(pickle.dumps(expected[rank]))
            self.ranks.append(rank)
            self.procs.append(None)
            self.conns.append(conn)
            self.sentinels.append(conn)

    def expect(self, what: str, timeout: float = TIMEOUT) -> list[tuple[Any, ...]]:
        """Wait until every worker has reported `what`, and return the reports in rank order; raise
        WorkerFailed for the first that fails instead."""
        waiting = dict(enumerate(self.conns))
        reports: dict[int, tuple[Any, ...]] = {}
        deadline = time.monotonic() + timeout
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                ranks = ", ".join(str(self.ranks[i]) for i in waiting)
                raise self._fail(f"tensor-parallel rank(s) {ranks} did not report {what!r} within {timeout:.0f} s")
            watched = {id(x): x for i, conn in waiting.items() for x in (conn, self.sentinels[i])}  # a remote
            ready = wait(list(watched.values()), left)  # rank's sentinel is its connection: watch it once
            for i, conn in list(waiting.items()):
                if conn in ready or self.sentinels[i] in ready:
                    try:
                        message = conn.recv()
                    except (EOFError, OSError):
                        raise self._fail(self._describe(i)) from None
                    if message[0] == "error":
                        raise self._fail(f"tensor-parallel rank {self.ranks[i]} failed:\n{message[1]}")
                    if message[0] != what:
                        raise self._fail(f"tensor-parallel rank {self.ranks[i]} said {message[0]!r}, "
                                         f"expected {what!r}")
                    reports[i] = message
                    del waiting[i]
        return [reports[i] for i in range(len(self.conns))]

    def send(self, message: object) -> None:
        """The same message to every worker."""
        with self.guard():
            for conn in self.conns:
                conn.send(message)

    def start_step(self, step: StepInputs, tp: TensorParallel) -> None:
        """Rank 0, before its own forward: every worker gets the step (header by pipe, tensors by broadcast)."""
        self.send(("step", step.header))
        with self.guard():
            step.send(tp)
        self.steps += 1

    def check_in_step(self) -> None:
        """Every worker must have run exactly the steps rank 0 sent (none lost or repeated); raise if not."""
        self.send(("sync",))
        for rank, conn in zip(self.ranks, self.conns, strict=True):
            with self.guard():
                if not conn.poll(TIMEOUT):
                    raise self._fail(f"tensor-parallel rank {rank} did not answer within {TIMEOUT:.0f} s")
                tag, steps = conn.recv()
            if tag != "sync" or steps != self.steps:
                raise AssertionError(f"tensor-parallel rank {rank} ran {steps} steps, rank 0 sent {self.steps}")

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Turn a failed collective or pipe write into WorkerFailed naming the rank that died, if one did."""
        self.raise_if_failed()
        try:
            yield
        except (RuntimeError, OSError, EOFError) as e:
            if isinstance(e, WorkerFailed):
                raise
            dead = self._first_dead(DEATH_GRACE)
            if dead is None:
                raise
            raise self._fail(self._describe(dead)) from e

    def check(self) -> None:
        """Raise WorkerFailed if a worker has exited (cheap: no waiting, no communication)."""
        self.raise_if_failed()
        dead = self._first_dead(0.0)
        if dead is not None:
            raise self._fail(self._describe(dead))

    def raise_if_failed(self) -> None:
        if self.failed is not None:
            raise self.failed

    def close(self) -> None:
        """Tell every worker to stop and wait for them (killing any that do not); later use raises."""
        if self.failed is None:
            self.failed = WorkerFailed("the tensor-parallel workers were stopped (the engine was closed)")
        self._finalizer()

    def _first_dead(self, timeout: float) -> int | None:
        ready = wait(self.sentinels, timeout)
        return next((i for i, fd in enumerate(self.sentinels) if fd in ready), None)

    def _describe(self, i: int) -> str:
        proc, conn = self.procs[i], self.conns[i]
        detail = ""
        with contextlib.suppress(EOFError, OSError):
            if conn.poll(0):
                message = conn.recv()
                if message[0] == "error":
                    detail = f":\n{message[1]}"
        if proc is None:
            return f"tensor-parallel rank {self.ranks[i]} (on another node) closed its connection{detail}"
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(DEATH_GRACE)
        code = proc.returncode
        if code is None:
            how = "closed its pipe"
        elif code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        return f"tensor-parallel rank {self.ranks[i]} (pid {proc.pid}) {how}{detail}"

    def _fail(self, message: str) -> WorkerFailed:
        """Remember the failure (every later call raises it too) and stop the remaining workers."""
        self.failed = WorkerFailed(f"{message}; the engine cannot continue without it")
        self.close()
        return self.failed


def _stop(procs: list[subprocess.Popen[bytes] | None], conns: list[Connection],
          sentinels: list[int | Connection]) -> None:
    for conn in conns:
        with contextlib.suppress(OSError, ValueError):
            conn.send(None)
    deadline = time.monotonic() + 5.0
    for proc in procs:
        if proc is None:  # another node's rank: it exits when its connection closes
            continue
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for conn in conns:
        conn.close()
    for fd in sentinels:
        if isinstance(fd, int):
            os.close(fd)
    sentinels.clear()


def launch(config: EngineConfig, spec: ModelSpec, model_path: str, threads: int,
           timeout: float = TIMEOUT) -> tuple[TensorParallel, WorkerPool]:
    """Start this node's ranks 1..tensor_parallel_size/nnodes-1 (`model_path`: the checkpoint resolved, `threads`:
    each rank's compute threads), admit the other nodes' ranks (at `dist_init_addr`), and join them all as rank 0;
    they load their shards while rank 0 loads its own."""
    parallel, run = config.parallel, config.execution
    size, nnodes, per_node = parallel.tensor_parallel_size, parallel.nnodes, parallel.per_node
    meeting = Meeting.parse(parallel.dist_init_addr) if parallel.dist_init_addr else None
    host = meeting.host if meeting is not None else LOOPBACK
    store = host_store(size, timeout, host, meeting.port if meeting is not None else 0)

    def spec_for(r: int) -> WorkerSpec:  # a rank's device counts from the first one on its own node
        return WorkerSpec(rank=r, size=size, port=store.port, model=spec, model_path=model_path,
                          run=replace(run, device=rank_device(run.device, r % per_node)),
                          page_size=config.kv.page_size, kv_dtype=config.kv_dtype, threads=threads,
                          timeout=timeout, host=host)

    pool = WorkerPool([spec_for(r) for r in range(1, per_node)])
    try:
        if meeting is not None and nnodes > 1:
            pool.admit_remote([spec_for(r) for r in range(per_node, size)], meeting, timeout)
        # each worker says how its threads run: (hello, torch threads, OpenMP wait), for LLM.execution
        pool.threads = [f"{n} ({wait})" for _, n, wait in pool.expect("hello", timeout)]
        device0 = torch.device(rank_device(run.device, 0))
        return join_group(0, size, store, device0, timeout, interface_toward(host)), pool
    except BaseException:
        pool.close()
        raise


def _greet(sock: socket.socket, peer: tuple[str, int], authkey: bytes, limit: float,
           greeted: queue.Queue[tuple[Connection, int]], greeters: threading.BoundedSemaphore) -> None:
    """One dialer's handshake (on its own thread): an authenticated join goes to `greeted`, anything else is
    logged and dropped."""
    try:
        greeted.put(handshake(sock, authkey, limit=limit))
    except HandshakeFailed as e:
        log.warning("dropped a connection from %s:%d to the tensor-parallel control port: %s", peer[0], peer[1], e)
    finally:
        greeters.release()
