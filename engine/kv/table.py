"""Request table: one row per request slot, mapping token positions to KV locations."""

from __future__ import annotations

import torch


class RequestTable:
    """`table[slot, pos]` is the KV-pool location holding position `pos` of the request in `slot`.

    Kernels read this map directly, so they never need to know the page size. `token_ids[slot, pos]`
    is the sampled token at output position `pos`: the sampler writes it and the next decode step
    reads its input ids from here, so it can be scheduled before the host has seen them.
    """

    def __init__(self, num_slots: int, max_len: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.max_len = max_len
        self.table = torch.zeros((num_slots, max_len), dtype=torch.int64, device=device)
        self.token_ids = torch.zeros((num_slots, max_len), dtype=torch.int64, device=device)
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self.holder: list[str | None] = [None] * num_slots

    @property
    def available_size(self) -> int:
        """Free request slots."""
        return len(self._free)

    def allocate(self, rid: str) -> int:
        slot = self._free.pop()
        self.holder[slot] = rid
        return slot

    def free(self, slot: int) -> None:
        self.holder[slot] = None
        self._free.append(slot)

    def write_pages(self, slot: int, first: int, pages: list[int], page_size: int) -> None:
        """Record that the request's pages number `first`, `first + 1`, ... are `pages`: position
        `p` of page `i` lives in KV location `pages[i] * page_size + p % page_size`."""
        if not pages:
            return
        start = first * page_size
        slots = (torch.tensor(pages)[:, None] * page_size + torch.arange(page_size)[None, :]).flatten()
        slots = slots[: max(0, self.max_len - start)]
        self.table[slot, start : start + slots.numel()] = slots.to(self.table.device)
