"""Token sampling: greedy rows in one argmax, sampled rows with temperature, top-k and top-p."""

from __future__ import annotations

import torch

from engine.request import SamplingParams


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Scale by temperature and mask everything outside top-k and the top-p nucleus (one row)."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (the top token always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """One next token per row of float32 `logits` [N, vocab], as an int64 tensor on the logits' device
    (the caller decides when to copy it to the host)."""
    out = logits.argmax(dim=-1)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = torch.softmax(filter_logits(logits[i], p), dim=-1)
        out[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
    return out
