"""Weights kept in GGML's block formats (the tensor types of GGUF files), and what a product over them needs.

A quantized [out, in] weight is a `BlockMatrix`: its rows, in `Segment`s of one format each, every row
the format's blocks as the file stores them (a fused projection whose parts came in different formats,
as llama.cpp's Q4_K_M files mix Q4_K and Q6_K, keeps one segment per run of rows). The CPU kernels
(kernels/cpu/quant.c) multiply by it without unpacking it into memory; `dequantize` gives the float32
matrix the kernels are checked against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class QType:
    """One format: GGML's type id, `block` values in `block_bytes` bytes."""

    name: str
    ggml_id: int
    block: int
    block_bytes: int

    def row_bytes(self, columns: int) -> int:
        """Bytes of a row of `columns` values (a multiple of the block)."""
        if columns % self.block:
            raise ValueError(f"{self.name} stores rows in blocks of {self.block} values; {columns} is not a multiple")
        return columns // self.block * self.block_bytes

    @property
    def bits(self) -> float:
        """Bits per value, scales included."""
        return 8 * self.block_bytes / self.block


QTYPES = {t.name: t for t in (
    QType("F32", 0, 1, 4), QType("F16", 1, 1, 2), QType("BF16", 30, 1, 2),
    QType("Q4_0", 2, 32, 18), QType("Q4_1", 3, 32, 20), QType("Q5_0", 6, 32, 22), QType("Q5_1", 7, 32, 24),
    QType("Q8_0", 8, 32, 34), QType("Q4_K", 12, 256, 144), QType("Q5_K", 13, 256, 176), QType("Q6_K", 14, 256, 210),
)}
"""Every format minichat reads; the float ones load as ordinary tensors."""

FLOAT_TYPES = ("F32", "F16", "BF16")
ROW_TYPES = ("F32", "BF16")
"""Float formats a `Segment` may hold, in panels of 8 rows too (the values as they are, interleaved; quant.c),
multiplied by x unquantized."""
BLOCK_TYPES = tuple(name for name in QTYPES if name not in FLOAT_TYPES)
"""The formats the kernels multiply by as they are."""


PANEL = 8
"""Rows per panel of the kernels' repacked layout (kernels/cpu/quant.c)."""


@dataclass
class Segment:
    """`rows` consecutive rows of one format, repacked into panels of `PANEL` rows: uint8 [panels, panel_bytes]."""

    qtype: QType
    data: torch.Tensor
    rows: int

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


@dataclass
class BlockMatrix:
    """An [out_features, in_features] weight as row segments of block formats (see the module docstring)."""

    in_features: int
    segments: list[Segment]
    handle: object = field(default=None, repr=False, compare=False)  # the kernels' view of the segments, cached

    @property
    def out_features(self) -> int:
        return sum(s.rows for s in self.segments)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    @property
    def formats(self) -> list[str]:
        return [s.qtype.name for s in self.segments]

    @staticmethod
    def join(in_features: int, parts: list[Segment]) -> BlockMatrix:
        """Consecutive parts of one format merged into one segment where the first fills its last panel (one
        kernel pass instead of several)."""
        merged: list[Segment] = []
        for part in parts:
            last = merged[-1] if merged else None
            if last is not None and last.qtype == part.qtype and last.rows % PANEL == 0:
                merged[-1] = Segment(part.qtype, torch.cat((last.data, part.data)), last.rows + part.rows)
            else:
                merged.append(part)
        return BlockMatrix(in_features, merged)

    def rows_of(self, start: int, count: int) -> BlockMatrix:
        """Rows [start, start + count) (a vocabulary range under tensor parallelism): whole panels, so `start`
        and `count` are multiples of PANEL, or the range runs to the end."""
        parts, first = [], 0
        for s in self.segments:
            lo, hi = max(start, first), min(start + count, first + s.rows)
            if lo < hi:
                if (lo - first) % PANEL or ((hi - first) % PANEL and hi != first + s.rows):
                    raise ValueError(f"rows [{start}, {start + count}) of a quantized weight do not fall on its panels "
                                     f"of {PANEL} rows")
                parts.append(Segment(s.qtype, s.data[(lo - first) // PANEL : -(-(hi - first) // PANEL)], hi - lo))
            first += s.rows
        return BlockMatrix(self.in_features, parts)


def column_range(qtype: QType, columns: int, start: int, size: int) -> slice:
    """The bytes of each file row holding columns [start, start + size): a cut on block boundaries, or ValueError."""
    if start % qtype.block or size % qtype.block or columns % qtype.block:
        raise ValueError(f"columns [{start}, {start + size}) of a {qtype.name} row do not fall on its blocks of "
                         f"{qtype.block} values")
    return slice(start // qtype.block * qtype.block_bytes, (start + size) // qtype.block * qtype.block_bytes)


@dataclass
class DeviceBlockWeight:
    """A weight in block formats as the GPU kernels read it (kernels/triton/quant.py): each value's integer as
    int8 [out, in] and, per 16 values, a float32 scale and offset [out, in / 16], so that w = scale * q + offset
    for every format, exactly (8 bits a value plus 4 of scales, where the file had 4.5 to 8.5)."""

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    formats: list[str]

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1]

    @property
    def in_features(self) -> int:
        return self.q.shape[1]

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.offset))

    @staticmethod
    def join(parts: list[DeviceBlockWeight]) -> DeviceBlockWeight:
        """The parts' rows one after another (a fused projection's q, k and v)."""
        q, scale, offset = (torch.cat([getattr(p, name) for p in parts]) for name in ("q", "scale", "offset"))
        return DeviceBlockWeight(q, scale, offset, list(dict.fromkeys(f for p in parts for f in p.formats)))

    def to(self, device: torch.device) -> DeviceBlockWeight:
        return DeviceBlockWeight(self.q.to(device), self.scale.to(device), self.offset.to(device), self.formats)

    def dequantize(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 values (rows `ids`), equal to gguf's dequantization of the file's rows."""
        q, scale, offset = (t if ids is None else t[ids] for t in (self.q, self.scale, self.offset))
        return scale.repeat_interleave(16, dim=1) * q.float() + offset.repeat_interleave(16, dim=1)
