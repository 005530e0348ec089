"""Tensor-parallel communication: one group of ranks, held by an object the engine passes around.

torch.distributed's default process group is process-wide state, and a process (a test, a
notebook) may build several engines one after another. So, like vLLM's stateless groups, each
engine builds its own group from torch.distributed's parts: a TCPStore for the rendezvous (rank 0
hosts it: on a free loopback port, or at the nodes' meeting address when the ranks span machines) and a
gloo (CPU) or NCCL (CUDA) backend for the collectives. With one rank there is no group and every
collective is the identity.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.distributed as dist

LOOPBACK = "127.0.0.1"


class Collectives(Protocol):
    """The collectives of a c10d backend (ProcessGroupGloo, ProcessGroupNCCL) that the group runs. Every
    backend has them, but torch's stubs leave them off the backends' base class."""

    def allreduce(self, tensors: list[torch.Tensor], /) -> dist.Work: ...

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions, /) -> dist.Work: ...

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: dist.GatherOptions,
               /) -> dist.Work: ...


@dataclass
class TensorParallel:
    """This process's place in a tensor-parallel group: `rank` of `size`, and the backend that links them."""

    rank: int = 0
    size: int = 1
    backend: Collectives | None = None
    store: dist.Store | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; every rank ends with the same values."""
        if self.backend is not None:
            self.backend.allreduce([x]).wait()
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` (same shape and dtype everywhere) takes rank 0's values, in place."""
        if self.backend is not None:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            self.backend.broadcast([x], opts).wait()
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets every rank's `x` concatenated along the last dimension (in rank order); others None."""
        if self.backend is None:
            return x
        x = x.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank == 0:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            self.backend.gather([parts], [x], opts).wait()
            return torch.cat(parts, dim=-1)
        self.backend.gather([], [x], opts).wait()
        return None

    def close(self) -> None:
        """Drop the backend and the store (the store's listening socket closes with it on rank 0)."""
        self.backend = None
        self.store = None


def host_store(size: int, timeout: float, host: str = LOOPBACK, port: int = 0) -> dist.TCPStore:
    """Rank 0's rendezvous store, on a free loopback port by default (read it from `.port`)."""
    return dist.TCPStore(host, port, size, is_master=True, timeout=datetime.timedelta(seconds=timeout),
                         wait_for_workers=False)


def interface_toward(host: str) -> str:
    """This machine's address on the route to `host` (what gloo binds for a group spanning machines)."""
    if host == LOOPBACK or host == "localhost":
        return LOOPBACK
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # UDP: nothing is sent, the kernel only picks the route
        return str(probe.getsockname()[0])


def join_group(rank: int, size: int, store: dist.Store, device: torch.device, timeout: float,
               interface: str = LOOPBACK) -> TensorParallel:
    """Build this rank's backend over `store` (blocks until all `size` ranks have joined); gloo binds
    `interface` (loopback unless the ranks span machines).

    `timeout` bounds every collective, so a rank that hangs surfaces as an error rather than a hang.
    A rank that dies closes its sockets and its peers' collectives fail at once.
    """
    limit = datetime.timedelta(seconds=timeout)
    backend: dist.ProcessGroupNCCL | dist.ProcessGroupGloo
    if device.type == "cuda":
        torch.cuda.set_device(device)
        nccl_options = dist.ProcessGroupNCCL.Options()
        nccl_options._timeout = limit
        backend = dist.ProcessGroupNCCL(store, rank, size, nccl_options)
    else:
        gloo_options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # missing from torch's stubs
        gloo_options._timeout = limit
        gloo_options._devices = [dist.ProcessGroupGloo.create_device(hostname=interface)]
        backend = dist.ProcessGroupGloo(store, rank, size, gloo_options)
    return TensorParallel(rank=rank, size=size, backend=cast(Collectives, backend), store=store)


def connect_store(host: str, port: int, size: int, timeout: float) -> dist.TCPStore:
    """A worker rank's client connection to rank 0's store."""
    return dist.TCPStore(host, port, size, is_master=False, timeout=datetime.timedelta(seconds=timeout))
