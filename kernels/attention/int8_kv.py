"""int8 KV pages: each row of one token's keys (or values) for one KV head is head_dim int8 values and a float32
scale per block of 32 of them (max|x| / 127 over the block, as GGML's Q8_0; a head_dim that is not a multiple of 32
is one block), the scales after the values. A page of such rows is one plain byte tensor, so the prefix cache, the
host and disk tiers and retraction move it as they move float pages, at 36/128 of float32's bytes.

Rows are quantized once, when written (`quantize_rows` here, attention.c's `kv_store_q8` for the CPU backend);
attention reads them as they are, widening a block of rows at a time (`dequantize_rows`, attention.c's `row_q8`).
Rounding is to nearest even, so a value is read back within half its block's scale.

Keys carry a few large channels, and a block's scale follows its largest value, so the rest of the block loses
precision to them. Keys are therefore stored rotated (`quantize_keys`: times a Walsh-Hadamard matrix in groups of
`key_group(head_dim)` values, which spreads a large channel over its group) and each query is turned alike
(`rotate_queries`), so q . k is what it was, up to float32 rounding. On SmolLM2-135M over the 2,047 positions of
tests/data/prose.txt the top token under float32 pages changed at 29 positions with keys stored as they are, 23
with blocks of 16, and 14-18 rotated; rounding both pages to bfloat16 changes 11 (QuaRot and ik_llama.cpp's
Hadamard K cache rotate for the same reason). Values are stored as they are: quantizing only them changed 6.
"""

from __future__ import annotations

import torch

BLOCK = 32
"""Values per scale."""
LAYOUT = "int8 rows: blocks of 32, scales after, keys rotated"
"""What a stored int8 page holds, for the disk tier's fingerprint: pages of an earlier layout are never read."""
SCALE_BYTES = 4
"""A scale, float32."""
INV_127 = 1 / 127
"""s = max|x| * INV_127 and q = round(x * (1 / s)), both in float32: multiplications, which the C kernels (built with
fast math, which turns a division into one) compute bit for bit as torch does."""


def blocks(head_dim: int) -> int:
    """Scales per row."""
    return head_dim // BLOCK if head_dim % BLOCK == 0 else 1


def row_bytes(head_dim: int) -> int:
    """The bytes of one int8 row: its values and its scales."""
    return head_dim + SCALE_BYTES * blocks(head_dim)


def key_group(head_dim: int) -> int:
    """The order of the Walsh-Hadamard matrix keys are rotated by: the largest power of two dividing head_dim."""
    return head_dim & -head_dim


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] (float32) times the unnormalised Walsh-Hadamard matrix of order key_group(n) in each group of that
    many values (Sylvester's order): the butterflies of elementwise.c's hadamard_groups_f32, bit for bit."""
    n = x.shape[-1]
    h = 1
    while h < key_group(n):
        pairs = x.reshape(*x.shape[:-1], n // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(x.shape)
        h *= 2
    return x


def quantize_keys(k: torch.Tensor) -> torch.Tensor:
    """Keys [..., head_dim] as int8 rows: rotated (`rotate`), then `quantize_rows`."""
    return quantize_rows(rotate(k.float()))


def rotate_queries(q: torch.Tensor) -> torch.Tensor:
    """Queries [..., head_dim] turned as the keys of int8 pages are (times 1 / key_group: H H = key_group I), so that
    their dot products with the stored keys are q . k; float32."""
    return rotate(q.float()) * (1 / key_group(q.shape[-1]))


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] (any float dtype) as int8 rows [..., row_bytes(head_dim)]: round(x / s) per block, s =
    max|x| / 127 over the block (an all-zero block: s = 0 and zeros), as INV_127 says."""
    x = x.float()
    lead, dim = x.shape[:-1], x.shape[-1]
    per = x.reshape(*lead, blocks(dim), -1)
    scale = per.abs().amax(-1, keepdim=True) * INV_127
    q = torch.where(scale > 0, per * (1 / scale), 0.0).round().to(torch.int8).reshape(x.shape)
    return torch.cat((q, scale.reshape(*lead, -1).contiguous().view(torch.int8)), dim=-1)


def dequantize_rows(rows: torch.Tensor, head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 rows [..., row_bytes(head_dim)] back to values [..., head_dim] (q * s in float32, then `dtype`)."""
    lead = rows.shape[:-1]
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    values = rows[..., :head_dim].float().reshape(*lead, blocks(head_dim), -1) * scale[..., None]
    return values.reshape(*lead, head_dim).to(dtype)


def is_int8(cache: torch.Tensor) -> bool:
    """Whether a KV cache tensor holds int8 rows."""
    return cache.dtype == torch.int8
