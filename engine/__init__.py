"""minichat's serving engine: continuous batching over a paged KV cache, for HF decoder checkpoints."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.outputs import Delta, Final, RequestOutput, StepResult
from engine.params import SamplingParams

if TYPE_CHECKING:
    from engine.llm import LLM

__version__ = "0.1.0"

__all__ = ["LLM", "Delta", "EngineConfig", "Final", "RequestOutput", "SamplingParams", "StepResult", "__version__"]

# Imported on first use: it pulls in torch, which clients (engine.service.client, the CLI, the TUI) never need.
_LAZY = {"LLM": "engine.llm"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
