"""minichat's serving engine: continuous batching over a paged KV cache, for HF decoder checkpoints."""

from engine.config import EngineConfig
from engine.llm import LLM
from engine.outputs import Delta, RequestOutput, StepResult
from engine.request import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "Delta", "EngineConfig", "RequestOutput", "SamplingParams", "StepResult", "__version__"]
