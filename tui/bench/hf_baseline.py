"""The transformers baseline: the same workload through `generate` in static batches.

Static batching is what continuous batching improves on: every batch runs until its longest
request is done, and no request joins a batch once it has started.
"""

from __future__ import annotations

import time

import torch
from tqdm import tqdm

from engine.model.loader import TORCH_DTYPES
from tui.bench.metrics import RequestRecord
from tui.bench.workload import BenchRequest


def generated_len(row: list[int], eos_ids: set[int], wanted: int, ignore_eos: bool) -> int:
    """Tokens this request asked for and got: the batch runs to its longest member, and stops at EOS."""
    row = row[:wanted]
    if not ignore_eos:
        for i, t in enumerate(row):
            if t in eos_ids:
                return i + 1
    return len(row)


def run_hf_baseline(model_path: str, workload: list[BenchRequest], concurrency: int, dtype: str, device: str,
                    ignore_eos: bool, temperature: float, seed: int) -> tuple[list[RequestRecord], float]:
    """Returns per-request records (E2E only: nothing streams) and the wall-clock duration."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=TORCH_DTYPES[dtype])
    model = model.to(device).eval()  # type: ignore[arg-type]  # transformers' @wraps(Module.to) hides the bound self
    pad = 0
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    torch.manual_seed(seed)
    records: list[RequestRecord] = []
    batches = [workload[i : i + concurrency] for i in range(0, len(workload), concurrency)]
    start = time.perf_counter()
    for batch in tqdm(batches, desc="hf baseline", unit="batch"):
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch], device=device)
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch],
                            device=device)
        new = max(r.output_len for r in batch)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new if ignore_eos else 0,
                                 do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
                                 top_k=None, top_p=None, pad_token_id=pad)
        e2e = time.perf_counter() - t0
        for row, req in zip(out[:, width:].tolist(), batch, strict=True):
            records.append(RequestRecord(prompt_len=len(req.prompt_ids),
                                         output_len=generated_len(row, eos_ids, req.output_len, ignore_eos), e2e=e2e))
    return records, time.perf_counter() - start
