"""One decoder-only family: Llama, Mistral, Qwen2 and Qwen3 differ only in a few switches.

Qwen2 adds q/k/v biases, Qwen3 adds per-head q/k RMSNorm and an explicit head_dim, Llama may carry
llama3 RoPE scaling. The model runs on a flat token axis (all requests of a step concatenated) and
reads/writes K/V through an attention backend over the paged pool.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from engine.kv.pool import KVPool
from engine.model.ops import linear
from kernels.attention.base import AttentionBackend

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass
class ModelSpec:
    """The shape switches read from an HF config."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    attention_bias: bool
    qkv_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    inv_freq: torch.Tensor
    rope_scaling: float

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig) -> ModelSpec:
        archs = getattr(config, "architectures", None) or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unsupported architecture {archs or config.model_type!r}; minichat runs "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; only silu is implemented")
        if getattr(config, "use_sliding_window", False) or (
            arch == "MistralForCausalLM" and getattr(config, "sliding_window", None)
            and config.sliding_window < config.max_position_embeddings
        ):
            raise ValueError("sliding-window attention is not implemented; use a checkpoint with "
                             "sliding_window = null")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        inv_freq, scaling = rope_frequencies(config, head_dim)
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            rms_norm_eps=config.rms_norm_eps,
            attention_bias=attention_bias,
            qkv_bias=attention_bias or arch == "Qwen2ForCausalLM",
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=config.max_position_embeddings,
            inv_freq=inv_freq,
            rope_scaling=scaling,
        )


def rope_frequencies(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scale, via transformers' own RoPE initialisers.

    Accepts transformers-5 `rope_parameters` and older top-level `rope_theta` / `rope_scaling`.
    """
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"unsupported RoPE type {rope_type!r}; supported: {', '.join(STATIC_ROPE_TYPES)}")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(scaling)


class RMSNorm(nn.Module):
    """Normalise in float32, scale in the model dtype: the same rounding as transformers."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.q_size, self.kv_size = q, kv
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.qkv_proj = nn.Linear(spec.hidden_size, q + 2 * kv, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(q, spec.hidden_size, bias=spec.attention_bias)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)
        self.scale = spec.head_dim**-0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, kv: KVPool,
                backend: AttentionBackend, meta: object) -> torch.Tensor:
        spec, tokens = self.spec, x.shape[0]
        residual = x
        h = self.input_layernorm(x)
        q, k, v = linear(h, self.qkv_proj).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, spec.num_heads, spec.head_dim)
        k = k.view(tokens, spec.num_kv_heads, spec.head_dim)
        v = v.view(tokens, spec.num_kv_heads, spec.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        attn = backend.forward(q, k, v.contiguous(), kv.k(layer), kv.v(layer), meta, self.scale)
        x = residual + linear(attn.reshape(tokens, self.q_size), self.o_proj)
        residual = x
        gate, up = linear(self.post_attention_layernorm(x), self.gate_up_proj).chunk(2, dim=-1)
        return residual + linear(F.silu(gate) * up, self.down_proj)


class CausalLM(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.cos_sin: torch.Tensor | None = None

    def _weight_targets(self) -> dict[str, tuple[torch.Tensor, int]]:
        """HF tensor name -> (our parameter, first row it fills). Fused projections take several."""
        s = self.spec
        q, kv, inter = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.intermediate_size
        targets: dict[str, tuple[torch.Tensor, int]] = {
            "model.embed_tokens.weight": (self.embed_tokens.weight, 0),
            "model.norm.weight": (self.norm.weight, 0),
        }
        if not s.tie_word_embeddings:
            targets["lm_head.weight"] = (self.lm_head.weight, 0)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            targets[p + "input_layernorm.weight"] = (layer.input_layernorm.weight, 0)
            targets[p + "post_attention_layernorm.weight"] = (layer.post_attention_layernorm.weight, 0)
            for name, row in (("q_proj", 0), ("k_proj", q), ("v_proj", q + kv)):
                targets[p + f"self_attn.{name}.weight"] = (layer.qkv_proj.weight, row)
                if s.qkv_bias:
                    targets[p + f"self_attn.{name}.bias"] = (layer.qkv_proj.bias, row)
            targets[p + "self_attn.o_proj.weight"] = (layer.o_proj.weight, 0)
            if s.attention_bias:
                targets[p + "self_attn.o_proj.bias"] = (layer.o_proj.bias, 0)
            if s.qk_norm:
                targets[p + "self_attn.q_norm.weight"] = (layer.q_norm.weight, 0)
                targets[p + "self_attn.k_norm.weight"] = (layer.k_norm.weight, 0)
            for name, row in (("gate_proj", 0), ("up_proj", inter)):
                targets[p + f"mlp.{name}.weight"] = (layer.gate_up_proj.weight, row)
                if s.mlp_bias:
                    targets[p + f"mlp.{name}.bias"] = (layer.gate_up_proj.bias, row)
            targets[p + "mlp.down_proj.weight"] = (layer.down_proj.weight, 0)
            if s.mlp_bias:
                targets[p + "mlp.down_proj.bias"] = (layer.down_proj.bias, 0)
        return targets

    @torch.no_grad()
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into place (ignoring ones we do not use); raise naming any missing."""
        targets = self._weight_targets()
        loaded: set[str] = set()
        for name, tensor in tensors:
            if name not in targets:
                continue
            param, row = targets[name]
            rows = tensor.shape[0]
            if param.dim() != tensor.dim() or param.shape[1:] != tensor.shape[1:] or row + rows > param.shape[0]:
                raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, which does not fit the config")
            param[row : row + rows].copy_(tensor)
            loaded.add(name)
        missing = set(targets) - loaded
        if missing:
            raise ValueError(f"checkpoint lacks weights: {', '.join(sorted(missing)[:8])}")
        self._finish_loading()

    def _finish_loading(self) -> None:
        """Tie the output head and build the RoPE cos/sin table once for every position."""
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        device = self.embed_tokens.weight.device
        pos = torch.arange(self.spec.max_position_embeddings, dtype=torch.float, device=device)
        freqs = pos[:, None] * self.spec.inv_freq.to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_sin = torch.stack((emb.cos(), emb.sin())) * self.spec.rope_scaling

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_index: torch.Tensor,
                kv: KVPool, backend: AttentionBackend, meta: object) -> torch.Tensor:
        """Run the flat batch; returns float32 logits only for the rows in `logits_index`."""
        x = self.embed_tokens(input_ids).to(self.norm.weight.dtype)  # a tied embedding may be stored upcast
        cos_sin = self.cos_sin[:, positions, None, :].to(x.dtype)
        cos, sin = cos_sin[0], cos_sin[1]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, i, kv, backend, meta)
        return linear(self.norm(x[logits_index]), self.lm_head).float()
