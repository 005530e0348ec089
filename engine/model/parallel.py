"""Tensor-parallel layers: each rank holds a slice of every weight, and collectives make the slices add up.

Megatron's split, as vLLM and SGLang use it: the projections into attention heads and into the MLP
are column-parallel (each rank computes its own heads / its own intermediate rows, no communication),
the projections back to the hidden size are row-parallel (each rank's partial product, all-reduced),
the embedding and the output head are split over the vocabulary. A fused projection (q/k/v, gate/up)
is sharded part by part and then fused per rank, so a rank's qkv rows are its q heads, then its KV
heads. Each layer also says which slice of each checkpoint tensor it needs (`WeightTarget`), so the
loader reads only that slice and stays generic. With one rank, every layer is its plain counterpart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from engine.distributed import TensorParallel
from engine.model.ops import can_prepack, embedding, linear, prepack
from engine.model.quantized import BlockSource, BlockWeightBuilder


@dataclass(frozen=True)
class Split:
    """A dimension of `units` equal units of `unit_size` (heads x head_dim, or single rows), split over ranks.

    Each rank takes `units / size` consecutive units. With `replicate` (KV heads), fewer units than
    ranks are copied instead, `size / units` ranks sharing each, as vLLM does.
    """

    units: int
    unit_size: int
    what: str
    replicate: bool = False

    @property
    def full(self) -> int:
        return self.units * self.unit_size

    def local(self, tp: TensorParallel) -> tuple[int, int]:
        """(first row, number of rows) this rank owns."""
        n = tp.size
        if self.units % n == 0:
            per = self.units // n
            return tp.rank * per * self.unit_size, per * self.unit_size
        if self.replicate and n % self.units == 0:
            return tp.rank // (n // self.units) * self.unit_size, self.unit_size
        hint = f", nor is {n} a multiple of it" if self.replicate else ""
        raise ValueError(f"tensor_parallel_size {n} does not divide the model's {self.what} ({self.units}{hint}); "
                         f"choose a tensor-parallel size that does")


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes on this rank.

    The checkpoint tensor (whose dimension `dim` must be `full` long, when given) is cut to
    `[start, start + size)` along `dim` (None: kept whole), and the cut fills rows `[row, ...)` of `param`
    (a weight kept in block formats collects its parts in a builder instead).
    """

    param: torch.Tensor | BlockWeightBuilder
    row: int = 0
    dim: int = 0
    start: int = 0
    size: int | None = None
    full: int | None = None


class TensorSlice(Protocol):
    """A lazy safetensors slice, read only where indexed (the loader hands over these, or torch tensors)."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor: ...


Source = torch.Tensor | TensorSlice | BlockSource
"""A checkpoint tensor as a loader yields it."""


def shape_of(source: Source) -> tuple[int, ...]:
    if isinstance(source, (torch.Tensor, BlockSource)):
        return tuple(source.shape)
    return tuple(source.get_shape())


@torch.no_grad()
def load_into(target: WeightTarget, name: str, source: Source) -> None:
    """Copy this rank's slice of checkpoint tensor `name` into place, or raise saying why it does not fit. A
    block-format tensor goes to its weight's builder as it is, or is dequantized where the weight is float."""
    shape = shape_of(source)
    if target.full is not None and len(shape) > target.dim and shape[target.dim] != target.full:
        raise ValueError(f"weight {name} has shape {shape}, which does not fit the config")
    cut: torch.Tensor | BlockSource
    if target.size is not None and len(shape) > target.dim:
        if isinstance(source, BlockSource):
            cut = source.cut(target.dim, target.start, target.size)
        else:
            cut = source[(slice(None),) * target.dim + (slice(target.start, target.start + target.size),)]
    else:
        cut = source if isinstance(source, (torch.Tensor, BlockSource)) else source[(slice(None),)]
    if isinstance(target.param, BlockWeightBuilder):
        target.param.put(target.row, name, cut)
        return
    if isinstance(cut, BlockSource):
        cut = cut.dequantize()
    param = target.param
    if cut.dim() != param.dim() or list(cut.shape[1:]) != list(param.shape[1:]) or \
            target.row + cut.shape[0] > param.shape[0]:
        raise ValueError(f"weight {name} has shape {shape}, which does not fit the config")
    param[target.row : target.row + cut.shape[0]].copy_(cut)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b for this rank's output rows; `parts` are fused checkpoint tensors, each split on its own."""

    def __init__(self, in_features: int, parts: Sequence[Split], bias: bool, tp: TensorParallel) -> None:
        super().__init__()
        self.parts = list(parts)
        self.shards = [p.local(tp) for p in parts]
        self.sizes = [size for _, size in self.shards]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(parts))]
        self.weight = nn.Parameter(torch.empty(sum(self.sizes), in_features))
        self.bias = nn.Parameter(torch.empty(sum(self.sizes))) if bias else None

    def target(self, part: int, bias: bool = False, fused: bool = False) -> WeightTarget:
        """Where this rank's rows of part `part` go: from that part's own checkpoint tensor, or (`fused`) from
        one tensor holding every part in order (Phi-3's qkv_proj and gate_up_proj), split here at load."""
        start, size = self.shards[part]
        param = self.bias if bias else self.weight
        assert param is not None  # a bias is asked for only where the config gave the layer one
        if fused:
            before = sum(p.full for p in self.parts[:part])
            return WeightTarget(param, row=self.offsets[part], start=before + start, size=size,
                                full=sum(p.full for p in self.parts))
        return WeightTarget(param, row=self.offsets[part], start=start, size=size, full=self.parts[part].full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_rank W_rank^T, then + b (added once): input columns split by `split`."""

    def __init__(self, split: Split, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.split = split
        self.start, size = split.local(tp)
        self.weight = nn.Parameter(torch.empty(out_features, size))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def target(self, bias: bool = False) -> WeightTarget:
        if bias:
            assert self.bias is not None  # asked for only where the config gave the layer one
            return WeightTarget(self.bias)
        return WeightTarget(self.weight, dim=1, start=self.start, size=self.weight.shape[1], full=self.split.full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return linear(x, self.weight, self.bias)
        y = self.tp.all_reduce(linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class ReplicatedLinear(nn.Module):
    """y = x W^T, the whole weight on every rank: a mixture-of-experts router, whose scores every rank needs whole
    to pick the same experts."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias: torch.Tensor | None = None

    def target(self) -> WeightTarget:
        return WeightTarget(self.weight, full=self.weight.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class VocabParallel(nn.Module):
    """A [vocab, hidden] weight of which each rank holds a range of the vocabulary's rows."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.split = Split(vocab_size, 1, "vocabulary size")
        self.start, size = self.split.local(tp)
        self.weight = nn.Parameter(torch.empty(size, hidden_size))

    def target(self) -> WeightTarget:
        return WeightTarget(self.weight, start=self.start, size=self.weight.shape[0], full=self.split.full)


class VocabParallelEmbedding(VocabParallel):
    """Each rank holds a range of the vocabulary; a token outside it looks up zeros, and the all-reduce
    leaves every rank with the one rank's row (adding zeros is exact)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.start + self.weight.shape[0])
        x = embedding((ids - self.start).masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside[:, None], 0))


class ParallelLMHead(VocabParallel):
    """Logits for this rank's vocabulary range, gathered on rank 0 (other ranks get None)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        return self.tp.gather_last_dim(linear(x, self.weight))


QUANTIZABLE = (ColumnParallelLinear, RowParallelLinear, VocabParallel)
"""The layers whose weight may be kept in block formats (engine/model/quantized.py); a router stays float (an
expert's choice should not move with its rounding, as llama.cpp's quantizer keeps ffn_gate_inp in F32)."""
PROJECTIONS = (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear, ParallelLMHead)
"""The layers whose weight a GEMM reads: stored in the linear dtype and prepacked for oneDNN."""


@torch.no_grad()
def set_linear_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Store every projection's weight and bias in `dtype` (see engine/model/ops.py for why).

    A tied embedding shares the output head's weight, so it is stored in `dtype` too; the model
    casts its lookups back to the activation dtype (exact, since the values came from there).
    """
    for module in model.modules():
        if isinstance(module, PROJECTIONS):
            for param in (module.weight, getattr(module, "bias", None)):
                if isinstance(param, torch.Tensor):  # a weight in block formats keeps them
                    param.data = param.data.to(dtype)


@torch.no_grad()
def prepack_linear_weights(model: nn.Module) -> None:
    """Replace every projection's float32 CPU weight by its oneDNN-packed form (engine/model/ops.py).

    The dense weight is dropped, except where a tied embedding still looks rows up in it."""
    for module in model.modules():
        if isinstance(module, PROJECTIONS) and isinstance(module.weight, torch.Tensor) and can_prepack(module.weight):
            module.weight = nn.Parameter(prepack(module.weight.data), requires_grad=False)
