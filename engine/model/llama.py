"""Llama and Mistral: the shared decoder as it is (engine/model/decoder.py). Llama may carry llama3 RoPE scaling,
Mistral a sliding window on every layer; both come from the config alone."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.model.decoder import ModelSpec, base_spec

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def require_activation(config: PretrainedConfig, name: str = "silu", key: str = "hidden_act") -> None:
    """Refuse an MLP activation the family's kernels do not compute."""
    act = getattr(config, key, name)
    if act != name:
        raise ValueError(f"unsupported {key} {act!r}; this family runs {name}")


def read(config: PretrainedConfig, architecture: str) -> ModelSpec:
    require_activation(config)
    return base_spec(config, architecture)
