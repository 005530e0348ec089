"""oneDNN's caches in a long-running engine: bounded, so its memory stops growing once warm.

oneDNN JIT-compiles a matmul primitive for every (weight, row bucket, thread count) it meets (engine/model/ops.py),
and two caches keep each one alive: oneDNN's primitive cache (ONEDNN_PRIMITIVE_CACHE_CAPACITY) and ideep's
computation cache (LRU_CACHE_CAPACITY), both 1,024 entries by default, each entry with its own scratchpad. A
server meets new row buckets and team sizes (engine/threads.py) for a long time, so its memory grew for as long:
in process, the demo model under the soak's mixed load (scripts/soak_rss.py's requests) went 600 -> 677 MiB over
12,000 requests and was still rising; with both caches at 1 it stayed at 460.5-460.6 MiB from request 500 to
8,000, so nothing else grows; at CAPACITY it levelled off at ~700 MiB by request 4,500. CAPACITY holds a decode
step's primitives for every row bucket up to 32 requests at two team sizes, and a few prompt lengths besides.

Nothing here imports torch: `prepare_onednn` must run before torch loads oneDNN (the server's entry does it).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
CAPACITY = "256"


def prepare_onednn(environ: MutableMapping[str, str] = os.environ) -> None:
    """Both caches at CAPACITY entries for this process and its children, unless the user set either."""
    if not any(name in environ for name in CACHE_ENV):
        for name in CACHE_ENV:
            environ[name] = CAPACITY


def cache_capacities(environ: MutableMapping[str, str] = os.environ) -> str:
    """The caches' sizes a process started with `environ` runs with, for reports."""
    return ", ".join(f"{name} {environ.get(name, '1024 (default)')}" for name in CACHE_ENV)
