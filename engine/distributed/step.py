"""One step's model inputs as every rank needs them, and how they travel from rank 0 to the others."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.distributed.group import TensorParallel
from kernels.attention.base import AttentionMetadata, build_metadata


@dataclass
class StepInputs:
    """The flat token batch of one step and where its K/V live.

    Request `b` feeds `q_lens[b]` tokens and has `kv_lens[b]` positions afterwards; `window[b, :kv_lens[b]]`
    are its KV-pool locations (its request-table row), so a worker rank needs no request table, page
    allocator or scheduler of its own: its pool is laid out exactly like rank 0's, only narrower.
    """

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    logits_index: torch.Tensor  # int64 [S]
    q_lens: list[int]
    kv_lens: list[int]
    window: torch.Tensor  # int64 [B, max(kv_lens)]

    @classmethod
    def from_metadata(cls, input_ids: torch.Tensor, positions: torch.Tensor, logits_index: torch.Tensor,
                      meta: AttentionMetadata) -> StepInputs:
        window = meta.table[meta.rows, : max(meta.kv_lens)]
        return cls(input_ids, positions, logits_index, list(meta.q_lens), list(meta.kv_lens), window)

    @property
    def header(self) -> tuple[list[int], list[int], int]:
        """The host-side part, sent ahead so a receiver can size the packed tensor."""
        return self.q_lens, self.kv_lens, self.logits_index.numel()

    def send(self, tp: TensorParallel) -> None:
        """Rank 0: broadcast the tensors packed into one (the header went ahead by another channel)."""
        tp.broadcast(torch.cat((self.input_ids, self.positions, self.logits_index, self.window.flatten())))

    @classmethod
    def receive(cls, header: tuple[list[int], list[int], int], tp: TensorParallel,
                device: torch.device) -> StepInputs:
        """A worker rank: take rank 0's broadcast of the step whose header arrived."""
        q_lens, kv_lens, num_logits = header
        tokens, width = sum(q_lens), max(kv_lens)
        packed = tp.broadcast(torch.empty(2 * tokens + num_logits + len(q_lens) * width, dtype=torch.int64,
                                          device=device))
        ids, pos, logits_index, window = packed.split([tokens, tokens, num_logits, len(q_lens) * width])
        return cls(ids, pos, logits_index, q_lens, kv_lens, window.view(len(q_lens), width))

    def metadata(self) -> AttentionMetadata:
        """The step's attention metadata, rebuilt from the window (row b of the window is request b)."""
        rows = torch.arange(len(self.q_lens), dtype=torch.int64, device=self.window.device)
        return build_metadata(self.q_lens, self.kv_lens, rows, self.window)
