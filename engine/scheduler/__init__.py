"""The continuous-batching scheduler: waiting queue, running set, one step at a time."""

from engine.scheduler.decode import DecodeManager
from engine.scheduler.prefill import PrefillAdder, PrefillManager
from engine.scheduler.scheduler import Scheduler

__all__ = ["DecodeManager", "PrefillAdder", "PrefillManager", "Scheduler"]
