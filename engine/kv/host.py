"""The host tier: KV pages in host memory (pinned on CUDA) below the GPU's pool, least recently used first out.

On a GPU the pool is scarce and host memory plentiful: a page the pool evicts is copied here, and a prefix found
here is copied back in a few milliseconds, where the disk takes longer and recomputing far longer. On a CPU the
pool is host memory already, so this tier only adds a copy (it is off by default there; tests run it, as the
same code serves both).
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class HostTier:
    """`capacity` pages of `page_shape` in one tensor; `slots` maps a page's chain key to its slot."""

    def __init__(self, capacity: int, page_shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> None:
        self.capacity = capacity
        self.buffer = torch.empty((capacity, *page_shape), dtype=dtype, pin_memory=pin)
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._free = list(range(capacity - 1, -1, -1))
        self.stored = 0  # pages put here since start
        self.page_bytes = self.buffer[0].numel() * self.buffer.element_size() if capacity else 0

    def __contains__(self, key: bytes) -> bool:
        return key in self.slots

    def __len__(self) -> int:
        return len(self.slots)

    def put(self, key: bytes, page: torch.Tensor) -> None:
        """Keep a copy of `page` under `key`, dropping the least recently used page if the tier is full."""
        if key in self.slots or not self.capacity:
            return
        if not self._free:
            _, slot = self.slots.popitem(last=False)
            self._free.append(slot)
        slot = self._free.pop()
        self.buffer[slot].copy_(page)
        self.slots[key] = slot
        self.stored += 1

    def get(self, keys: list[bytes]) -> torch.Tensor:
        """The pages under `keys` (all present), as one tensor; they become the most recently used."""
        slots = []
        for key in keys:
            self.slots.move_to_end(key)
            slots.append(self.slots[key])
        return self.buffer[torch.tensor(slots, dtype=torch.int64)]

    def check_integrity(self) -> None:
        used = set(self.slots.values())
        if len(used) != len(self.slots) or used & set(self._free) or len(used) + len(self._free) != self.capacity:
            raise AssertionError(f"host tier: {len(self.slots)} pages in {len(used)} slots, {len(self._free)} free, "
                                 f"capacity {self.capacity}")
