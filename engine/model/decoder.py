"""The shared decoder: every family minichat runs is this stack of blocks with a few parts changed.

A block is attention behind an RMSNorm, then an MLP behind another, each added into the residual stream (Llama's
shape). A family (engine/model/families.py lists them, one small module each) reads its config into a `ModelSpec`
and changes what differs: a norm, the MLP (experts instead of one MLP), where the norms sit, the checkpoint's tensor
names, a scaled embedding or capped logits. The model runs on a flat token axis (all requests of a step
concatenated) and reads/writes K/V through an attention backend over the paged pool.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import TensorParallel
from engine.kv.pool import KVPool
from engine.model.executor import Executor, OneCall, choose_executor
from engine.model.layer_ops import LayerKernels, LayerOps, LayerStep, Scratch
from engine.model.ops import fuses_add, gemm_dtype, linear
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
from kernels.quant import QTYPES, BlockMatrix, QType

if TYPE_CHECKING:  # transformers is imported only where a config is read, not by tensor-parallel workers
    from transformers import PretrainedConfig

    from kernels.cpu import CpuKernels

ROWS_ONE_CALL = 8
"""A float32 model keeping its projections' rows (`CausalLM.keep_float_rows`) runs steps of at most this many
rows in one C call, more through oneDNN layer by layer: the C call reads the weights again for every few rows,
oneDNN once, so past a few rows a model whose weights do not stay in the CPU's cache is better off in oneDNN
(measured: docs/benchmarks.md, "Rows per one C call")."""
ROWS_ONE_CALL_CACHED = 32
CACHED_ROWS_BYTES = 32 << 20
"""A model keeping at most CACHED_ROWS_BYTES of rows (they stay in cache as the C call reads them again) runs
steps of up to ROWS_ONE_CALL_CACHED rows in one C call: for such a model the GEMMs are a small part of a step and
the calls between them most of the rest (docs/benchmarks.md, "Rows per one C call")."""
FLOAT_ROWS_MAX_BYTES = 1 << 30
"""The rows a float32 model keeps a second copy of, at most (float32 or bfloat16, see `keep_float_rows`): a decode
step reads them at a higher rate in the one C call than oneDNN reads its packed weights for one row (SmolLM2-135M
as F32: 49.5 against 29 tok/s; docs/benchmarks.md), at the cost of that memory."""
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

Targets = dict[str, tuple[WeightTarget, ...]]
"""Checkpoint tensor name -> where this rank's slices of it go (a fused tensor feeds several parts)."""


@dataclass
class Rope:
    """One RoPE table's inverse frequencies and its cos/sin scale (most models have one; Gemma 3 a local and a
    global one)."""

    inv_freq: torch.Tensor
    scaling: float = 1.0


@dataclass
class ModelSpec:
    """A decoder's shape, as its family reads it from an HF config; a family with parts of its own subclasses it.

    `windows[i]`: layer i attends to the last `windows[i]` positions (None: to all of them); `layer_ropes[i]`: which
    of `ropes` rotates its q and k. `scale` multiplies q . k; `softcap` caps the scores (cap * tanh(s / cap))."""

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
    ropes: list[Rope]
    scale: float
    windows: tuple[int | None, ...]
    layer_ropes: tuple[int, ...]
    softcap: float | None = None

    @property
    def full_attention(self) -> bool:
        """Every layer attends to every position, scores uncapped (what every attention backend runs)."""
        return all(w is None for w in self.windows) and self.softcap is None

    @property
    def kv_window(self) -> int | None:
        """The window every layer attends within (None where a layer sees every position): no step reads a
        position older than that, so its page can go early (engine/scheduler: `Scheduler.kv_window`)."""
        if any(w is None for w in self.windows):
            return None
        return max(cast(tuple[int, ...], self.windows))

    def describe(self) -> dict[str, str]:
        """What the model is, in a few words each (the engine's info: the console, `minichat status`, /v1/models)."""
        windowed = [w for w in self.windows if w is not None]
        window = "none" if not windowed else (
            f"{windowed[0]} tokens on every layer" if len(windowed) == self.num_layers and len(set(windowed)) == 1
            else f"{max(windowed)} tokens on {len(windowed)} of {self.num_layers} layers (the others see everything)")
        return {"architecture": self.architecture, "layers": str(self.num_layers),
                "attention": f"{self.num_heads} heads, {self.num_kv_heads} KV heads of {self.head_dim}",
                "window": window}


def base_spec(config: PretrainedConfig, architecture: str) -> ModelSpec:
    """The spec as every family reads it (a family replaces what its config says otherwise, or extends it: its own
    spec class built from these fields, `vars(base_spec(...))`)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention_bias = bool(getattr(config, "attention_bias", False))
    windows = layer_windows(config)
    return ModelSpec(
        architecture=architecture,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        intermediate_size=config.intermediate_size,
        rms_norm_eps=config.rms_norm_eps,
        attention_bias=attention_bias,
        qkv_bias=attention_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        qk_norm=False,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        max_position_embeddings=config.max_position_embeddings,
        ropes=[rope_frequencies(config, head_dim)],
        scale=head_dim**-0.5,
        windows=windows,
        layer_ropes=(0,) * len(windows),
    )


def require_activation(config: PretrainedConfig, name: str = "silu", key: str = "hidden_act") -> None:
    """Refuse an MLP activation the family's kernels do not compute."""
    act = getattr(config, key, name)
    if act != name:
        raise ValueError(f"unsupported {key} {act!r}; this family runs {name}")


def layer_windows(config: PretrainedConfig) -> tuple[int | None, ...]:
    """Each layer's attention window as transformers applies it: where the config lists `layer_types`, the
    "sliding_attention" layers get `sliding_window`; otherwise every layer does when it is set (Mistral, Mixtral,
    Phi-3, Qwen3-MoE). A window as long as the context is none."""
    window = getattr(config, "sliding_window", None) or None
    if window is not None and window >= config.max_position_embeddings:
        window = None
    types = getattr(config, "layer_types", None)
    if types is None:
        return (window,) * config.num_hidden_layers
    return tuple(window if kind == "sliding_attention" else None for kind in types)


def rope_frequencies(config: PretrainedConfig, head_dim: int, layer_type: str | None = None) -> Rope:
    """Inverse frequencies and cos/sin scale, via transformers' own RoPE initialisers (`layer_type`: the table of
    one kind of layer, where the config keeps one per kind).

    Accepts transformers-5 `rope_parameters` and older top-level `rope_theta` / `rope_scaling`.
    """
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if layer_type is not None:
        params = dict(params[layer_type])
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"unsupported RoPE type {rope_type!r}; supported: {', '.join(STATIC_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial rotary embeddings (partial_rotary_factor {params['partial_rotary_factor']}) are not "
                         "implemented; minichat rotates whole heads")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return Rope(1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)))
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kwargs)
    return Rope(inv_freq.float(), float(scaling))


class RMSNorm(nn.Module):
    """Normalise in float32, scale in the model dtype: the same rounding as transformers.

    `F.rms_norm` is one fused pass on the CPU where the written-out formula is five; a float32 model
    folds the weight in too (a half-precision one must round before scaling, as transformers does)."""

    rounds_normed = True
    """Whether the normalised row is rounded to the model dtype before the weight scales it (Gemma's is not)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    @property
    def gain(self) -> torch.Tensor:
        """What multiplies the normalised row: the weight (Gemma's norm: 1 + weight)."""
        return self.weight

    @property
    def c_exact(self) -> bool:
        """Whether minichat's one-pass C norm (layer_ops.EagerOps.normed) computes the same numbers: it rounds where
        this norm rounds."""
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[-1],)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), shape, eps=self.eps).to(x.dtype)

    def finish_loading(self) -> None:
        """After the checkpoint's values are in (Gemma's norm folds its 1 + weight here)."""


def column_targets(prefix: str, proj: ColumnParallelLinear, names: Sequence[str], bias: bool) -> Targets:
    """A fused column-parallel projection's parts, part i the checkpoint tensor `prefix + names[i]` (and its bias)."""
    targets: Targets = {}
    for part, name in enumerate(names):
        targets[f"{prefix}{name}.weight"] = (proj.target(part),)
        if bias:
            targets[f"{prefix}{name}.bias"] = (proj.target(part, bias=True),)
    return targets


def row_targets(prefix: str, proj: RowParallelLinear, name: str, bias: bool) -> Targets:
    """A row-parallel projection's checkpoint tensor `prefix + name` (and its bias)."""
    targets: Targets = {f"{prefix}{name}.weight": (proj.target(),)}
    if bias:
        targets[f"{prefix}{name}.bias"] = (proj.target(bias=True),)
    return targets


class DecoderLayer(nn.Module):
    """One block (layer `index`); under tensor parallelism it holds this rank's heads and intermediate rows only.

    Its halves are `attention_block` and `mlp_block`, each taking and returning the residual stream as
    `x` + `residual` (`residual` None: `x` alone); a family changes one by overriding it, and names its checkpoint
    tensors in `targets`."""

    norm_class: ClassVar[type[RMSNorm]] = RMSNorm
    activation: ClassVar[str] = "silu"
    """The MLP's activation of gate, multiplied by up: "silu" or "gelu_tanh" (layer_ops.activate)."""
    in_one_call: bool = True
    """Whether kernels/cpu/decode.c's one-call layers compute this layer (Llama's shape, or Gemma 3's)."""

    def __init__(self, spec: ModelSpec, index: int, tp: TensorParallel) -> None:
        super().__init__()
        self.spec = spec
        heads = Split(spec.num_heads, spec.head_dim, "attention heads")
        kv_heads = Split(spec.num_kv_heads, spec.head_dim, "KV heads", replicate=True)
        self.input_layernorm = self.norm_class(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = self.norm_class(spec.hidden_size, spec.rms_norm_eps)
        self.qkv_proj = ColumnParallelLinear(spec.hidden_size, [heads, kv_heads, kv_heads], spec.qkv_bias, tp)
        self.q_size, self.kv_size = self.qkv_proj.sizes[:2]
        self.num_heads, self.num_kv_heads = self.q_size // spec.head_dim, self.kv_size // spec.head_dim
        self.o_proj = RowParallelLinear(heads, spec.hidden_size, spec.attention_bias, tp)
        self.q_norm = self.norm_class(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = self.norm_class(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.scale, self.window, self.softcap = spec.scale, spec.windows[index], spec.softcap
        self.rope_index = spec.layer_ropes[index]
        self.tp = tp
        self.build_mlp(spec, tp)

    def build_mlp(self, spec: ModelSpec, tp: TensorParallel) -> None:
        """The dense MLP: one fused gate/up projection and the down projection."""
        inter = Split(spec.intermediate_size, 1, "intermediate size")
        self.gate_up_proj = ColumnParallelLinear(spec.hidden_size, [inter, inter], spec.mlp_bias, tp)
        self.down_proj = RowParallelLinear(inter, spec.hidden_size, spec.mlp_bias, tp)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the model's)."""
        return self.input_layernorm.weight.dtype

    def forward(self, ops: LayerOps, x: torch.Tensor, residual: torch.Tensor | None, index: int,
                step: LayerStep) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This block (layer `index`) over the residual stream, in and out as `x` + `residual`, on the kernels the
        executor chose for it (engine/model/executor.py). The ops decide where each residual add runs: at once,
        inside the product, or in the next norm's kernel."""
        x, res = self.attention_block(ops, x, residual, index, step)
        return self.mlp_block(ops, x, res)

    def attention_block(self, ops: LayerOps, x: torch.Tensor, residual: torch.Tensor | None, index: int,
                        step: LayerStep) -> tuple[torch.Tensor, torch.Tensor | None]:
        qkv, stream = ops.norm_linear(self, x, residual, self.input_layernorm, self.qkv_proj)
        return ops.add_linear(self, ops.attend(self, qkv, index, step), self.o_proj, stream)

    def mlp_block(self, ops: LayerOps, x: torch.Tensor,
                  residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        gate_up, stream = ops.norm_linear(self, x, residual, self.post_attention_layernorm, self.gate_up_proj,
                                          gated=True)
        return ops.add_linear(self, gate_up, self.down_proj, stream, gated=True)

    def targets(self, prefix: str) -> Targets:
        """This layer's checkpoint tensors (under `prefix`, "model.layers.{i}.") and where each goes."""
        targets = {prefix + name + ".weight": (WeightTarget(norm.weight),) for name, norm in self.norms().items()}
        return targets | self.attention_targets(prefix + "self_attn.") | self.mlp_targets(prefix)

    def attention_targets(self, prefix: str) -> Targets:
        return column_targets(prefix, self.qkv_proj, ("q_proj", "k_proj", "v_proj"), self.spec.qkv_bias) | \
            row_targets(prefix, self.o_proj, "o_proj", self.spec.attention_bias)

    def norms(self) -> dict[str, RMSNorm]:
        """The layer's norms by checkpoint name (under the layer's prefix)."""
        norms = {"input_layernorm": self.input_layernorm, "post_attention_layernorm": self.post_attention_layernorm}
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3's and Gemma 3's per-head q/k norms
            norms |= {"self_attn.q_norm": self.q_norm, "self_attn.k_norm": self.k_norm}
        return norms

    def one_call_norms(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The gains of the norms before attention and before the MLP, for decode.c."""
        return self.input_layernorm.gain, self.post_attention_layernorm.gain

    def one_call_output_norms(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The gains of the norms of attention's and the MLP's outputs before they join the stream (Gemma's)."""
        return None, None

    def mlp_targets(self, prefix: str) -> Targets:
        """The MLP's tensors, under the layer's prefix."""
        bias = self.spec.mlp_bias
        return column_targets(prefix + "mlp.", self.gate_up_proj, ("gate_proj", "up_proj"), bias) | \
            row_targets(prefix + "mlp.", self.down_proj, "down_proj", bias)

    def projections(self) -> list[ColumnParallelLinear | RowParallelLinear]:
        """The products a step of this layer runs (all in block formats: the block kernels take the layer)."""
        return [self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj]

    def residual_projections(self) -> list[RowParallelLinear]:
        """The projections whose output `add_linear` adds into the stream (the MoE layer's are attention's only)."""
        return [self.o_proj, self.down_proj]

    def in_blocks(self) -> bool:
        """Whether every projection is in block formats with float32 activations on one rank: the block kernels
        then run the layer, its norms, activation and residual adds inside the products."""
        return self.tp.size == 1 and self.dtype == torch.float32 and \
            all(isinstance(p.weight, BlockMatrix) for p in self.projections())

    def mlp_in_float32(self) -> bool:
        """Whether the MLP's GEMMs compute in float32 (the C activation between them then rounds as transformers)."""
        return gemm_dtype(self.gate_up_proj.weight) == torch.float32

    def kernels(self, kernels: CpuKernels | None, scratch: Scratch, dense: torch.Tensor) -> LayerKernels:
        """What this layer runs on besides torch (engine/model/executor.py chooses it once): with minichat's C
        `kernels`, its norms; on one rank the MLP's SiLU * up between float32 GEMMs (into `scratch`); where
        `in_blocks`, the block kernels (expanding weights into `dense` for steps of many rows). Without them too,
        the residual adds as binary post-ops of the o and down GEMMs once their weights are prepacked: for float32
        activations (a half-precision model rounds the GEMM's output before adding, as transformers does), one
        rank (a row-parallel output is all-reduced before the add) and no biases."""
        adds = self.residual_projections()
        in_gemm = bool(adds) and all(fuses_add(p.weight) and p.bias is None for p in adds) \
            and self.dtype == torch.float32 and self.tp.size == 1
        if kernels is None:
            return LayerKernels(residual_in_gemm=in_gemm)
        activation = self.tp.size == 1 and self.activation == "silu" and self.mlp_in_float32()
        blocks = self.in_blocks()
        return LayerKernels(norms=kernels, activation=kernels if activation else None, scratch=scratch,
                            blocks=kernels if blocks else None, dense=dense if blocks else None,
                            residual_in_gemm=in_gemm)

    def execution(self, kernels: LayerKernels) -> dict[str, str]:
        """What this layer runs otherwise than the shared decoder's kernels would, for the engine's `execution`."""
        return {}


class CausalLM(nn.Module):
    """The model, or under tensor parallelism (`tp`) this rank's shard of it; `spec` stays the whole model's.
    A family subclasses it to build its own layers (`make_layer`) or to change the embedding or the logits."""

    layer_class: ClassVar[type[DecoderLayer]] = DecoderLayer

    def __init__(self, spec: ModelSpec, tp: TensorParallel | None = None) -> None:
        super().__init__()
        tp = tp if tp is not None else TensorParallel()
        self.spec = spec
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, tp)
        # an nn.ModuleList (so the layers register as submodules), whose items torch's stubs type as plain Modules
        layers = nn.ModuleList(self.make_layer(spec, i, tp) for i in range(spec.num_layers))
        self.layers = cast(Sequence[DecoderLayer], layers)
        self.norm = self.layer_class.norm_class(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, tp)
        self.cos_sin: list[torch.Tensor] = []  # a RoPE table per `spec.ropes`: cos, signed sin (layer_ops.apply_rope)
        self.kernels: CpuKernels | None = None
        self.backend: AttentionBackend | None = None  # the backend the executor was chosen for
        self.executor: Executor | None = None  # how the layers run a step (engine/model/executor.py)
        self.float_rows: list[list[BlockMatrix]] | None = None  # per layer, its projections' rows (keep_float_rows)
        self.float_rows_most = ROWS_ONE_CALL  # the most rows a step runs in one C call on them
        self.head_rows: BlockMatrix | None = None  # the output head's bfloat16 rows, kept with bfloat16 float_rows

    def make_layer(self, spec: ModelSpec, index: int, tp: TensorParallel) -> DecoderLayer:
        return self.layer_class(spec, index, tp)

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank stores (its share of the KV pool's width)."""
        return self.layers[0].num_kv_heads

    def weight_targets(self) -> Targets:
        """HF tensor name -> where this rank's slices of it go."""
        targets: Targets = {
            "model.embed_tokens.weight": (self.embed_tokens.target(),),
            "model.norm.weight": (WeightTarget(self.norm.weight),),
        }
        if not self.spec.tie_word_embeddings:
            targets["lm_head.weight"] = (self.lm_head.target(),)
        for i, layer in enumerate(self.layers):
            targets |= layer.targets(f"model.layers.{i}.")
        return targets

    @torch.no_grad()
    def load_weights(self, tensors: Iterable[tuple[str, Source]]) -> None:
        """Copy this rank's slice of each checkpoint tensor into place (ignoring ones we do not use);
        raise naming any missing. Lazy slices are read only where this rank's slice lies."""
        targets = self.weight_targets()
        loaded: set[str] = set()
        for name, tensor in tensors:
            for target in targets.get(name, ()):
                load_into(target, name, tensor)
            if name in targets:
                loaded.add(name)
        missing = set(targets) - loaded
        if missing:
            raise ValueError(f"checkpoint lacks weights: {', '.join(sorted(missing)[:8])}")
        finish_block_weights(self)
        self._finish_loading()

    def _finish_loading(self) -> None:
        """Tie the output head, let the norms finish, and build the RoPE tables (cos, signed sin; see
        layer_ops.apply_rope) for every position."""
        if self.spec.tie_word_embeddings:
            weight = self.embed_tokens.weight
            if not isinstance(weight, nn.Parameter):  # block formats (engine/model/quantized.py)
                self.lm_head._parameters.pop("weight", None)
            self.lm_head.weight = weight
        dtype = self.norm.weight.dtype
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.finish_loading()
        device = self.norm.weight.device
        pos = torch.arange(self.spec.max_position_embeddings, dtype=torch.float, device=device)
        self.cos_sin = []
        for rope in self.spec.ropes:
            freqs = pos[:, None] * rope.inv_freq.to(device)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            sin = emb.sin()
            signed_sin = torch.cat((-sin[:, : freqs.shape[1]], sin[:, freqs.shape[1] :]), dim=-1)
            # in the model dtype, as transformers casts it before use (the cast commutes with indexing)
            self.cos_sin.append((torch.stack((emb.cos(), signed_sin)) * rope.scaling).to(dtype))

    def use_cpu_kernels(self, kernels: CpuKernels) -> None:
        """Run on minichat's C kernels (kernels/cpu) where each layer can (`DecoderLayer.kernels`, taken when the
        executor is chosen): RMSNorm and RoPE in one pass each instead of five and four eager ops, rounding where
        transformers rounds, so greedy output stays token-identical. A model whose GEMMs run in float32 (on one
        rank: a row-parallel down projection is summed across ranks before rounding) also gets the MLP activation in
        C: for float32 one pass that beat oneDNN's SiLU and multiply post-ops, for bf16 one pass that rounds where
        transformers' four ops round. A layer whose projections are all in block formats (one rank, float32) runs
        its norms, the activation and the residual adds inside the quantized products: four C calls a layer
        besides RoPE and attention (its output is approximate anyway: the products quantize their input)."""
        self.kernels = kernels

    def use_attention_backend(self, backend: AttentionBackend, one_call: bool = True) -> None:
        """Choose how the layers run on `backend`, once (engine/model/executor.py): on the Triton backend (the GPU
        path) the fused Triton kernels; on any other every layer in one C call where the model allows it and
        `one_call` does, else layer by layer on the eager ops or minichat's C kernels. The engine calls this once
        its backend is built (after the model took its kernels); `forward` calls it for a caller that did not."""
        self.backend = backend
        self.executor = choose_executor(self, backend, one_call)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of the step's tokens, in the model dtype (a tied embedding may be stored upcast)."""
        return self.embed_tokens(input_ids).to(self.norm.weight.dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits of the final hidden states (None on tensor-parallel ranks other than 0)."""
        logits = self.head(h)
        return None if logits is None else logits.float()

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_index: torch.Tensor,
                kv: KVPool, backend: AttentionBackend, meta: object) -> torch.Tensor | None:
        """Run the flat batch; returns float32 logits only for the rows in `logits_index`
        (under tensor parallelism on rank 0 only; other ranks get None)."""
        x = self.embed(input_ids)
        if backend is not self.backend:
            self.use_attention_backend(backend)
        if not self.cos_sin:
            raise RuntimeError("CausalLM.load_weights() must run before the first step")
        assert self.executor is not None
        x, residual = self.executor.run(self, x, positions, kv, backend, meta)
        if logits_index.numel() != x.shape[0]:  # as many sampled rows as tokens: every row, in order
            x = x[logits_index]
            residual = None if residual is None else residual[logits_index]
        h, _ = self.executor.final.norm(x, residual, self.norm)
        return self.logits(h)

    def execution(self) -> dict[str, str]:
        """How this model's layers run here, beyond the engine's options (LLM.execution): `layers`, and what a
        family's layers run otherwise than the shared decoder's (`DecoderLayer.execution`)."""
        layers = self.executor.describe() if self.executor is not None else "not chosen yet"
        if isinstance(self.executor, OneCall) and self.float_rows is not None:
            kept = "bfloat16" if self.float_rows[0][0].formats == ["BF16"] else "float32"
            layers = f"one C call a step of up to {self.executor.most_rows} rows ({kept} rows kept), oneDNN layer " \
                "by layer above"
        entries = {"layers": layers}
        for layer, kernels in zip(self.layers, self.executor.kernels() if self.executor else [], strict=False):
            entries |= layer.execution(kernels)
        return entries

    def keep_float_rows(self, kernels: CpuKernels) -> None:
        """For a float32 model on one rank, its layers Llama-shaped, before its weights are prepacked: each
        projection's rows copied as a block matrix of float panels, which decode.c multiplies by (quant.c), so that a
        step of few rows runs every layer in one C call instead of some ten calls a layer, each paying the
        interpreter, a oneDNN dispatch and an OpenMP team's start and join (see ROWS_ONE_CALL); bigger steps keep
        oneDNN's GEMMs. Weights whose every value is a bfloat16 (a bf16 checkpoint, upcast) are kept as bfloat16
        rows, widened as the kernel reads them: the same float32 products at half the bytes a step reads, which is
        what bounds a decode step. The output head's rows too, where they fit the budget: its product for few rows
        reads panels at about 37 GB/s where oneDNN read its weight at 28 (SmolLM2-135M's 113 MB float32 head, AMD
        EPYC Zen 4, 2 threads). Up to FLOAT_ROWS_MAX_BYTES of rows; the same float32 numbers, summed in another
        order."""
        weights = [[p.weight for p in layer.projections()] for layer in self.layers]
        flat = [w for ws in weights for w in ws]
        if not all(layer.in_one_call and layer.tp.size == 1 for layer in self.layers) or not all(
                isinstance(w, torch.Tensor) and w.dtype == torch.float32 and not w.is_mkldnn for w in flat):
            return
        tensors = cast(list[torch.Tensor], flat)
        qtype = QTYPES["BF16" if all(_bf16_exact(w) for w in tensors) else "F32"]
        size = sum(w.numel() * qtype.block_bytes for w in tensors)
        if size > FLOAT_ROWS_MAX_BYTES:
            return
        self.float_rows_most = ROWS_ONE_CALL_CACHED if size <= CACHED_ROWS_BYTES else ROWS_ONE_CALL
        self.float_rows = [[_float_panels(kernels, w, qtype) for w in cast(list[torch.Tensor], ws)] for ws in weights]
        head = self.lm_head.weight
        if isinstance(head, torch.Tensor) and head.dtype == torch.float32 and not head.is_mkldnn and \
                (qtype.name == "F32" or _bf16_exact(head)) and size + head.numel() * qtype.block_bytes <= \
                FLOAT_ROWS_MAX_BYTES:
            self.head_rows = _float_panels(kernels, head, qtype)

    def head(self, h: torch.Tensor) -> torch.Tensor | None:
        """The output head's product: through its kept rows for a step of few rows (`keep_float_rows`),
        else the head's own GEMM (None on tensor-parallel ranks other than 0)."""
        if self.head_rows is not None and h.shape[0] <= self.float_rows_most:
            return linear(h, self.head_rows)
        return self.lm_head(h)


def _bf16_exact(w: torch.Tensor) -> bool:
    """Whether every value of the float32 `w` is a bfloat16 (its low 16 bits zero), as an upcast bf16 weight's are."""
    return not bool((w.contiguous().view(torch.int32) & 0xFFFF).any())


def _float_panels(kernels: CpuKernels, w: torch.Tensor, qtype: QType) -> BlockMatrix:
    """A copy of the float32 weight [out, in] as one segment of `qtype` (F32 or BF16, exact there) in the kernels'
    panels of 8 rows."""
    rows = w.detach().to(torch.bfloat16 if qtype.name == "BF16" else torch.float32).contiguous()
    return BlockMatrix(w.shape[1], [kernels.repack(rows.view(torch.uint8), qtype, w.shape[1])])
