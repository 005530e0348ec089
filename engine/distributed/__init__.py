"""Tensor parallelism's runtime: the group of ranks (group.py), rank 0's handle on the worker ranks
(workers.py), and what a worker rank runs (worker.py)."""

from engine.distributed.group import TensorParallel, connect_store, host_store, join_group

__all__ = ["TensorParallel", "connect_store", "host_store", "join_group"]
