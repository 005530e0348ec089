"""Tensor parallelism across machines: where the nodes meet, and what a node other than node 0 runs.

Node 0 runs the engine: rank 0 and its own worker ranks (started as today, over pipes). It hosts the
rendezvous store at `dist_init_addr` (HOST:PORT) and listens for the other nodes' ranks on PORT + 1.
A node of rank n > 0 (`minichat serve --nnodes N --node-rank n --dist-init-addr HOST:PORT`) runs only
its ranks, each a `python -m engine.distributed.worker --join HOST:PORT RANK` process that dials node 0,
proves it knows the token, and from then on is a worker like a local one (its spec, each step's header,
the collectives). The control channel carries pickles, so it is authenticated (multiprocessing's HMAC
challenge with `MINICHAT_TP_TOKEN`, which every node must share); a meeting address beyond loopback
needs that token. A node's ranks exit when node 0 goes away (their connection closes), and node 0
names a remote rank that dies, as it does a local one.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import cast

from engine.config import ParallelConfig

log = logging.getLogger(__name__)

TOKEN_ENV = "MINICHAT_TP_TOKEN"
LOOPBACK_KEY = b"minichat tensor parallel on loopback"  # no secret needed where only this machine connects
LOOPBACK_HOSTS = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class Meeting:
    """Where the nodes meet: the rendezvous store at `port`, node 0's control listener at `port + 1`."""

    host: str
    port: int

    @classmethod
    def parse(cls, addr: str) -> Meeting:
        host, sep, port = addr.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65535:
            raise ValueError(f"dist_init_addr must be HOST:PORT with a port below 65535; got {addr!r}")
        return cls(host, int(port))

    @property
    def control(self) -> tuple[str, int]:
        return self.host, self.port + 1

    def authkey(self) -> bytes:
        """The token every node shares (MINICHAT_TP_TOKEN); a fixed key only where nothing leaves loopback."""
        token = os.environ.get(TOKEN_ENV)
        if token:
            return token.encode()
        if self.host in LOOPBACK_HOSTS:
            return LOOPBACK_KEY
        raise ValueError(f"a dist_init_addr beyond loopback needs the same {TOKEN_ENV} on every node")


def node_ranks(config: ParallelConfig) -> range:
    """The tensor-parallel ranks node `config.node_rank` runs."""
    return range(config.node_rank * config.per_node, (config.node_rank + 1) * config.per_node)


def run_node(config: ParallelConfig) -> int:
    """A node of rank > 0: start its ranks, wait for them, and return the first failure's exit code (0
    when node 0 ended them). SIGINT/SIGTERM stop them."""
    meeting = Meeting.parse(config.dist_init_addr or "")
    meeting.authkey()  # refuse a missing token before starting anything
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(Path(__file__).parents[2]),
                                                                    os.environ.get("PYTHONPATH"))))}
    ranks = node_ranks(config)
    procs = [subprocess.Popen([sys.executable, "-m", "engine.distributed.worker", "--join",
                               f"{meeting.host}:{meeting.port}", str(rank)], env=env) for rank in ranks]
    log.info("node %d of %d: ranks %d-%d joining %s:%d", config.node_rank, config.nnodes, ranks[0], ranks[-1],
             meeting.host, meeting.port)

    def stop(signum: int, _frame: object) -> None:
        for proc in procs:
            proc.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    running = {os.pidfd_open(proc.pid): (rank, proc) for rank, proc in zip(ranks, procs, strict=True)}
    code = 0
    while running:
        for fd in wait(list(running)):
            rank, proc = running.pop(cast(int, fd))  # a pidfd is readable once its process has exited
            os.close(cast(int, fd))
            status = proc.wait()
            if status != 0 and code == 0:
                code = status if status > 0 else 1
                log.error("rank %d of node %d exited with %d; stopping the others", rank, config.node_rank, status)
                for _, other in running.values():
                    other.terminate()
    return code
