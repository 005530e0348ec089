"""The KV pool: one K and one V tensor per layer, indexed by KV location (page * page_size + offset)."""

from __future__ import annotations

import torch


class KVPool:
    """Physical KV storage. Shape per layer: [num_pages * page_size, num_kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        shape = (num_layers, 2, num_pages * page_size, num_kv_heads, head_dim)
        self.buffer = torch.zeros(shape, dtype=dtype, device=device)

    def k(self, layer: int) -> torch.Tensor:
        return self.buffer[layer, 0]

    def v(self, layer: int) -> torch.Tensor:
        return self.buffer[layer, 1]

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
        return num_layers * 2 * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
