"""A model's repacked weights gathered into one buffer of transparent huge pages (2 MiB), and the KV pool in them.

A decode step reads every weight once, and a small model's 90-250 MB do not stay in a shared machine's cache: they
stream from memory. Scattered over 4 KiB pages, each page of weights costs a TLB miss and a page walk on the way;
in 2 MiB pages there are 512 times fewer. Measured on an Intel Xeon (2 vCPUs, 2026-12-07): Gemma 3 270M Q4_K_M's
decode rose from ~72 to ~83 tok/s with only its 178 MB head in huge pages (torch's THP_MEM_ALLOC_ENABLE), before
this module put every weight there (docs/benchmarks.md has the figures with it).

Linux backs anonymous memory advised with madvise(MADV_HUGEPAGE) by huge pages where
/sys/kernel/mm/transparent_hugepage/enabled says `madvise` (most distributions' default) or `always`; elsewhere the
buffer is ordinary memory and only the copy was spent.
"""

from __future__ import annotations

import ctypes
import math
import mmap
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from kernels.quant import BlockMatrix, Segment

HUGE_PAGE = 2 << 20
ALIGN = 64  # each segment starts on a cache line


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] starting on a 2 MiB boundary, advised as huge-page memory where the OS takes the advice. The
    tensor keeps the mapping alive. Where there are no anonymous mappings (Windows), ordinary memory."""
    if not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.empty(nbytes, dtype=torch.uint8)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = ctypes.c_char.from_buffer(mapping)
    start = -ctypes.addressof(view) % HUGE_PAGE
    del view  # an exported buffer pins the mapping's size; the tensor below holds its own
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        mapping.madvise(advice, start, nbytes)
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=start)


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor in huge pages: the KV pool, which a long context's decode step reads as widely as the weights.
    Written through once now, so that its memory is claimed at start as torch.zeros claimed it (left to fault in as
    pages are first used, the process's memory would grow over its first requests and look like a leak)."""
    width = torch.empty((), dtype=dtype).element_size()
    out = huge_page_buffer(max(1, math.prod(shape)) * width).view(dtype)[: math.prod(shape)].view(shape)
    return out.zero_()


def block_matrices(model: nn.Module) -> Iterator[BlockMatrix]:
    """Every BlockMatrix a module of `model` holds: as its weight or among its attributes, in lists too (a float
    model's kept rows)."""

    def inside(value: object) -> Iterator[BlockMatrix]:
        if isinstance(value, BlockMatrix):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                yield from inside(item)

    for module in model.modules():
        for value in module.__dict__.values():
            yield from inside(value)


def gather_into_huge_pages(matrices: Iterable[BlockMatrix]) -> int:
    """Move the segments of `matrices` into one huge-page buffer, in the order given (the order a step reads
    them); returns the bytes moved. A segment shared by several matrices (a tied head) moves once; one that is a
    view into a larger tensor (a tensor-parallel slice) stays where it is."""
    matrices = list(matrices)
    chosen: dict[int, Segment] = {}
    for matrix in matrices:
        for seg in matrix.segments:
            whole = seg.data.storage_offset() == 0 and seg.data.untyped_storage().nbytes() == seg.nbytes
            if whole:
                chosen.setdefault(id(seg), seg)
    sizes = [-(-seg.nbytes // ALIGN) * ALIGN for seg in chosen.values()]
    if not sizes:
        return 0
    buffer = huge_page_buffer(sum(sizes))
    offset = 0
    for seg, size in zip(chosen.values(), sizes, strict=True):
        placed = buffer[offset : offset + seg.nbytes].view(seg.data.shape)
        placed.copy_(seg.data)
        seg.data = placed
        offset += size
    for matrix in matrices:
        matrix.handle = None  # the kernels' cached view of its segments pointed at the old memory
    return sum(sizes)
