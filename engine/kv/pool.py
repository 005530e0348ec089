"""The KV pool: one K and one V tensor per layer, indexed by KV location (page * page_size + offset)."""

from __future__ import annotations

import torch

from kernels.attention.int8_kv import row_bytes
from kernels.cpu.hugepages import huge_page_zeros


class KVPool:
    """Physical KV storage. Shape per layer: [num_pages * page_size, num_kv_heads, head_dim] of `dtype`; with
    `dtype` torch.int8, [..., row_bytes(head_dim)]: int8 rows with their scales (kernels/attention/int8_kv.py).

    The tiers under the prefix cache (engine/kv/tiers.py) move whole pages in and out: `read_pages` copies
    pages into host memory as one tensor [pages, layers, 2, page_size, kv_heads, head_dim] (each page
    contiguous, so a page's bytes are one slice), `write_pages` puts such pages back."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        shape = (num_layers, 2, num_pages * page_size, num_kv_heads, row_width(head_dim, dtype))
        self.buffer = huge_page_zeros(shape, dtype) if torch.device(device).type == "cpu" else \
            torch.zeros(shape, dtype=dtype, device=device)

    @property
    def dtype_name(self) -> str:
        """What the pages hold: "int8", or the float dtype's name."""
        return str(self.buffer.dtype).removeprefix("torch.")

    def k(self, layer: int) -> torch.Tensor:
        return self.buffer[layer, 0]

    def v(self, layer: int) -> torch.Tensor:
        return self.buffer[layer, 1]

    @property
    def page_shape(self) -> tuple[int, ...]:
        """One page as `read_pages` gives it: [layers, 2 (K and V), page_size, kv_heads, head_dim]."""
        layers, _, _, heads, dim = self.buffer.shape
        return layers, 2, self.page_size, heads, dim

    @property
    def page_bytes(self) -> int:
        return torch.Size(self.page_shape).numel() * self.buffer.element_size()

    def _paged(self) -> torch.Tensor:
        layers, _, slots, heads, dim = self.buffer.shape
        return self.buffer.view(layers, 2, slots // self.page_size, self.page_size, heads, dim)

    def read_pages(self, pages: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """The K/V of `pages`, copied to host memory: [len(pages), *page_shape], contiguous, into `out` if given
        (memory used again: a fresh tensor costs its page faults, several times the copy); synchronous on a GPU,
        the copy is done when this returns."""
        index = torch.tensor(pages, dtype=torch.int64, device=self.buffer.device)
        paged = self._paged().permute(2, 0, 1, 3, 4, 5)
        if out is not None and self.buffer.device.type == "cpu":
            return torch.index_select(paged, 0, index, out=out)
        gathered = paged.index_select(0, index)
        return gathered.to("cpu") if out is None else out.copy_(gathered)

    def write_pages(self, pages: list[int], data: torch.Tensor) -> None:
        """Put `data` ([len(pages), *page_shape], host memory, as `read_pages` gives it) into `pages`
        (synchronous: `data` may be reused when this returns)."""
        index = torch.tensor(pages, dtype=torch.int64, device=self.buffer.device)
        self._paged().permute(2, 0, 1, 3, 4, 5).index_copy_(0, index, data.to(self.buffer.device))

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
        return num_layers * 2 * page_size * num_kv_heads * row_width(head_dim, dtype) * \
            torch.empty((), dtype=dtype).element_size()


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one token's row for one KV head: head_dim, or for int8 pages its bytes with the scale."""
    return row_bytes(head_dim) if dtype == torch.int8 else head_dim
