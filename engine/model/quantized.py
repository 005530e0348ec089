"""Weights that stay in block formats inside the model (kernels/quant.py's `BlockMatrix`).

Which weights: every projection, the embedding and the output head whose checkpoint tensors come in a block
format (a GGUF file's Q4_K, Q8_0, ...), or all of them under `quantization` ("int8": Q8_0, a scale per 32
values; "int4": Q4_1, a scale and a minimum per 32 values), quantized at load with gguf's own quantizer.
Rows that are not whole blocks (a 688-wide MLP, say) stay float, as llama.cpp's quantizer falls back to
another type for them. `plan_block_weights` swaps those modules' float parameters for a `BlockWeightBuilder`
before the model's memory is allocated, so no float copy of a quantized weight ever exists; the loader hands
each builder this rank's cut of every checkpoint tensor (rows of a column-parallel part, whole blocks of columns of a
row-parallel one) and `finish_block_weights` puts the joined `BlockMatrix` in its place.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
from torch import nn

from engine.config import QUANTIZATIONS
from kernels.quant import QTYPES, BlockMatrix, DeviceBlockWeight, QType, column_range

if TYPE_CHECKING:
    from kernels.cpu import CpuKernels

log = logging.getLogger(__name__)

__all__ = ["QUANTIZATIONS", "BlockSource", "BlockWeightBuilder", "finish_block_weights", "plan_block_weights",
           "quantize", "weight_footprint"]


@dataclass
class BlockSource:
    """A checkpoint tensor in a block format: its rows as the file stores them (uint8 [out, row_bytes])."""

    qtype: QType
    rows: np.ndarray
    columns: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows.shape[0], self.columns

    def cut(self, dim: int, start: int, size: int) -> BlockSource:
        """Rows [start, start + size) (dim 0), or those columns (dim 1: whole blocks only)."""
        if dim == 0:
            return BlockSource(self.qtype, self.rows[start : start + size], self.columns)
        return BlockSource(self.qtype, self.rows[:, column_range(self.qtype, self.columns, start, size)], size)

    def dequantize(self) -> torch.Tensor:
        """The float32 values, by gguf's own dequantization (the reference the kernels are tested against)."""
        from gguf import GGMLQuantizationType, dequantize

        return torch.from_numpy(dequantize(np.ascontiguousarray(self.rows), GGMLQuantizationType[self.qtype.name]))


class BlockWeightBuilder:
    """Collects this rank's parts of one weight as the checkpoint's tensors arrive; `finish` joins them into the
    form the device's kernels read: on the CPU a `BlockMatrix` (panels), on a GPU a `DeviceBlockWeight`."""

    def __init__(self, out_features: int, in_features: int, quantize_to: QType | None, kernels: CpuKernels,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.shape = (out_features, in_features)
        self.quantize_to = quantize_to
        self.kernels = kernels
        self.device, self.dtype = device, dtype  # where the weight goes, and the dtype of a dense fallback
        self.parts: dict[int, BlockSource | torch.Tensor] = {}

    def put(self, row: int, name: str, source: torch.Tensor | BlockSource) -> None:
        """Place `source` (already cut to this rank's share) at rows [row, ...): block rows as they are, float
        ones quantized to `quantize_to`, or kept float (a float part of a weight whose others are blocks)."""
        rows, columns = source.shape
        if columns != self.shape[1] or row + rows > self.shape[0]:
            raise ValueError(f"weight {name} has shape {tuple(source.shape)}, which does not fit the config")
        if isinstance(source, torch.Tensor):
            self.parts[row] = source.float().contiguous() if self.quantize_to is None else \
                quantize(source, self.quantize_to)
        else:
            self.parts[row] = source

    def finish(self, what: str) -> BlockMatrix | DeviceBlockWeight | torch.Tensor:
        parts, row = [], 0
        for start in sorted(self.parts):
            if start != row:
                raise ValueError(f"{what}: rows [{row}, {start}) missing from the checkpoint")
            parts.append(self.parts[start])
            row += self.parts[start].shape[0]
        if row != self.shape[0]:
            raise ValueError(f"{what}: rows [{row}, {self.shape[0]}) missing from the checkpoint")
        blocks = [p for p in parts if isinstance(p, BlockSource)]
        if self.device.type == "cpu":
            return BlockMatrix.join(self.shape[1], [
                self.kernels.repack(_rows(p), p.qtype, p.columns) if isinstance(p, BlockSource)
                else self.kernels.repack(p.view(torch.uint8), QTYPES["F32"], p.shape[1]) for p in parts])
        pieces = [DeviceBlockWeight(*self.kernels.expand(_rows(p), p.qtype, p.columns), [p.qtype.name])
                  if isinstance(p, BlockSource) else p for p in parts]
        if len(blocks) < len(parts):  # float parts too: the GPU kernels take one form, so the weight goes dense
            dense = [p.dequantize() if isinstance(p, DeviceBlockWeight) else p for p in pieces]
            return torch.cat(dense).to(self.device, self.dtype)
        return DeviceBlockWeight.join(cast(list[DeviceBlockWeight], pieces)).to(self.device)


def _rows(source: BlockSource) -> torch.Tensor:
    """A source's file rows as a contiguous uint8 tensor (a copy off the file's memory map)."""
    return torch.from_numpy(np.ascontiguousarray(source.rows))


def quantize(weight: torch.Tensor, qtype: QType) -> BlockSource:
    """A float [out, in] weight in `qtype` blocks, by gguf's quantizer (ggml's reference rounding)."""
    from gguf import GGMLQuantizationType
    from gguf import quantize as gguf_quantize

    if weight.shape[1] % qtype.block:
        raise ValueError(f"cannot quantize a weight of {weight.shape[1]} columns to {qtype.name}: rows must be "
                         f"whole blocks of {qtype.block} values")
    data = gguf_quantize(weight.float().numpy(), GGMLQuantizationType[qtype.name])
    return BlockSource(qtype, data, weight.shape[1])


def plan_block_weights(model: nn.Module, targets: Mapping[str, Sequence[object]], block_names: set[str],
                       quantize_to: QType | None, quantizable: tuple[type[nn.Module], ...],
                       kernels: CpuKernels, device: torch.device) -> None:
    """Give every `quantizable` module one of whose checkpoint tensors is in `block_names` (or all of them,
    with `quantize_to`) a builder in place of its float weight parameter. `targets` maps checkpoint names to
    their WeightTargets (whose `param` tells the module)."""
    owners = {id(m.weight): m for m in model.modules() if isinstance(m, quantizable)}
    chosen: dict[int, nn.Module] = {}
    for name, parts in targets.items():
        for target in parts:
            module = owners.get(id(getattr(target, "param", None)))
            if module is not None and (quantize_to is not None or name in block_names):
                chosen[id(module)] = module
    if quantize_to is not None:  # rows that are not whole blocks stay float, as llama.cpp's quantizer falls back
        odd = {i: m for i, m in chosen.items() if cast(torch.Tensor, m.weight).shape[1] % quantize_to.block}
        if odd:
            names = sorted({n for n, m in model.named_modules() if id(m) in odd})
            log.warning("%d weights stay float32: their rows are not whole %s blocks of %d values (%s)", len(names),
                        quantize_to.name, quantize_to.block, ", ".join(names[:4]) + (", ..." if len(names) > 4 else ""))
        for i in odd:
            del chosen[i]
    for module in chosen.values():
        weight = cast(torch.Tensor, module.weight)
        out_features, in_features = weight.shape
        del module.weight  # the float parameter is never allocated
        builder = BlockWeightBuilder(out_features, in_features, quantize_to, kernels, device, weight.dtype)
        setattr(module, "weight", builder)  # noqa: B010


def weight_footprint(model: nn.Module) -> tuple[dict[str, int], int]:
    """The model's weights by format (elements of each: block formats by name, tensors by dtype) and the bytes
    they take in memory (a tied weight counted once)."""
    seen: set[int] = set()
    formats: dict[str, int] = {}
    total = 0
    for module in model.modules():
        for value in [*module._parameters.values(), getattr(module, "weight", None)]:
            if value is None or id(value) in seen or not isinstance(value, (torch.Tensor, BlockMatrix,
                                                                            DeviceBlockWeight)):
                continue
            seen.add(id(value))
            if isinstance(value, BlockMatrix):
                for seg in value.segments:  # float rows fused into a block weight count as float32, as tensors do
                    name = "float32" if seg.qtype.name == "F32" else seg.qtype.name
                    formats[name] = formats.get(name, 0) + seg.rows * value.in_features
                total += value.nbytes
            elif isinstance(value, DeviceBlockWeight):  # counted under its first format (its mix is per row)
                formats[value.formats[0]] = formats.get(value.formats[0], 0) + value.q.numel()
                total += value.nbytes
            else:
                name = str(value.dtype).removeprefix("torch.")
                formats[name] = formats.get(name, 0) + value.numel()
                total += value.numel() * value.element_size()
    return formats, total


def finish_block_weights(model: nn.Module) -> None:
    """Swap every builder for the weight it built (a dense one back as a parameter)."""
    for name, module in model.named_modules():
        builder = getattr(module, "weight", None)
        if isinstance(builder, BlockWeightBuilder):
            weight = builder.finish(f"{name}.weight")
            module.weight = nn.Parameter(weight, requires_grad=False) if isinstance(weight, torch.Tensor) else weight
