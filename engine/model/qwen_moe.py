"""Qwen2-MoE and Qwen3-MoE: Qwen2's and Qwen3's attention over routed experts (engine/model/moe.py, whose tensor
names are theirs: `mlp.gate`, `mlp.experts.{e}.{gate,up,down}_proj`). Qwen2-MoE adds
a shared expert every token runs, scaled by a sigmoid gate; layers in `mlp_only_layers`, or off the
`decoder_sparse_step`, keep a dense MLP."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.model.decoder import base_spec, require_activation
from engine.model.moe import MoESpec

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def _moe_spec(config: PretrainedConfig, architecture: str, **changes: object) -> MoESpec:
    require_activation(config)
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", 1) or 1
    sparse = tuple(i not in dense and config.num_experts > 0 and (i + 1) % step == 0
                   for i in range(config.num_hidden_layers))
    fields = {**vars(base_spec(config, architecture)), **changes}
    return MoESpec(**fields, num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                   expert_size=config.moe_intermediate_size, norm_topk_prob=bool(config.norm_topk_prob), sparse=sparse)


def read_qwen2_moe(config: PretrainedConfig, architecture: str) -> MoESpec:
    spec = _moe_spec(config, architecture, qkv_bias=bool(getattr(config, "qkv_bias", True)))
    spec.shared_expert_size = getattr(config, "shared_expert_intermediate_size", 0) or 0
    return spec


def read_qwen3_moe(config: PretrainedConfig, architecture: str) -> MoESpec:
    return _moe_spec(config, architecture, qk_norm=True)
