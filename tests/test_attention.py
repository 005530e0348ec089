"""Attention backends against a direct per-request computation over the same paged pool."""

from __future__ import annotations

import pytest
import torch

from kernels.attention import build_metadata, make_backend
from kernels.attention.base import AttentionShape


def naive_attention(q, k_cache, v_cache, table, rows, q_lens, kv_lens, scale, window=None, softcap=None):
    """Each request on its own: gather its keys, bottom-right causal mask (and a sliding window: keys within
    `window` positions of the query, transformers' rule), capped scores, softmax, weighted sum."""
    outs, start = [], 0
    for row, ql, kl in zip(rows.tolist(), q_lens, kv_lens, strict=True):
        idx = table[row, :kl]
        k, v = k_cache[idx], v_cache[idx]
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        qi = q[start : start + ql]
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        qpos = torch.arange(kl - ql, kl)[:, None]
        hidden = torch.arange(kl)[None, :] > qpos
        if window is not None:
            hidden |= torch.arange(kl)[None, :] <= qpos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        start += ql
    return torch.cat(outs)


@pytest.mark.parametrize("backend_name", ["torch", "cpu", "cpu_split"])
@pytest.mark.parametrize(("q_lens", "kv_lens"), [
    ([1, 1, 1], [5, 17, 1]),  # decode, ragged
    ([7, 3, 12], [7, 20, 12]),  # fresh prefill, chunk continuing over a cached prefix, fresh prefill
    ([1, 9], [33, 9]),  # mixed shapes
])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (8, 1)])
def test_backend_matches_naive(backend_name, q_lens, kv_lens, heads):
    torch.manual_seed(0)
    hq, hkv, d, slots, rows_total, max_len = heads[0], heads[1], 16, 256, 4, 64
    k_cache, v_cache = torch.randn(slots, hkv, d), torch.randn(slots, hkv, d)
    perm = torch.randperm(slots)  # scatter each request's positions over the pool
    table = perm[: rows_total * max_len].view(rows_total, max_len).clone()
    rows = torch.tensor([2, 0, 3][: len(q_lens)])
    t = sum(q_lens)
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    out_locs = torch.cat([table[r, kl - ql : kl] for r, ql, kl in zip(rows.tolist(), q_lens, kv_lens, strict=True)])
    backend = make_backend(backend_name.removesuffix("_split"), "cpu")
    if backend_name == "cpu_split":  # long prompt chunks: the reference's layout, decode tokens in C
        backend.max_per_token_queries = 2
    backend.setup(AttentionShape(hq, hkv, d, torch.float32, d**-0.5), torch.device("cpu"))
    meta = build_metadata(q_lens, kv_lens, rows, table)
    assert torch.equal(meta.out_locs, out_locs)
    assert torch.equal(meta.kv_indices.long(), torch.cat([table[r, :kl] for r, kl in zip(rows.tolist(), kv_lens,
                                                                                          strict=True)]))
    kc, vc = k_cache.clone(), v_cache.clone()
    got = backend.forward(q, k, v, kc, vc, backend.prepare(meta), d**-0.5)
    assert torch.equal(kc[out_locs], k) and torch.equal(vc[out_locs], v)  # new K/V landed in their slots
    want = naive_attention(q, kc, vc, table, rows, q_lens, kv_lens, d**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown attention backend"):
        make_backend("warp-drive", "cpu")


WINDOWED = [
    ([1, 1, 1], [5, 17, 40]),  # decode: one request inside its window, two past it
    ([7, 3, 30], [7, 20, 30]),  # a fresh prompt shorter and one longer than the window, a chunk over a prefix
    ([1, 9, 12], [33, 9, 12]),  # mixed; equal fresh prompts would take SDPA's own causal mask without a window
    ([12, 12], [12, 12]),  # fresh prompts of one length (the unmasked fast path without a window)
]


@pytest.mark.parametrize("backend_name", ["torch", "cpu", "cpu_split"])
@pytest.mark.parametrize(("q_lens", "kv_lens"), WINDOWED)
@pytest.mark.parametrize(("window", "softcap"), [(8, None), (None, 5.0), (5, 2.0)], ids=["window", "softcap", "both"])
def test_windows_and_capped_scores(backend_name, q_lens, kv_lens, window, softcap):
    """A sliding window (query at p sees keys p - window < j <= p) and Gemma 2's capped scores, for every step
    shape, on every CPU backend; the same step state serves a full-attention layer next (a model alternates)."""
    torch.manual_seed(1)
    hq, hkv, d, max_len = 4, 2, 16, 48
    k_cache, v_cache = torch.randn(256, hkv, d), torch.randn(256, hkv, d)
    table = torch.randperm(256)[: 4 * max_len].view(4, max_len).clone()
    rows = torch.tensor([1, 3, 0][: len(q_lens)])
    t = sum(q_lens)
    q, k, v = torch.randn(t, hq, d) * 3, torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    backend = make_backend(backend_name.removesuffix("_split"), "cpu")
    if backend_name == "cpu_split":
        backend.max_per_token_queries = 2
    backend.setup(AttentionShape(hq, hkv, d, torch.float32, d**-0.5, frozenset({window, None}), softcap),
                  torch.device("cpu"))
    meta = build_metadata(q_lens, kv_lens, rows, table)
    state = backend.prepare(meta)
    kc, vc = k_cache.clone(), v_cache.clone()
    got = backend.forward(q, k, v, kc, vc, state, d**-0.5, window=window, softcap=softcap)
    want = naive_attention(q, kc, vc, table, rows, q_lens, kv_lens, d**-0.5, window, softcap)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    full = backend.forward(q, k, v, kc, vc, state, d**-0.5)
    torch.testing.assert_close(full, naive_attention(q, kc, vc, table, rows, q_lens, kv_lens, d**-0.5), atol=1e-5,
                               rtol=1e-5)
