"""Qwen2 and Qwen3: Qwen2 adds biases to q, k and v; Qwen3 normalises q and k per head (RMSNorm over head_dim,
before RoPE) and may give head_dim explicitly. Windows, where a config asks, come from its layer_types."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from engine.model.decoder import ModelSpec, base_spec, require_activation

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def read_qwen2(config: PretrainedConfig, architecture: str) -> ModelSpec:
    require_activation(config)
    return replace(base_spec(config, architecture), qkv_bias=True)


def read_qwen3(config: PretrainedConfig, architecture: str) -> ModelSpec:
    require_activation(config)
    return replace(base_spec(config, architecture), qk_norm=True)
