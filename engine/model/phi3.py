"""Phi-3: the shared decoder, with q/k/v and gate/up stored fused in the checkpoint (`qkv_proj`, `gate_up_proj`),
split at load into each part's rows (and each rank's share of them). Its sliding window, where the config has one,
covers every layer."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.model.decoder import CausalLM, DecoderLayer, ModelSpec, Targets, base_spec, require_activation

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Phi3Layer(DecoderLayer):
    def attention_targets(self, prefix: str) -> Targets:
        return {prefix + "qkv_proj.weight": tuple(self.qkv_proj.target(part, fused=True) for part in range(3)),
                prefix + "o_proj.weight": (self.o_proj.target(),)}

    def mlp_targets(self, prefix: str) -> Targets:
        return {prefix + "mlp.gate_up_proj.weight": tuple(self.gate_up_proj.target(part, fused=True)
                                                          for part in range(2)),
                prefix + "mlp.down_proj.weight": (self.down_proj.target(),)}


class Phi3(CausalLM):
    layer_class = Phi3Layer


def read(config: PretrainedConfig, architecture: str) -> ModelSpec:
    require_activation(config)
    return base_spec(config, architecture)
