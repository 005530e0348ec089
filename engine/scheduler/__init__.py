"""The continuous-batching scheduler: waiting queue, running set, one step at a time.

snapshot.py (the scheduler's picture and its rows, which the wire carries) imports no torch, so this
package imports the rest on first use: a client reading `engine.scheduler.snapshot` never loads torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.scheduler.decode import DecodeManager
    from engine.scheduler.prefill import PrefillAdder, PrefillManager
    from engine.scheduler.scheduler import Scheduler

__all__ = ["DecodeManager", "PrefillAdder", "PrefillManager", "Scheduler"]

_LAZY = {"DecodeManager": "engine.scheduler.decode", "PrefillAdder": "engine.scheduler.prefill",
         "PrefillManager": "engine.scheduler.prefill", "Scheduler": "engine.scheduler.scheduler"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine.scheduler' has no attribute {name!r}")
