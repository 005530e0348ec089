"""The model families minichat runs, by architecture: how each reads its config and which model class it builds.

A family is a small module of differences over the shared decoder (engine/model/decoder.py): llama.py, qwen.py,
qwen_moe.py, mixtral.py, gemma.py and phi3.py. Adding one is a new module with a `read` function (config ->
ModelSpec, refusing what it cannot run) and, where its blocks differ, a CausalLM / DecoderLayer subclass, plus one
entry in FAMILIES (docs/architecture.md, "Model families").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.distributed import TensorParallel
from engine.model import gemma, llama, mixtral, phi3, qwen, qwen_moe
from engine.model.decoder import CausalLM, ModelSpec
from engine.model.moe import MoELM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class Family:
    """One architecture: its name as people say it, transformers' class and model_type, how its config is read and
    the model class that runs it."""

    name: str
    architecture: str
    model_type: str
    read: Callable[[PretrainedConfig, str], ModelSpec]
    model: type[CausalLM]


FAMILIES = (
    Family("Llama", "LlamaForCausalLM", "llama", llama.read, CausalLM),
    Family("Mistral", "MistralForCausalLM", "mistral", llama.read, CausalLM),
    Family("Qwen2", "Qwen2ForCausalLM", "qwen2", qwen.read_qwen2, CausalLM),
    Family("Qwen3", "Qwen3ForCausalLM", "qwen3", qwen.read_qwen3, CausalLM),
    Family("Qwen2-MoE", "Qwen2MoeForCausalLM", "qwen2_moe", qwen_moe.read_qwen2_moe, MoELM),
    Family("Qwen3-MoE", "Qwen3MoeForCausalLM", "qwen3_moe", qwen_moe.read_qwen3_moe, MoELM),
    Family("Mixtral", "MixtralForCausalLM", "mixtral", mixtral.read, mixtral.Mixtral),
    Family("Gemma 2", "Gemma2ForCausalLM", "gemma2", gemma.read_gemma2, gemma.Gemma),
    Family("Gemma 3", "Gemma3ForCausalLM", "gemma3_text", gemma.read_gemma3, gemma.Gemma),
    Family("Phi-3", "Phi3ForCausalLM", "phi3", phi3.read, phi3.Phi3),
)
BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES}
SUPPORTED_ARCHITECTURES = tuple(BY_ARCHITECTURE)
MODEL_TYPES = {f.model_type: f.architecture for f in FAMILIES}
"""A config's model_type -> the architecture minichat runs for it."""


def family_of(architecture: str) -> Family:
    family = BY_ARCHITECTURE.get(architecture)
    if family is None:
        raise ValueError(f"unsupported architecture {architecture!r}; minichat runs "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return family


def read_spec(config: PretrainedConfig) -> ModelSpec:
    """The model's shape from its HF config; ValueError naming what is not supported (and what is)."""
    archs = getattr(config, "architectures", None) or []
    arch = next((a for a in archs if a in BY_ARCHITECTURE), None)
    if not archs:  # a config written without `architectures`: its model_type, as transformers' Auto classes read it
        arch = MODEL_TYPES.get(getattr(config, "model_type", ""))
    if arch is None:
        raise ValueError(f"unsupported architecture {archs or config.model_type!r}; minichat runs "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return family_of(arch).read(config, arch)


def build(spec: ModelSpec, tp: TensorParallel | None = None) -> CausalLM:
    """The model (this rank's shard of it) that `spec` describes, its weights not yet loaded."""
    return family_of(spec.architecture).model(spec, tp)


def describe(spec: ModelSpec) -> dict[str, str]:
    """What the model is: its family, then the spec's own words (experts, windows, ...)."""
    return {"family": family_of(spec.architecture).name, **spec.describe()}
