"""Mixture-of-experts layers: a router picks `top_k` of `num_experts` MLPs for each token, and only those run.

The router is transformers': softmax of the router's logits in float32, the top k, renormalised where the config
says (`norm_topk_prob`; Mixtral always). On the CPU (`SparseMoE.grouped`) the step's (token, expert) pairs are
sorted by expert, and each expert that got tokens runs one GEMM per projection over all of its tokens, on weights
prepacked for oneDNN like every other projection (or in GGML block formats, with SiLU * up inside the down
product); the outputs are weighted and added back in expert order, as transformers adds them. On the GPU the fused
Triton kernel (kernels/triton/moe.py) runs all experts in one launch per projection. Tensor parallelism splits every
expert's intermediate rows as the dense MLP's are split: each rank computes its part of every expert (and of a
shared expert), and one all-reduce sums the layer's output.

The families that use it (qwen_moe.py, mixtral.py) only name their tensors and read their configs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar, cast

import torch
from torch import nn

from engine.distributed import TensorParallel
from engine.model.decoder import (
    CausalLM,
    DecoderLayer,
    ModelSpec,
    Targets,
    column_targets,
    row_targets,
)
from engine.model.layer_ops import LayerKernels, LayerOps, Scratch, activate
from engine.model.ops import gemm_dtype, linear
from engine.model.parallel import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, Split
from kernels.quant import BlockMatrix

if TYPE_CHECKING:
    from kernels.cpu import CpuKernels


@dataclass
class MoESpec(ModelSpec):
    """A decoder whose `sparse` layers (all, unless the config keeps some dense) route each token to `top_k` of
    `num_experts` experts of `expert_size` intermediate rows; Qwen2-MoE adds a shared expert every token runs,
    gated by a sigmoid. `cast_weights`: the routing weights are rounded to the model dtype before they scale the
    experts' outputs (Qwen's routers; Mixtral's stay float32)."""

    num_experts: int = 0
    top_k: int = 0
    expert_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_size: int = 0
    sparse: tuple[bool, ...] = ()
    cast_weights: bool = True

    def describe(self) -> dict[str, str]:
        experts = f"{self.num_experts}, {self.top_k} per token ({self.expert_size} rows each)"
        if self.shared_expert_size:
            experts += f", and a shared expert of {self.shared_expert_size} rows"
        if not all(self.sparse):
            experts += f", on {sum(self.sparse)} of {self.num_layers} layers"
        return {**super().describe(), "experts": experts}


@dataclass(frozen=True)
class ExpertNames:
    """A family's names for its MoE tensors, under the layer's prefix."""

    block: str  # "mlp" (Qwen) or "block_sparse_moe" (Mixtral)
    router: str  # "gate"
    parts: tuple[str, str, str]  # gate, up, down: ("gate_proj", "up_proj", "down_proj") or ("w1", "w3", "w2")


class Expert(nn.Module):
    """One expert's MLP: gate/up (column-parallel) and down (row-parallel, summed across ranks by the layer)."""

    def __init__(self, hidden: int, inter: Split, tp: TensorParallel) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [inter, inter], False, tp)
        self.down_proj = RowParallelLinear(inter, hidden, False, tp)

    def targets(self, prefix: str, parts: tuple[str, str, str]) -> Targets:
        gate, up, down = parts
        return column_targets(prefix, self.gate_up_proj, (gate, up), False) | \
            row_targets(prefix, self.down_proj, down, False)

    def run(self, x: torch.Tensor, activation: str, kernels: LayerKernels) -> torch.Tensor:
        """This rank's part of down(act(gate(x)) * up(x)) for x [rows, hidden], in x's dtype, on the layer's
        `kernels`."""
        blocks = kernels.expert_blocks
        if blocks is not None:  # block formats: SiLU * up inside the down product (float32 model)
            gate_up = blocks.q_linear(x, cast(BlockMatrix, self.gate_up_proj.weight))
            return blocks.q_linear(gate_up, cast(BlockMatrix, self.down_proj.weight), gated="silu")
        gate_up = linear(x, self.gate_up_proj.weight, None, torch.float32 if kernels.activation else x.dtype)
        return linear(activate(kernels, activation, gate_up, x.dtype), self.down_proj.weight, None, x.dtype)


class SparseMoE(nn.Module):
    """The router, the experts and a shared expert (Qwen2-MoE), this rank's slice of each expert."""

    def __init__(self, spec: MoESpec, tp: TensorParallel, activation: str) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob, self.cast_weights = spec.top_k, spec.norm_topk_prob, spec.cast_weights
        self.tp = tp
        self.activation = activation
        self.gate = ReplicatedLinear(spec.hidden_size, spec.num_experts)
        inter = Split(spec.expert_size, 1, "expert intermediate size")
        self.experts = cast("list[Expert]", nn.ModuleList(Expert(spec.hidden_size, inter, tp)
                                                          for _ in range(spec.num_experts)))
        self.shared_expert: Expert | None = None
        self.shared_expert_gate: ReplicatedLinear | None = None
        if spec.shared_expert_size:
            shared = Split(spec.shared_expert_size, 1, "shared expert intermediate size")
            self.shared_expert = Expert(spec.hidden_size, shared, tp)
            self.shared_expert_gate = ReplicatedLinear(spec.hidden_size, 1)
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None

    def targets(self, prefix: str, names: ExpertNames) -> Targets:
        targets: Targets = {prefix + f"{names.router}.weight": (self.gate.target(),)}
        for e, expert in enumerate(self.experts):
            targets |= expert.targets(prefix + f"experts.{e}.", names.parts)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            targets |= self.shared_expert.targets(prefix + "shared_expert.", ("gate_proj", "up_proj", "down_proj"))
            targets[prefix + "shared_expert_gate.weight"] = (self.shared_expert_gate.target(),)
        return targets

    def all_experts(self) -> list[Expert]:
        return [*self.experts, *([self.shared_expert] if self.shared_expert is not None else [])]

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top-k routing weights and expert ids ([rows, top_k] each), as transformers' routers give them."""
        probs = torch.softmax(self.gate(h).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights.to(h.dtype) if self.cast_weights else weights), experts

    def grouped(self, h: torch.Tensor, kernels: LayerKernels) -> torch.Tensor:
        """The layer's MoE output for h [rows, hidden]: the rows sorted by expert, one GEMM per projection of each
        expert over its rows, weighted and added in expert order (transformers' order), all-reduced across ranks."""
        weights, experts = self.route(h)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        rows = order // self.top_k  # the token of each (token, expert) pair, sorted by expert
        pair_weights = weights.flatten()[order]
        out = torch.zeros_like(h)
        start = 0
        for expert, count in zip(self.experts, torch.bincount(flat, minlength=len(self.experts)).tolist(),
                                 strict=True):
            if count:
                index = rows[start : start + count]
                y = expert.run(h.index_select(0, index), self.activation, kernels)
                out.index_add_(0, index, (y * pair_weights[start : start + count, None]).to(out.dtype))
                start += count
        return self.finish(h, out, kernels)

    def finish(self, h: torch.Tensor, out: torch.Tensor, kernels: LayerKernels) -> torch.Tensor:
        """The routed experts' output plus the gated shared expert (Qwen2-MoE), summed across ranks."""
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert.run(h, self.activation,
                                                                                          kernels)
        return out if self.tp.size == 1 else self.tp.all_reduce(out)

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every routed expert's gate/up [E, 2 * inter, hidden] and down [E, hidden, inter] weights stacked, for the
        fused Triton kernel; the experts' own weights become views of the stacks (no second copy). None where they
        are not plain tensors (block formats run expert by expert)."""
        if self._stacked is None:
            weights = [(e.gate_up_proj.weight, e.down_proj.weight) for e in self.experts]
            if not all(isinstance(w, torch.Tensor) and not w.is_mkldnn for pair in weights for w in pair):
                return None
            w1 = torch.stack([cast(torch.Tensor, gate_up) for gate_up, _ in weights])
            w2 = torch.stack([cast(torch.Tensor, down) for _, down in weights])
            for e, expert in enumerate(self.experts):
                expert.gate_up_proj.weight = nn.Parameter(w1[e], requires_grad=False)
                expert.down_proj.weight = nn.Parameter(w2[e], requires_grad=False)
            self._stacked = (w1, w2)
        return self._stacked

    def execution(self, kernels: LayerKernels) -> str:
        """Where the experts run: the fused Triton kernel, or a GEMM per expert over its tokens, and on what."""
        if self._stacked is not None:
            return "fused Triton MoE kernel, tokens sorted by expert"
        weight = self.experts[0].down_proj.weight
        if isinstance(weight, BlockMatrix):
            how = f"{'+'.join(weight.formats)} blocks" + (", SiLU * up in the down product" if kernels.expert_blocks
                                                         else "")
        else:
            how = f"{gemm_dtype(weight)}".removeprefix("torch.") + (" prepacked" if weight.is_mkldnn else "")
        return f"grouped by expert, one GEMM per expert over its tokens ({how})"

    def in_blocks(self) -> bool:
        """Whether every expert (and the shared one) is in block formats."""
        return all(isinstance(p.weight, BlockMatrix) for e in self.all_experts() for p in (e.gate_up_proj, e.down_proj))


class MoELayer(DecoderLayer):
    """A block whose MLP is the routed experts; attention as in every decoder."""

    names: ClassVar[ExpertNames] = ExpertNames("mlp", "gate", ("gate_proj", "up_proj", "down_proj"))
    in_one_call = False  # decode.c's one-call layers run dense MLPs only

    def build_mlp(self, spec: ModelSpec, tp: TensorParallel) -> None:
        self.moe = SparseMoE(cast(MoESpec, spec), tp, self.activation)

    def mlp_block(self, ops: LayerOps, x: torch.Tensor,
                  residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The experts' output left beside the stream (the next norm adds it)."""
        h, stream = ops.norm(x, residual, self.post_attention_layernorm)
        return ops.experts(self.moe, h), stream

    def mlp_targets(self, prefix: str) -> Targets:
        return self.moe.targets(prefix + self.names.block + ".", self.names)

    def projections(self) -> list[ColumnParallelLinear | RowParallelLinear]:
        return [self.qkv_proj, self.o_proj, *(p for e in self.moe.all_experts() for p in (e.gate_up_proj, e.down_proj))]

    def residual_projections(self) -> list[RowParallelLinear]:
        return [self.o_proj]  # the experts' output is added by the next norm

    def mlp_in_float32(self) -> bool:
        return all(gemm_dtype(e.gate_up_proj.weight) == torch.float32 for e in self.moe.all_experts())

    def kernels(self, kernels: CpuKernels | None, scratch: Scratch, dense: torch.Tensor) -> LayerKernels:
        """The shared decoder's choice, and with every expert in block formats (float32, one rank, SiLU) the block
        kernels' fused SiLU * up for them."""
        experts = kernels is not None and self.tp.size == 1 and self.activation == "silu" and \
            self.dtype == torch.float32 and self.moe.in_blocks()
        return replace(super().kernels(kernels, scratch, dense), expert_blocks=kernels if experts else None)

    def execution(self, kernels: LayerKernels) -> dict[str, str]:
        return {"experts": self.moe.execution(kernels)}


class MoELM(CausalLM):
    """A decoder whose sparse layers are `moe_layer`s (a family sets its names there) and whose others are dense."""

    moe_layer: ClassVar[type[MoELayer]] = MoELayer

    def make_layer(self, spec: ModelSpec, index: int, tp: TensorParallel) -> DecoderLayer:
        return self.moe_layer(spec, index, tp) if cast(MoESpec, spec).sparse[index] else DecoderLayer(spec, index, tp)
