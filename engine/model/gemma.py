"""Gemma 2 and Gemma 3 (text): the shared decoder with Gemma's parts.

- RMSNorm scales by (1 + weight), in float32, rounding once (`OffsetRMSNorm`).
- Both halves of a block are wrapped in norms: attention's output and the MLP's are normalised again before they
  join the residual stream (`GemmaLayer`: pre/post attention, pre/post feed-forward).
- The embedding is scaled by sqrt(hidden_size); the MLP's activation is GELU's tanh form; q . k is scaled by
  `query_pre_attn_scalar` ** -0.5.
- Gemma 2 caps attention scores and final logits (cap * tanh(x / cap)); Gemma 3 caps the logits only where its
  config says, and normalises q and k per head.
- Local (sliding-window) and global layers alternate as `layer_types` says; Gemma 3 rotates them with two RoPE bases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F

from engine.distributed import TensorParallel
from engine.model.decoder import (
    CausalLM,
    DecoderLayer,
    ModelSpec,
    RMSNorm,
    base_spec,
    require_activation,
    rope_frequencies,
)
from engine.model.layer_ops import LayerKernels, LayerOps, LayerStep
from engine.model.parallel import RowParallelLinear

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass
class GemmaSpec(ModelSpec):
    final_softcap: float | None = None


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the row normalised in float32, times (1 + weight) in float32, rounded once."""

    rounds_normed = False

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        self._gain: torch.Tensor | None = None

    @property
    def gain(self) -> torch.Tensor:
        if self._gain is None:
            raise RuntimeError("OffsetRMSNorm: the weights are not loaded")
        return self._gain

    def finish_loading(self) -> None:
        self._gain = 1.0 + self.weight.float()

    @property
    def c_exact(self) -> bool:
        """The C kernel rounds the normalised row before scaling: the same numbers only in float32."""
        return self.weight.dtype == torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.gain, self.eps).to(x.dtype)


class GemmaLayer(DecoderLayer):
    """A block with a norm before and after each half; GELU (tanh) between the MLP's products. Gemma 3's layers
    run in decode.c's one call too; Gemma 2's capped attention scores do not."""

    norm_class = OffsetRMSNorm
    activation = "gelu_tanh"

    def __init__(self, spec: ModelSpec, index: int, tp: TensorParallel) -> None:
        super().__init__(spec, index, tp)
        self.pre_feedforward_layernorm = OffsetRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.in_one_call = spec.softcap is None

    def one_call_norms(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.input_layernorm.gain, self.pre_feedforward_layernorm.gain

    def one_call_output_norms(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.post_attention_layernorm.gain, self.post_feedforward_layernorm.gain

    def norms(self) -> dict[str, RMSNorm]:
        return super().norms() | {"pre_feedforward_layernorm": self.pre_feedforward_layernorm,
                                  "post_feedforward_layernorm": self.post_feedforward_layernorm}

    def residual_projections(self) -> list[RowParallelLinear]:
        return []  # both halves' outputs are normalised before they are added

    def execution(self, kernels: LayerKernels) -> dict[str, str]:
        return {"activation": "GELU (tanh): minichat's C where the layers run in one call or in block formats, "
                              "else torch"}

    def attention_block(self, ops: LayerOps, x: torch.Tensor, residual: torch.Tensor | None, index: int,
                        step: LayerStep) -> tuple[torch.Tensor, torch.Tensor | None]:
        qkv, stream = ops.norm_linear(self, x, residual, self.input_layernorm, self.qkv_proj)
        out = ops.linear(self, ops.attend(self, qkv, index, step), self.o_proj)
        return ops.norm(out, None, self.post_attention_layernorm)[0], stream

    def mlp_block(self, ops: LayerOps, x: torch.Tensor,
                  residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        gate_up, stream = ops.norm_linear(self, x, residual, self.pre_feedforward_layernorm, self.gate_up_proj,
                                          gated=True)
        out = ops.linear(self, gate_up, self.down_proj, gated=True)
        return ops.norm(out, None, self.post_feedforward_layernorm)[0], stream


class Gemma(CausalLM):
    """Gemma's layers; embeddings scaled by sqrt(hidden_size) in the model dtype, logits capped where configured."""

    layer_class = GemmaLayer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)
        # sqrt(hidden_size) rounded to the model dtype first, as transformers' embed_scale is
        return x * float(torch.tensor(self.spec.hidden_size**0.5).to(x.dtype))

    def logits(self, h: torch.Tensor) -> torch.Tensor | None:
        logits = self.head(h)
        cap = cast(GemmaSpec, self.spec).final_softcap
        if logits is None:
            return None
        if cap is not None:  # in the model dtype, as transformers caps them
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


def _gemma_spec(config: PretrainedConfig, architecture: str) -> GemmaSpec:
    require_activation(config, "gelu_pytorch_tanh", "hidden_activation")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("Gemma with use_bidirectional_attention is an encoder; minichat runs causal decoders")
    return GemmaSpec(**{**vars(base_spec(config, architecture)), "scale": config.query_pre_attn_scalar**-0.5},
                     final_softcap=getattr(config, "final_logit_softcapping", None))


def read_gemma2(config: PretrainedConfig, architecture: str) -> GemmaSpec:
    spec = _gemma_spec(config, architecture)
    spec.softcap = getattr(config, "attn_logit_softcapping", None)
    return spec


def read_gemma3(config: PretrainedConfig, architecture: str) -> GemmaSpec:
    """Gemma 3's local layers rotate with one RoPE base, its global ones with another; its attention is not capped
    (transformers' Gemma3Attention passes no softcap, whatever the config holds)."""
    spec = _gemma_spec(config, architecture)
    kinds = ("sliding_attention", "full_attention")
    spec.ropes = [rope_frequencies(config, spec.head_dim, kind) for kind in kinds]
    spec.layer_ropes = tuple(kinds.index(kind) for kind in config.layer_types)
    spec.qk_norm = True
    return spec
