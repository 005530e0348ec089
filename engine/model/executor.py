"""How a model's layers run a step: an executor chosen once, when the engine has built its attention backend
(`choose_executor`), which `CausalLM.forward` runs.

- `LayerByLayer` runs each layer's blocks on the kernels chosen for that layer (engine/model/layer_ops.py): Triton's
  fused kernels on the GPU path; minichat's block-format C products where every projection of a layer is in GGML
  blocks; else torch, with the C norms, RoPE and activation where the layer took them.
- `OneCall` runs every layer in one C call (kernels/cpu/decode.c) for a step the CPU attention kernel takes whole
  and of at most `most_rows` rows, and bigger steps through its `LayerByLayer`. It serves a model whose layers are
  all Llama-shaped (`DecoderLayer.in_one_call`) with their products in block formats, or whose float32 rows were
  kept for it (`CausalLM.keep_float_rows`).

Both compute the same products from the same C functions: the one call saves the interpreter, dispatch and thread
team starts between them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import torch

from engine.model.layer_ops import BlockOps, EagerOps, LayerKernels, LayerOps, LayerStep, Scratch, TritonOps
from kernels.attention.cpu import PagedStep

DENSE_BUFFER = 4 * 2**20
"""Float32 values a block-format model expands its weights into, a chunk of rows at a time, for steps of
DENSE_ROWS tokens or more (16 MiB: 1,024 rows of a 4,096-wide projection)."""

if TYPE_CHECKING:
    from engine.kv.pool import KVPool
    from engine.model.decoder import CausalLM, DecoderLayer
    from kernels.attention.base import AttentionBackend
    from kernels.attention.triton import TritonBackend
    from kernels.cpu import CpuKernels
    from kernels.cpu.decode import FusedLayers
    from kernels.quant import BlockMatrix


class Executor(Protocol):
    @property
    def final(self) -> LayerOps:
        """What runs the final norm (it adds the last residual where the layers leave it beside x)."""
        ...

    def run(self, model: CausalLM, x: torch.Tensor, positions: torch.Tensor, kv: KVPool, backend: AttentionBackend,
            meta: object) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every layer over the step's residual stream: `x` + the residual (None: `x` alone) after the last."""
        ...

    def describe(self) -> str:
        """How the layers run, for the engine's `execution` ("layers")."""
        ...

    def kernels(self) -> list[LayerKernels]:
        """What each layer runs on besides torch."""
        ...


@dataclass
class LayerByLayer:
    """Each layer on its own ops (`ops[i]`, over the kernels `chosen[i]`); `final` runs the final norm."""

    ops: list[LayerOps]
    chosen: list[LayerKernels]
    final: LayerOps
    note: str = ""  # why the one-call path does not run this model, where it might have

    def run(self, model: CausalLM, x: torch.Tensor, positions: torch.Tensor, kv: KVPool, backend: AttentionBackend,
            meta: object) -> tuple[torch.Tensor, torch.Tensor | None]:
        step = LayerStep(positions, kv, backend, meta, model.cos_sin, model.kernels)
        residual: torch.Tensor | None = None
        for i, (layer, ops) in enumerate(zip(model.layers, self.ops, strict=True)):
            x, residual = layer(ops, x, residual, i, step)
        return x, residual

    def describe(self) -> str:
        return "one call each" + self.note

    def kernels(self) -> list[LayerKernels]:
        return self.chosen


@dataclass
class OneCall:
    """Every layer in one C call for steps of at most `most_rows` rows that the CPU attention kernel takes whole,
    `layered` for the rest; the call is built once per KV pool (it holds the pool's pointers)."""

    cpu: CpuKernels
    most_rows: int
    layered: LayerByLayer
    built: tuple[KVPool, FusedLayers] | None = None

    @property
    def final(self) -> LayerOps:
        return self.layered.final

    def run(self, model: CausalLM, x: torch.Tensor, positions: torch.Tensor, kv: KVPool, backend: AttentionBackend,
            meta: object) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not isinstance(meta, PagedStep) or x.shape[0] > self.most_rows:
            return self.layered.run(model, x, positions, kv, backend, meta)
        if self.built is None or self.built[0] is not kv:
            self.built = (kv, _fused_layers(model, self.cpu, kv))
        x = x.contiguous()  # the call works on it in place
        self.built[1](x, positions, meta.table, meta.rows, meta.kv_lens, meta.out_locs)
        return x, None

    def describe(self) -> str:
        return "one C call a step"

    def kernels(self) -> list[LayerKernels]:
        return self.layered.chosen


def choose_executor(model: CausalLM, backend: AttentionBackend, one_call: bool = True) -> Executor:
    """The executor for `model` on `backend`: the one C call where it can run the model (and `one_call` allows it),
    else layer by layer, each layer on what it can take of minichat's C kernels (`DecoderLayer.kernels`)."""
    if backend.name == "triton":
        triton = TritonOps(cast("TritonBackend", backend))
        return LayerByLayer([triton] * len(model.layers), [LayerKernels()] * len(model.layers), triton)
    device = model.norm.weight.device
    blocks = any(layer.in_blocks() for layer in model.layers) and model.kernels is not None
    dense = torch.empty(DENSE_BUFFER if blocks else 0, dtype=torch.float32, device=device)
    scratch = Scratch(device)  # one buffer the layers take in turn
    chosen = [layer.kernels(model.kernels, scratch, dense) for layer in model.layers]
    ops: list[LayerOps] = [EagerOps(k) if k.blocks is None else BlockOps(k) for k in chosen]
    layered = LayerByLayer(ops, chosen, EagerOps(LayerKernels(norms=model.kernels)))
    in_blocks = all(k.blocks is not None for k in chosen)
    if not one_call:
        return layered
    if not all(layer.in_one_call for layer in model.layers):
        if in_blocks:
            layered.note = " (the one-call path runs Llama-shaped dense layers; this model's are not)"
        return layered
    if in_blocks and model.kernels is not None:
        dense_rows = model.kernels.dense_rows  # from there each layer expands its weights for torch's GEMM
        return OneCall(model.kernels, sys.maxsize if dense_rows is None else dense_rows - 1, layered)
    if model.float_rows is not None and model.kernels is not None:
        return OneCall(model.kernels, model.float_rows_most, layered)
    return layered


def _fused_layers(model: CausalLM, kernels: CpuKernels, kv: KVPool) -> FusedLayers:
    """The model's layers as kernels/cpu/decode.c runs them in one call, over the pool `kv`."""
    from kernels.cpu.decode import FusedLayers, LayerWeights

    def product(i: int, layer: DecoderLayer, j: int) -> tuple[BlockMatrix, torch.Tensor | None]:
        """The layer's j-th projection (projections() order) as decode.c multiplies by it, and its bias."""
        p = layer.projections()[j]
        weight = model.float_rows[i][j] if model.float_rows is not None else p.weight
        return cast("BlockMatrix", weight), cast("torch.Tensor | None", p.bias)

    tables = [(table[0].contiguous(), table[1].contiguous()) for table in model.cos_sin]
    layers = [LayerWeights(
        *layer.one_call_norms(), None if layer.q_norm is None else layer.q_norm.gain,
        None if layer.k_norm is None else layer.k_norm.gain, *layer.one_call_output_norms(),
        *tables[layer.rope_index], product(i, layer, 0), product(i, layer, 1), product(i, layer, 2),
        product(i, layer, 3), kv.k(i), kv.v(i), layer.window or 0)
        for i, layer in enumerate(model.layers)]
    first = model.layers[0]
    return FusedLayers(kernels, layers, first.num_heads, model.num_kv_heads, model.spec.head_dim,
                       model.spec.rms_norm_eps, first.scale, first.activation)
