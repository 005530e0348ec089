"""What a worker rank (1..N-1) runs: its shard of the model and its share of the KV pool, one step at a time.

A worker has no scheduler, request table or sampler. Rank 0 sends each step's header down the pipe
("step", header) and broadcasts the tensors (engine/distributed/step.py); the worker runs the same forward as rank 0,
joining its all-reduces and the final gather of the logits. The pipe is also how it knows rank 0 is
gone: the read ends (EOF) and the worker exits, so no worker outlives its engine. ("sync",) asks
how many steps it has run, for rank 0's integrity check; None tells it to stop. A rank on another
node (engine/distributed/node.py) has a TCP connection to node 0 instead of the pipe (`--join`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from engine.config import ExecutionConfig
from engine.distributed.group import LOOPBACK, connect_store, interface_toward, join_group
from engine.distributed.handshake import HANDSHAKE_LIMIT, HandshakeFailed, handshake
from engine.distributed.node import Meeting
from engine.distributed.step import StepInputs
from engine.kv.pool import KVPool
from engine.model.decoder import ModelSpec
from engine.model.loader import KV_TORCH_DTYPES, attention_shape, build_model, resolve_checkpoint
from engine.threads import wait_policy
from kernels.attention import make_backend


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker rank needs to start (the first message down its pipe)."""

    rank: int
    size: int
    port: int
    model: ModelSpec
    model_path: str
    run: ExecutionConfig  # the engine's, with this rank's device
    page_size: int
    kv_dtype: str  # what the KV pages hold (EngineConfig.kv_dtype)
    threads: int
    timeout: float
    host: str = LOOPBACK  # where rank 0's store listens (the nodes' meeting host when they span machines)


def main(conn: Connection) -> None:
    """A worker process's life: read its spec, serve steps, exit when told or when rank 0's end closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; rank 0 decides
    try:
        _serve(pickle.loads(conn.recv_bytes()), conn)
    except EOFError:
        pass  # rank 0 is gone: nothing left to serve
    except Exception:
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
        os._exit(1)
    os._exit(0)  # nothing to flush or save; skipping interpreter teardown makes the engine's close quick


def _serve(spec: WorkerSpec, conn: Connection) -> None:
    torch.set_num_threads(spec.threads)
    device = torch.device(spec.run.device)
    conn.send(("hello", torch.get_num_threads(), wait_policy()))
    store = connect_store(spec.host, spec.port, spec.size, spec.timeout)
    tp = join_group(spec.rank, spec.size, store, device, spec.timeout, interface_toward(spec.host))
    model = build_model(spec.model, resolve_checkpoint(spec.model_path), spec.run, tp)
    conn.send(("loaded",))
    num_pages = conn.recv()
    kv = KVPool(model.spec.num_layers, num_pages, spec.page_size, model.num_kv_heads, model.spec.head_dim,
                KV_TORCH_DTYPES[spec.kv_dtype], device)
    backend = make_backend(spec.run.attention_backend, spec.run.device, spec.run.dtype, spec.run.cpu_kernels,
                           spec.model.full_attention)
    backend.setup(attention_shape(model, spec.run.dtype), device)
    model.use_attention_backend(backend, spec.run.one_call)
    conn.send(("ready",))
    steps = 0
    while (message := conn.recv()) is not None:
        if message[0] == "sync":
            conn.send(("sync", steps))
            continue
        step = StepInputs.receive(message[1], tp, device)
        model(step.input_ids, step.positions, step.logits_index, kv, backend, backend.prepare(step.metadata()))
        steps += 1


def join(meeting: Meeting, rank: int, timeout: float) -> Connection:
    """Dial node 0's control listener as `rank` (retrying while node 0 starts), authenticated with the
    nodes' shared token within HANDSHAKE_LIMIT: whatever answers there and does not complete it is not node 0."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection(meeting.control, timeout=HANDSHAKE_LIMIT)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)  # node 0 is not listening yet: retry until it is, or the deadline
    try:
        conn, _ = handshake(sock, meeting.authkey(), limit=HANDSHAKE_LIMIT, rank=rank)
    except HandshakeFailed as e:
        raise ConnectionError(f"{meeting.host}:{meeting.port + 1} is not node 0 of this engine, or its token "
                              f"differs: {e}") from None
    return conn


if __name__ == "__main__":  # python -m engine.distributed.worker FD (engine/distributed/workers.py), or
    # --join HOST:PORT RANK (engine/distributed/node.py, a rank on another node)
    if sys.argv[1] == "--join":
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # its node stops it: nothing to clean up
        main(join(Meeting.parse(sys.argv[2]), int(sys.argv[3]), timeout=600.0))
    else:
        main(Connection(int(sys.argv[1])))
