"""One decoder-only family: Llama, Mistral, Qwen2 and Qwen3 differ only in a few switches.

Qwen2 adds q/k/v biases, Qwen3 adds per-head q/k RMSNorm and an explicit head_dim, Llama may carry
llama3 RoPE scaling. The model runs on a flat token axis (all requests of a step concatenated) and
reads/writes K/V through an attention backend over the paged pool.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import TensorParallel
from engine.kv.pool import KVPool
from engine.model.layer_ops import BLOCK_OPS, EAGER_OPS, LayerOps, LayerStep, TritonOps
from engine.model.ops import fuses_add, gemm_dtype
from engine.model.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    Source,
    Split,
    VocabParallelEmbedding,
    WeightTarget,
    load_into,
)
from engine.model.quantized import finish_block_weights
from kernels.attention.base import AttentionBackend
from kernels.attention.cpu import PagedStep
from kernels.cpu import DENSE_ROWS
from kernels.quant import BlockMatrix

if TYPE_CHECKING:  # transformers is imported only where a config is read, not by tensor-parallel workers
    from transformers import PretrainedConfig

    from kernels.attention.triton import TritonBackend
    from kernels.cpu import CpuKernels
    from kernels.cpu.decode import FusedLayers

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
DENSE_BUFFER = 4 * 2**20
"""Float32 values a block-format model expands its weights into, a chunk of rows at a time, for steps of
DENSE_ROWS tokens or more (16 MiB: 1,024 rows of a 4,096-wide projection)."""


class Scratch:
    """One float32 buffer the layers take in turn for an intermediate they consume at once (the MLP activation),
    grown to the largest step's need. A fresh tensor over glibc's mmap threshold (32 MiB) is fresh pages, each
    faulted in on every call: Qwen2.5-0.5B's activation at 2,048 rows (39 MiB) took 19 ms fresh and 7.5 ms
    reused, 24 times a prefill step."""

    def __init__(self, device: torch.device) -> None:
        self._buffer = torch.empty(0, dtype=torch.float32, device=device)

    def take(self, rows: int, cols: int) -> torch.Tensor:
        """A [rows, cols] view of the buffer; valid until the next `take`."""
        if self._buffer.numel() < rows * cols:
            self._buffer = torch.empty(rows * cols, dtype=torch.float32, device=self._buffer.device)
        return self._buffer[:rows * cols].view(rows, cols)


MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM"}
"""A config's model_type -> the architecture minichat runs for it."""
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
        if not archs:  # a config written without `architectures`: its model_type, as transformers' Auto classes read it
            arch = MODEL_TYPES.get(getattr(config, "model_type", ""))
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
    """Normalise in float32, scale in the model dtype: the same rounding as transformers.

    `F.rms_norm` is one fused pass on the CPU where the written-out formula is five; a float32 model
    folds the weight in too (a half-precision one must round before scaling, as transformers does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels: CpuKernels | None = None  # the one-pass C kernel, same roundings (CausalLM.use_cpu_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.dim() == 2:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        shape = (x.shape[-1],)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), shape, eps=self.eps).to(x.dtype)


class DecoderLayer(nn.Module):
    """One block; under tensor parallelism it holds this rank's heads and intermediate rows only."""

    def __init__(self, spec: ModelSpec, tp: TensorParallel) -> None:
        super().__init__()
        self.spec = spec
        heads = Split(spec.num_heads, spec.head_dim, "attention heads")
        kv_heads = Split(spec.num_kv_heads, spec.head_dim, "KV heads", replicate=True)
        inter = Split(spec.intermediate_size, 1, "intermediate size")
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.qkv_proj = ColumnParallelLinear(spec.hidden_size, [heads, kv_heads, kv_heads], spec.qkv_bias, tp)
        self.q_size, self.kv_size = self.qkv_proj.sizes[:2]
        self.num_heads, self.num_kv_heads = self.q_size // spec.head_dim, self.kv_size // spec.head_dim
        self.o_proj = RowParallelLinear(heads, spec.hidden_size, spec.attention_bias, tp)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.gate_up_proj = ColumnParallelLinear(spec.hidden_size, [inter, inter], spec.mlp_bias, tp)
        self.down_proj = RowParallelLinear(inter, spec.hidden_size, spec.mlp_bias, tp)
        self.scale = spec.head_dim**-0.5
        self.residual_in_gemm = False  # both residual adds as oneDNN post-ops (see fuse_residual_adds)
        self.mlp_kernels: CpuKernels | None = None  # C activation between float32 GEMMs (CausalLM.use_cpu_kernels)
        self.activation: Scratch | None = None  # where that activation goes (shared by the layers)
        self.block_kernels: CpuKernels | None = None  # every projection in block formats (CausalLM.use_cpu_kernels)
        self.dense_buffer: torch.Tensor | None = None  # where block weights expand for steps of many rows (shared)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, index: int,
                step: LayerStep) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This block (layer `index`) over the residual stream, `x` + `residual` (`residual` None: `x` alone),
        returned in the same form. The ops (engine/model/layer_ops.py) decide where each residual add runs: at
        once, inside the product, or in the next norm's kernel."""
        ops: LayerOps = EAGER_OPS if self.block_kernels is None else BLOCK_OPS
        if step.triton is not None:
            ops = step.triton
        qkv, residual = ops.norm_linear(self, x, residual, self.input_layernorm, self.qkv_proj)
        x, residual = ops.add_linear(self, ops.attend(self, qkv, index, step), self.o_proj, residual)
        gate_up, residual = ops.norm_linear(self, x, residual, self.post_attention_layernorm, self.gate_up_proj,
                                            gated=True)
        return ops.add_linear(self, gate_up, self.down_proj, residual, gated=True)

    def fuse_residual_adds(self) -> None:
        """Run both residual adds as binary post-ops of the o and down GEMMs (engine/model/ops.py), once
        their weights are prepacked: for float32 activations (a half-precision model rounds the GEMM's
        output before adding, as transformers does), one rank (a row-parallel output is all-reduced
        before the add) and no biases."""
        self.residual_in_gemm = (fuses_add(self.o_proj.weight) and fuses_add(self.down_proj.weight)
                                 and self.post_attention_layernorm.weight.dtype == torch.float32
                                 and self.o_proj.tp.size == 1 and self.o_proj.bias is None
                                 and self.down_proj.bias is None)


class CausalLM(nn.Module):
    """The model, or under tensor parallelism (`tp`) this rank's shard of it; `spec` stays the whole model's."""

    def __init__(self, spec: ModelSpec, tp: TensorParallel | None = None) -> None:
        super().__init__()
        tp = tp if tp is not None else TensorParallel()
        self.spec = spec
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, tp)
        # an nn.ModuleList (so the layers register as submodules), whose items torch's stubs type as plain Modules
        layers = nn.ModuleList(DecoderLayer(spec, tp) for _ in range(spec.num_layers))
        self.layers = cast(Sequence[DecoderLayer], layers)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, tp)
        self.cos_sin: torch.Tensor | None = None
        self.kernels: CpuKernels | None = None
        self.backend: AttentionBackend | None = None  # the backend the layers' path was chosen for
        self.triton: TritonOps | None = None  # the fused Triton kernels, on the Triton backend
        self._fused: tuple[KVPool, FusedLayers] | None = None  # the layers as one C call, for the pool it was built on
        self.one_call = True  # run the layers as one C call where `_fused_layers` can (off: layer by layer, as tested)

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank stores (its share of the KV pool's width)."""
        return self.layers[0].num_kv_heads

    def weight_targets(self) -> dict[str, WeightTarget]:
        """HF tensor name -> where this rank's slice of it goes. Fused projections take several."""
        s = self.spec
        targets: dict[str, WeightTarget] = {
            "model.embed_tokens.weight": self.embed_tokens.target(),
            "model.norm.weight": WeightTarget(self.norm.weight),
        }
        if not s.tie_word_embeddings:
            targets["lm_head.weight"] = self.lm_head.target()
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            targets[p + "input_layernorm.weight"] = WeightTarget(layer.input_layernorm.weight)
            targets[p + "post_attention_layernorm.weight"] = WeightTarget(layer.post_attention_layernorm.weight)
            for part, name in enumerate(("q_proj", "k_proj", "v_proj")):
                targets[p + f"self_attn.{name}.weight"] = layer.qkv_proj.target(part)
                if s.qkv_bias:
                    targets[p + f"self_attn.{name}.bias"] = layer.qkv_proj.target(part, bias=True)
            targets[p + "self_attn.o_proj.weight"] = layer.o_proj.target()
            if s.attention_bias:
                targets[p + "self_attn.o_proj.bias"] = layer.o_proj.target(bias=True)
            for name, norm in (("q_norm", layer.q_norm), ("k_norm", layer.k_norm)):
                if norm is not None:  # Qwen3's (spec.qk_norm)
                    targets[p + f"self_attn.{name}.weight"] = WeightTarget(norm.weight)
            for part, name in enumerate(("gate_proj", "up_proj")):
                targets[p + f"mlp.{name}.weight"] = layer.gate_up_proj.target(part)
                if s.mlp_bias:
                    targets[p + f"mlp.{name}.bias"] = layer.gate_up_proj.target(part, bias=True)
            targets[p + "mlp.down_proj.weight"] = layer.down_proj.target()
            if s.mlp_bias:
                targets[p + "mlp.down_proj.bias"] = layer.down_proj.target(bias=True)
        return targets

    @torch.no_grad()
    def load_weights(self, tensors: Iterable[tuple[str, Source]]) -> None:
        """Copy this rank's slice of each checkpoint tensor into place (ignoring ones we do not use);
        raise naming any missing. Lazy slices are read only where this rank's slice lies."""
        targets = self.weight_targets()
        loaded: set[str] = set()
        for name, tensor in tensors:
            if name in targets:
                load_into(targets[name], name, tensor)
                loaded.add(name)
        missing = set(targets) - loaded
        if missing:
            raise ValueError(f"checkpoint lacks weights: {', '.join(sorted(missing)[:8])}")
        finish_block_weights(self)
        self._finish_loading()

    def _finish_loading(self) -> None:
        """Tie the output head and build the RoPE table (cos, signed sin; see layer_ops.apply_rope) for every
        position."""
        if self.spec.tie_word_embeddings:
            weight = self.embed_tokens.weight
            if not isinstance(weight, nn.Parameter):  # block formats (engine/model/quantized.py)
                self.lm_head._parameters.pop("weight", None)
            self.lm_head.weight = weight
        device = self.norm.weight.device
        pos = torch.arange(self.spec.max_position_embeddings, dtype=torch.float, device=device)
        freqs = pos[:, None] * self.spec.inv_freq.to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        signed_sin = torch.cat((-sin[:, : freqs.shape[1]], sin[:, freqs.shape[1] :]), dim=-1)
        # in the model dtype, as transformers casts it before use (the cast commutes with indexing)
        self.cos_sin = (torch.stack((emb.cos(), signed_sin)) * self.spec.rope_scaling).to(self.norm.weight.dtype)

    def use_cpu_kernels(self, kernels: CpuKernels) -> None:
        """Run RMSNorm and RoPE through minichat's C kernels (kernels/cpu): one pass each instead of five
        and four eager ops, rounding where transformers rounds, so greedy output stays token-identical.
        A model whose GEMMs run in float32 (on one rank: a row-parallel down projection is summed across
        ranks before rounding) also gets the MLP activation in C: for float32 one pass that beat oneDNN's
        SiLU and multiply post-ops, for bf16 one pass that rounds where transformers' four ops round.
        A layer whose projections are all in block formats (one rank, float32) runs its norms, the activation
        and the residual adds inside the quantized products: four C calls a layer besides RoPE and attention
        (its output is approximate anyway: the products quantize their input)."""
        self.kernels = kernels
        dense: torch.Tensor | None = None
        activation = Scratch(self.norm.weight.device)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.kernels = kernels
        for layer in self.layers:
            if gemm_dtype(layer.gate_up_proj.weight) == torch.float32 and layer.down_proj.tp.size == 1:
                layer.mlp_kernels, layer.activation = kernels, activation
            projections = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
            if all(isinstance(p.weight, BlockMatrix) for p in projections) and layer.down_proj.tp.size == 1 and \
                    layer.input_layernorm.weight.dtype == torch.float32:
                layer.block_kernels = kernels
                if dense is None:
                    dense = torch.empty(DENSE_BUFFER, dtype=torch.float32, device=self.norm.weight.device)
                layer.dense_buffer = dense

    def use_attention_backend(self, backend: AttentionBackend) -> None:
        """Choose the layers' path for `backend`, once: on the Triton backend (the GPU path) the fused Triton
        kernels (`TritonOps`); on any other the eager ops or minichat's C kernels. The engine calls this once
        it has built its backend (after the model); `forward` calls it for a caller that did not."""
        self.backend = backend
        self.triton = TritonOps(cast("TritonBackend", backend)) if backend.name == "triton" else None

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_index: torch.Tensor,
                kv: KVPool, backend: AttentionBackend, meta: object) -> torch.Tensor | None:
        """Run the flat batch; returns float32 logits only for the rows in `logits_index`
        (under tensor parallelism on rank 0 only; other ranks get None)."""
        x = self.embed_tokens(input_ids).to(self.norm.weight.dtype)  # a tied embedding may be stored upcast
        if backend is not self.backend:
            self.use_attention_backend(backend)
        if self.cos_sin is None:
            raise RuntimeError("CausalLM.load_weights() must run before the first step")
        residual: torch.Tensor | None = None
        few_rows = isinstance(meta, PagedStep) and x.shape[0] < DENSE_ROWS  # many rows: torch's GEMM, per layer
        fused = self._fused_layers(kv) if few_rows and self.triton is None else None
        if fused is not None and isinstance(meta, PagedStep):  # every layer in one C call (decode.c), x in place
            x = x.contiguous()
            fused(x, positions, meta.table, meta.rows, meta.kv_lens, meta.out_locs)
        else:
            step = LayerStep(positions, kv, backend, meta, self.cos_sin, self.kernels, self.triton)
            for i, layer in enumerate(self.layers):
                x, residual = layer(x, residual, i, step)
        if logits_index.numel() != x.shape[0]:  # as many sampled rows as tokens: every row, in order
            x = x[logits_index]
            residual = None if residual is None else residual[logits_index]
        h, _ = (self.triton or EAGER_OPS).norm(x, residual, self.norm)
        logits = self.lm_head(h)
        return None if logits is None else logits.float()

    @property
    def runs_one_call(self) -> bool:
        """Whether steps the CPU attention kernel takes whole run every layer in one C call (`_fused_layers`)."""
        return self.one_call and all(layer.block_kernels is not None for layer in self.layers)

    def _fused_layers(self, kv: KVPool) -> FusedLayers | None:
        """The layers as one C call, for a model whose every layer runs its products in block formats
        (`DecoderLayer.block_kernels`) and steps the CPU attention kernel takes whole; built once per pool."""
        kernels = self.layers[0].block_kernels
        if not self.runs_one_call or kernels is None or self.cos_sin is None:
            return None
        if self._fused is None or self._fused[0] is not kv:
            from kernels.cpu.decode import FusedLayers, LayerWeights

            def projection(p: nn.Module) -> tuple[BlockMatrix, torch.Tensor | None]:
                return cast(BlockMatrix, p.weight), cast("torch.Tensor | None", p.bias)

            layers = [LayerWeights(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                None if layer.q_norm is None else layer.q_norm.weight,
                None if layer.k_norm is None else layer.k_norm.weight,
                projection(layer.qkv_proj), projection(layer.o_proj), projection(layer.gate_up_proj),
                projection(layer.down_proj), kv.k(i), kv.v(i)) for i, layer in enumerate(self.layers)]
            s = self.spec
            self._fused = (kv, FusedLayers(kernels, layers, self.layers[0].num_heads, self.num_kv_heads, s.head_dim,
                                           s.rms_norm_eps, self.cos_sin[0].contiguous(), self.cos_sin[1].contiguous()))
        return self._fused[1]
