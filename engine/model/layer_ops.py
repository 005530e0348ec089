"""How a decoder layer's pieces run: the blocks `DecoderLayer` (engine/model/decoder.py) and the families' layers
write, on three sets of kernels that differ only in what they fuse.

The block carries the residual stream as `x` + `residual` (`residual` None: `x` alone). `EagerOps` (torch, with
minichat's C norms, RoPE and activation where the layer has them, and oneDNN's add inside the GEMM) and `BlockOps`
(every projection in GGML block formats: the norms, the activation and the residual adds inside minichat's C
products) add each projection's output into the stream at once; `TritonOps` (the GPU path) leaves it beside the
stream for the next norm, which adds it in the same kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.nn.functional as F

from engine.kv.pool import KVPool
from engine.model.ops import linear, linear_add
from engine.model.parallel import ColumnParallelLinear, RowParallelLinear
from kernels.attention.base import AttentionBackend
from kernels.quant import BlockMatrix

if TYPE_CHECKING:
    from collections.abc import Callable

    from engine.model.decoder import DecoderLayer, RMSNorm
    from engine.model.moe import SparseMoE
    from kernels.attention.triton import TritonBackend, TritonStep
    from kernels.cpu import CpuKernels

    Rope = Callable[[torch.Tensor], torch.Tensor]
    """This step's rotary embedding, applied to [tokens, heads, head_dim] (possibly in place)."""


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' `x * cos + rotate_half(x) * sin`, with the half swap's sign folded into the table
    (`signed_sin` = [-sin, sin] by halves; negation is exact, so the products round the same), which
    leaves four passes over x instead of six."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def rope_in_place(kernels: CpuKernels, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                  signed_sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope` in one C pass, in place, over the full tables indexed by each token's position."""
    kernels.rope_(x, positions, cos, signed_sin)
    return x


@dataclass
class LayerStep:
    """What every layer of one forward reads besides the residual stream."""

    positions: torch.Tensor
    kv: KVPool
    backend: AttentionBackend
    meta: object  # the backend's prepared state for this step
    cos_sin: list[torch.Tensor]  # the RoPE tables of every position: cos, signed sin (see `apply_rope`)
    kernels: CpuKernels | None  # minichat's C kernels, for RoPE on the CPU
    ropes: dict[int, Rope] = field(default_factory=dict)

    def rope(self, table: int) -> Rope:
        """RoPE by table `table` over this step's positions, made once for all layers (the CPU ops'; Triton's
        rotates as it stores)."""
        if table not in self.ropes:
            cos_sin = self.cos_sin[table]
            if self.kernels is not None:
                self.ropes[table] = partial(rope_in_place, self.kernels, positions=self.positions, cos=cos_sin[0],
                                            signed_sin=cos_sin[1])
            else:
                rows = cos_sin[:, self.positions, None, :]
                self.ropes[table] = partial(apply_rope, cos=rows[0], signed_sin=rows[1])
        return self.ropes[table]


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


@dataclass(frozen=True)
class LayerKernels:
    """What one layer runs on besides torch, decided once when the executor is chosen (`DecoderLayer.kernels`) and
    held by the layer's ops, so that the layer itself stays a plain module of weights."""

    norms: CpuKernels | None = None  # its RMSNorms in one C pass (where the C kernel rounds as the norm does)
    activation: CpuKernels | None = None  # the C SiLU * up between float32 GEMMs (one rank)
    scratch: Scratch | None = None  # where that activation writes (one buffer shared by the layers)
    blocks: CpuKernels | None = None  # every projection in block formats: norms, activation, adds inside them
    dense: torch.Tensor | None = None  # where block weights expand for steps of many rows (shared)
    expert_blocks: CpuKernels | None = None  # every expert in block formats: SiLU * up inside the down product
    residual_in_gemm: bool = False  # both residual adds as oneDNN post-ops of the prepacked o and down GEMMs


NO_KERNELS = LayerKernels()


def activate(kernels: LayerKernels, activation: str, gate_up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The MLP's act(gate) * up of a [rows, 2 * inter] gate/up output, in `dtype`: SiLU (in one C pass into the
    layers' shared buffer, with the roundings of `dtype`, where the layer has the C activation) or GELU's tanh
    form (Gemma)."""
    if kernels.activation is not None and kernels.scratch is not None:
        return kernels.activation.silu_mul(gate_up, dtype, out=kernels.scratch.take(gate_up.shape[0],
                                                                                   gate_up.shape[1] // 2))
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    return F.silu(gate) * up


Projection = ColumnParallelLinear | RowParallelLinear


class LayerOps(Protocol):
    """The pieces of a block that a set of kernels fuses its own way."""

    def norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(x + residual), and the sum: the stream, the next add's residual."""
        ...

    def norm_linear(self, layer: DecoderLayer, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                    proj: Projection, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """proj(norm(x + residual)), and the sum. `gated`: `proj` is the MLP's gate/up, SiLU(gate) * up comes next."""
        ...

    def attend(self, layer: DecoderLayer, qkv: torch.Tensor, index: int, step: LayerStep) -> torch.Tensor:
        """Attention from the fused q/k/v projection's output: per-head norms (Qwen3), RoPE, the K/V store."""
        ...

    def add_linear(self, layer: DecoderLayer, x: torch.Tensor, proj: Projection, residual: torch.Tensor,
                   gated: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stream after adding proj(x) to `residual`, in the block's form. `gated`: x is [gate, up], and
        proj takes act(gate) * up."""
        ...

    def linear(self, layer: DecoderLayer, x: torch.Tensor, proj: Projection, gated: bool = False) -> torch.Tensor:
        """proj(x) in the model dtype, added to nothing (Gemma's post-norms come between). `gated` as above."""
        ...

    def experts(self, moe: SparseMoE, h: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for each row of h (engine/model/moe.py), this rank's part of it."""
        ...


class EagerOps:
    """torch's ops, with minichat's C kernels where the layer's `kernels` have them (the norms; SiLU * up between
    float32 GEMMs) and the residual adds inside oneDNN's GEMM where `residual_in_gemm`."""

    def __init__(self, kernels: LayerKernels = NO_KERNELS) -> None:
        self.kernels = kernels

    def normed(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """norm(x), through the C kernel for rows of a 2-D x where it rounds as `norm` does."""
        if self.kernels.norms is not None and x.dim() == 2 and norm.c_exact:
            return self.kernels.norms.rms_norm(x, norm.gain, norm.eps)
        return norm(x)

    def norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        stream = x if residual is None else residual + x
        return self.normed(norm, stream), stream

    def norm_linear(self, layer: DecoderLayer, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                    proj: Projection, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        h, stream = self.norm(x, residual, norm)
        if gated and self.kernels.activation is not None:  # float32 into the C activation, which rounds as
            return linear(h, proj.weight, proj.bias, torch.float32), stream  # transformers does
        return proj(h), stream

    def attend(self, layer: DecoderLayer, qkv: torch.Tensor, index: int, step: LayerStep) -> torch.Tensor:
        spec, tokens = layer.spec, qkv.shape[0]
        qk_size = layer.q_size + layer.kv_size
        v = qkv[:, qk_size:].view(tokens, layer.num_kv_heads, spec.head_dim)
        rope = step.rope(layer.rope_index)
        if layer.q_norm is None or layer.k_norm is None:  # no per-head norms: one RoPE pass over q and k heads
            qk = rope(qkv[:, :qk_size].view(tokens, -1, spec.head_dim))
            q, k = qk[:, : layer.num_heads], qk[:, layer.num_heads :]
        else:  # Qwen3 (and Gemma 3) normalise q and k per head, with separate weights, before RoPE
            rows = self._head_rows(tokens, spec.head_dim)
            q = self.normed(layer.q_norm, qkv[:, : layer.q_size].reshape(rows)).view(tokens, layer.num_heads,
                                                                                     spec.head_dim)
            k = self.normed(layer.k_norm, qkv[:, layer.q_size : qk_size].reshape(rows)).view(
                tokens, layer.num_kv_heads, spec.head_dim)
            q, k = rope(q), rope(k)
        out = step.backend.forward(q, k, v, step.kv.k(index), step.kv.v(index), step.meta, layer.scale,
                                   window=layer.window, softcap=layer.softcap)
        return out.reshape(tokens, layer.q_size)

    def _head_rows(self, tokens: int, head_dim: int) -> tuple[int, ...]:
        """The shape the per-head norms see q and k in: [tokens, heads, head_dim] (torch's RMSNorm)."""
        return (tokens, -1, head_dim)

    def add_linear(self, layer: DecoderLayer, x: torch.Tensor, proj: Projection, residual: torch.Tensor,
                   gated: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """residual + proj(x), rounded to the residual's dtype first (x may be a float32 activation of a bf16
        model); inside the GEMM where `residual_in_gemm` allows."""
        if gated:
            x = activate(self.kernels, layer.activation, x, residual.dtype)
        if self.kernels.residual_in_gemm:
            return linear_add(x, residual, proj.weight), None
        return residual + proj(x).to(residual.dtype), None

    def linear(self, layer: DecoderLayer, x: torch.Tensor, proj: Projection, gated: bool = False) -> torch.Tensor:
        return proj(activate(self.kernels, layer.activation, x, layer.dtype) if gated else x).to(layer.dtype)

    def experts(self, moe: SparseMoE, h: torch.Tensor) -> torch.Tensor:
        return moe.grouped(h, self.kernels)


class BlockOps(EagerOps):
    """A layer whose projections are all in block formats (`LayerKernels.blocks`, one rank, float32): the
    norms, SiLU * up and the residual adds run inside minichat's quantized products, four C calls a layer
    besides RoPE and attention."""

    def norm_linear(self, layer: DecoderLayer, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                    proj: Projection, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        stream = x if residual is None else residual + x
        out = self._blocks.q_linear(stream, cast(BlockMatrix, proj.weight), proj.bias,
                                            norm=(norm.gain, norm.eps), dense=self.kernels.dense)
        return out, stream

    def _head_rows(self, tokens: int, head_dim: int) -> tuple[int, ...]:
        """Heads as rows, which the C norm takes (as the one-call layers norm them)."""
        return (-1, head_dim)

    def add_linear(self, layer: DecoderLayer, x: torch.Tensor, proj: Projection, residual: torch.Tensor,
                   gated: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = self._blocks.q_linear(x, cast(BlockMatrix, proj.weight), proj.bias, add=residual,
                                            gated=layer.activation if gated else None, dense=self.kernels.dense)
        return out, None

    def linear(self, layer: DecoderLayer, x: torch.Tensor, proj: Projection, gated: bool = False) -> torch.Tensor:
        """Gemma's products whose output is normalised before it joins the stream: the activation inside the
        product too (the one-call layers compute the same)."""
        return self._blocks.q_linear(x, cast(BlockMatrix, proj.weight), proj.bias,
                                             gated=layer.activation if gated else None, dense=self.kernels.dense)

    @property
    def _blocks(self) -> CpuKernels:
        return cast("CpuKernels", self.kernels.blocks)  # chosen only for a layer that has them


class TritonOps:
    """The GPU path: the Triton attention backend and the fused Triton kernels around it (kernels/triton), which
    take the place of the eager norms, RoPE, KV store and activation: four launches a layer besides the GEMMs and
    attention. Made only when the model runs on that backend, since the engine imports without Triton."""

    def __init__(self, backend: TritonBackend) -> None:
        from kernels.triton.activation import gated_activation
        from kernels.triton.moe import fused_moe
        from kernels.triton.norm import add_rms_norm
        from kernels.triton.rope import rope_store_kv

        self.backend = backend
        self.add_rms_norm = add_rms_norm
        self.rope_store_kv = rope_store_kv
        self.gated_activation = gated_activation
        self.fused_moe = fused_moe

    def norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        return self.add_rms_norm(x, residual, norm.gain, norm.eps, round_normed=norm.rounds_normed)

    def norm_linear(self, layer: DecoderLayer, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                    proj: Projection, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        h, stream = self.norm(x, residual, norm)
        return proj(h), stream

    def attend(self, layer: DecoderLayer, qkv: torch.Tensor, index: int, step: LayerStep) -> torch.Tensor:
        """q/k norms, RoPE and the K/V store in one kernel; the backend attends without storing. int8 pages are
        stored by the backend instead, which quantizes as it stores."""
        state = cast("TritonStep", step.meta)
        k_cache, v_cache = step.kv.k(index), step.kv.v(index)
        int8 = k_cache.dtype == torch.int8
        q_norm, k_norm = layer.q_norm, layer.k_norm
        qk_norm = None if q_norm is None or k_norm is None else (q_norm.gain, k_norm.gain)
        q, k, v = self.rope_store_kv(qkv, layer.num_heads, layer.num_kv_heads, step.positions,
                                     step.cos_sin[layer.rope_index], None if int8 else k_cache,
                                     None if int8 else v_cache, state.meta.out_locs, qk_norm,
                                     layer.spec.rms_norm_eps, round_normed=q_norm is None or q_norm.rounds_normed)
        attend = self.backend.forward if int8 else self.backend.attend
        out = attend(q, k, v, k_cache, v_cache, state, layer.scale, window=layer.window, softcap=layer.softcap)
        return out.reshape(qkv.shape[0], layer.q_size)

    def add_linear(self, layer: DecoderLayer, x: torch.Tensor, proj: Projection, residual: torch.Tensor,
                   gated: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """proj(x) left beside the stream: the next norm adds it."""
        return self.linear(layer, x, proj, gated), residual

    def linear(self, layer: DecoderLayer, x: torch.Tensor, proj: Projection, gated: bool = False) -> torch.Tensor:
        return proj(self.gated_activation(x, layer.activation) if gated else x)

    def experts(self, moe: SparseMoE, h: torch.Tensor) -> torch.Tensor:
        """Every expert in one fused Triton launch per projection (tokens sorted by expert), where the experts'
        weights are float tensors; block-format experts go one by one."""
        stacked = moe.stacked()
        if stacked is None:
            return moe.grouped(h, NO_KERNELS)
        weights, experts = moe.route(h)
        return moe.finish(h, self.fused_moe(h, stacked[0], stacked[1], weights, experts, moe.activation),
                          NO_KERNELS)
