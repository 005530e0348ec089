"""Token sampling: greedy rows in one argmax, sampled rows with temperature, top-k and top-p."""

from __future__ import annotations

import logging

import torch

from engine.params import SamplingParams

log = logging.getLogger(__name__)

# Below this, logits / temperature overflows float32 (a temperature of 1e-40 made every logit inf);
# sampling that cold is greedy in all but name.
MIN_TEMPERATURE = 1e-6


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Scale by temperature and mask everything outside top-k and the top-p nucleus (one row).

    The most likely token always survives, whatever the parameters, so the row can be sampled."""
    logits = logits / max(params.temperature, MIN_TEMPERATURE)
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p. A top_p that rounds to
        # 0 in float32 (5e-324) would drop the top token too, so it is kept explicitly.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """One next token per row of float32 `logits` [N, vocab], as an int64 tensor on the logits' device
    (the caller decides when to copy it to the host).

    A row that cannot be sampled (non-finite logits from a broken checkpoint, say) keeps its argmax
    and is logged, so one request's failure never takes down the batch."""
    out = logits.argmax(dim=-1)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        try:
            probs = torch.softmax(filter_logits(logits[i], p), dim=-1)
            out[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
        except RuntimeError as e:
            log.error("sampling row %d failed (%s); using its most likely token instead", i, e)
    return out
