"""Mixtral: Mistral's attention over routed experts (engine/model/moe.py), always renormalising the top-k weights
and keeping them in float32, its tensors under `block_sparse_moe` (experts' w1 = gate, w3 = up, w2 = down)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.model.decoder import base_spec, require_activation
from engine.model.moe import ExpertNames, MoELayer, MoELM, MoESpec

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class MixtralLayer(MoELayer):
    names = ExpertNames("block_sparse_moe", "gate", ("w1", "w3", "w2"))


class Mixtral(MoELM):
    moe_layer = MixtralLayer


def read(config: PretrainedConfig, architecture: str) -> MoESpec:
    require_activation(config)
    return MoESpec(**vars(base_spec(config, architecture)), num_experts=config.num_local_experts,
                   top_k=config.num_experts_per_tok, expert_size=config.intermediate_size, norm_topk_prob=True,
                   sparse=(True,) * config.num_hidden_layers, cast_weights=False)
