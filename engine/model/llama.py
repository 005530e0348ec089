"""Llama and Mistral: the shared decoder as it is (engine/model/decoder.py). Llama may carry llama3 RoPE scaling,
Mistral a sliding window on every layer; both come from the config alone."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.model.decoder import ModelSpec, base_spec, require_activation

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def read(config: PretrainedConfig, architecture: str) -> ModelSpec:
    require_activation(config)
    return base_spec(config, architecture)
