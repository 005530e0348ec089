"""Triton kernels under the interpreter (TRITON_INTERPRET=1, set in conftest) against the naive reference.

Shapes are tiny because the interpreter runs every program in Python. Each request's positions are
scattered over the pool by a random permutation, so a kernel that assumed contiguous slots would fail.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.cuda_graph import graph_buckets
from kernels.attention import build_metadata, make_backend, resolve_backend_name
from kernels.attention.base import AttentionShape
from kernels.attention.int8_kv import dequantize_rows, quantize_keys, quantize_rows, rotate_queries
from kernels.attention.triton import TritonBackend
from kernels.triton.decode import decode_attention
from kernels.triton.extend import extend_attention
from kernels.triton.kv_store import store_kv
from tests.test_attention import naive_attention
from tests.test_engine_correctness import assert_matches_hf, mixed_prompts

HEAD_DIM = 16
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}
GROUPS = {"group1": (2, 2), "group2": (4, 2), "group8": (8, 1), "group20": (20, 1)}  # (query heads, KV heads)


def make_step(q_lens: list[int], kv_lens: list[int], heads: tuple[int, int], dtype: torch.dtype, seed: int = 0):
    """A pool with random contents and permuted slots, a step's metadata, and its q/k/v."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    rows_total, max_len = len(q_lens) + 1, max(kv_lens) + 3
    slots = rows_total * max_len + 5
    k_cache = torch.randn(slots, hkv, HEAD_DIM, generator=g).to(dtype)
    v_cache = torch.randn(slots, hkv, HEAD_DIM, generator=g).to(dtype)
    table = torch.randperm(slots, generator=g)[: rows_total * max_len].view(rows_total, max_len).clone()
    rows = torch.randperm(rows_total, generator=g)[: len(q_lens)]
    t = sum(q_lens)
    q = torch.randn(t, hq, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(t, hkv, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(t, hkv, HEAD_DIM, generator=g).to(dtype)
    return build_metadata(q_lens, kv_lens, rows, table), q, k, v, k_cache, v_cache


def reference(meta, q, k_cache, v_cache, window=None, softcap=None) -> torch.Tensor:
    """The naive per-request attention in fp32 over the (already stored) cache."""
    return naive_attention(q.float(), k_cache.float(), v_cache.float(), meta.table, meta.rows, meta.q_lens,
                           meta.kv_lens, HEAD_DIM**-0.5, window, softcap)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_writes_only_the_new_slots(dtype):
    meta, _, k, v, k_cache, v_cache = make_step([3, 1], [5, 9], (4, 2), dtype)
    kc, vc = k_cache.clone(), v_cache.clone()
    store_kv(k, v, kc, vc, meta.out_locs)
    assert torch.equal(kc[meta.out_locs], k) and torch.equal(vc[meta.out_locs], v)
    untouched = torch.ones(kc.shape[0], dtype=torch.bool)
    untouched[meta.out_locs] = False
    assert torch.equal(kc[untouched], k_cache[untouched]) and torch.equal(vc[untouched], v_cache[untouched])


EXTEND_CASES = {
    "decode": ([1, 1, 1], [6, 19, 1]),
    "fresh_prefill": ([5, 17, 1], [5, 17, 1]),  # 17 rows: two query blocks, the second one row long
    "prefix_extend": ([3, 18], [21, 40]),  # a chunk continuing over a cached prefix
    "mixed": ([1, 9, 2, 1], [33, 9, 20, 2]),
}


def alternate_dtypes(*axes: list[str]) -> list:
    """The product of `axes`, each combination in fp32 or fp16 in a checkerboard, so that every value of
    every axis meets both dtypes at half the interpreter time of the full product."""
    combos: list[tuple[int, ...]] = [()]
    for axis in axes:
        combos = [(*c, i) for c in combos for i in range(len(axis))]
    params = []
    for combo in combos:
        values = [axis[i] for axis, i in zip(axes, combo, strict=True)]
        dtype, name = ((torch.float32, "fp32"), (torch.float16, "fp16"))[sum(combo) % 2]
        params.append(pytest.param(*values, dtype, id="-".join([*values, name])))
    return params


@pytest.mark.parametrize(("case", "group", "dtype"), alternate_dtypes(list(EXTEND_CASES), list(GROUPS)))
def test_extend_attention(case, group, dtype):
    q_lens, kv_lens = EXTEND_CASES[case]
    meta, q, k, v, k_cache, v_cache = make_step(q_lens, kv_lens, GROUPS[group], dtype)
    store_kv(k, v, k_cache, v_cache, meta.out_locs)
    got = extend_attention(q, k, v, k_cache, v_cache, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                           max(q_lens), HEAD_DIM**-0.5)
    assert_close(got, reference(meta, q, k_cache, v_cache), dtype)


SPLITS = {
    "split_longer_than_request": dict(num_splits=4, min_split_len=64),  # every request fits in its first split
    "split_shorter_than_block": dict(num_splits=8, min_split_len=1),  # 37 keys -> splits of 5 < block of 16
    "default": dict(),
}


# The per-head kernel serves MHA (group 1); the grouped one serves GQA, and must also cover padding a
# block of 16 heads (group 2, 8) and more than one block per KV head (group 20).
KERNELS = ["per_head-group1", "per_head-group2", *(f"grouped-{g}" for g in GROUPS)]


@pytest.mark.parametrize(("split", "kernel", "dtype"), alternate_dtypes(list(SPLITS), KERNELS))
def test_decode_attention(split, kernel, dtype):
    grouped, group = kernel.startswith("grouped"), kernel.split("-")[1]
    meta, q, k, v, k_cache, v_cache = make_step([1, 1, 1], [37, 1, 12], GROUPS[group], dtype)
    store_kv(k, v, k_cache, v_cache, meta.out_locs)
    got = decode_attention(q, k_cache, v_cache, meta.kv_indptr, meta.kv_indices, HEAD_DIM**-0.5, block_n=16,
                           grouped=grouped, **SPLITS[split])
    assert_close(got, reference(meta, q, k_cache, v_cache), dtype)


WINDOW_CASES = {
    "decode": ([1, 1, 1], [6, 19, 40]),  # inside the window, past it, several windows past it
    "extend": ([17, 3, 20], [17, 21, 40]),  # two query blocks of a fresh prompt; chunks over cached prefixes
    "mixed": ([1, 9, 2, 1], [33, 9, 20, 2]),
}
WINDOW_OPTIONS = {"window": (7, None), "softcap": (None, 3.0), "both": (5, 2.0)}


@pytest.mark.parametrize(("case", "option", "dtype"), alternate_dtypes(list(WINDOW_CASES), list(WINDOW_OPTIONS)))
def test_windows_and_capped_scores(case, option, dtype):
    """The decode (split-KV, per-head and grouped) and extend kernels under a sliding window, Gemma 2's capped
    scores, or both, against the naive reference: splits cover only the window, a query block's rows each see
    their own window (some tiles wholly outside a row's window), over the cached prefix and the new tokens."""
    window, softcap = WINDOW_OPTIONS[option]
    q_lens, kv_lens = WINDOW_CASES[case]
    meta, q, k, v, k_cache, v_cache = make_step(q_lens, kv_lens, GROUPS["group2"], dtype, seed=3)
    q = q * 3  # scores large enough for the cap to matter
    store_kv(k, v, k_cache, v_cache, meta.out_locs)
    want = reference(meta, q, k_cache, v_cache, window, softcap)
    got = extend_attention(q, k, v, k_cache, v_cache, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                           max(q_lens), HEAD_DIM**-0.5, window=window, softcap=softcap)
    assert_close(got, want, dtype)
    if case == "decode":
        for grouped in (False, True):
            got = decode_attention(q, k_cache, v_cache, meta.kv_indptr, meta.kv_indices, HEAD_DIM**-0.5, block_n=16,
                                   num_splits=4, min_split_len=2, grouped=grouped, window=window, softcap=softcap)
            assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", ["decode", "mixed"])
def test_backend_matches_torch_backend(case, dtype):
    """The registered backend end to end (store + attention) equals the torch reference backend."""
    q_lens, kv_lens = EXTEND_CASES[case]
    meta, q, k, v, k_cache, v_cache = make_step(q_lens, kv_lens, GROUPS["group2"], dtype)
    outs, caches = [], []
    for name in ("torch", "triton"):
        backend = make_backend(name, "cpu")
        backend.setup(AttentionShape(*GROUPS["group2"], HEAD_DIM, dtype, HEAD_DIM**-0.5), torch.device("cpu"))
        kc, vc = k_cache.clone(), v_cache.clone()
        outs.append(backend.forward(q, k, v, kc, vc, backend.prepare(meta), HEAD_DIM**-0.5))
        caches.append((kc, vc))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert_close(outs[1], outs[0].float(), dtype)


@pytest.mark.parametrize(("case", "group"), [("decode", "group1"), ("decode", "group2"), ("mixed", "group2")])
def test_int8_pages_are_stored_and_read_as_the_torch_backend_does(case, group):
    """int8 pages (kernels/attention/int8_kv.py): the Triton backend writes the bytes the torch reference writes, and
    its decode (plain and grouped) and extend kernels attend over the rows as stored, this step's own included."""
    q_lens, kv_lens = EXTEND_CASES[case]
    meta, q, k, v, k_cache, v_cache = make_step(q_lens, kv_lens, GROUPS[group], torch.float32)
    k_rows, v_rows = quantize_keys(k_cache), quantize_rows(v_cache)
    outs, caches = [], []
    for name in ("torch", "triton"):
        backend = make_backend(name, "cpu")
        backend.setup(AttentionShape(*GROUPS[group], HEAD_DIM, torch.float32, HEAD_DIM**-0.5), torch.device("cpu"))
        kc, vc = k_rows.clone(), v_rows.clone()
        outs.append(backend.forward(q, k, v, kc, vc, backend.prepare(meta), HEAD_DIM**-0.5))
        caches.append((kc, vc))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert_close(outs[1], outs[0].float(), torch.float32)
    stored = (dequantize_rows(caches[1][0], HEAD_DIM), dequantize_rows(caches[1][1], HEAD_DIM))
    assert_close(outs[1], reference(meta, rotate_queries(q), *stored), torch.float32)  # keys stored rotated


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        make_backend("triton", "cpu")


def test_backend_choice():
    assert resolve_backend_name("auto", "cpu", "float32") == "cpu"  # the C kernels build here (gcc)
    assert resolve_backend_name("auto", "cpu", "bfloat16", cpu_kernels=False) == "torch"
    assert resolve_backend_name("auto", "cpu", "float16") == "torch"  # the C kernels take float32 and bf16
    with pytest.raises(ValueError, match="float32 or bfloat16 on the CPU"):
        resolve_backend_name("cpu", "cuda", "bfloat16")
    try:
        import flashinfer  # noqa: F401
        best = "flashinfer"
    except ImportError:
        best = "triton"
    assert resolve_backend_name("auto", "cuda", "bfloat16") == best
    assert resolve_backend_name("auto", "cuda", "float32") == "triton"  # FlashInfer has no fp32 kernels
    if best != "flashinfer":
        with pytest.raises(ValueError, match="flashinfer-python"):
            resolve_backend_name("flashinfer", "cuda", "bfloat16")
    else:
        with pytest.raises(ValueError, match="bfloat16 or float16"):
            resolve_backend_name("flashinfer", "cuda", "float32")
    with pytest.raises(ValueError, match="only on CUDA"):
        resolve_backend_name("flashinfer", "cpu")


def test_engine_with_triton_backend_matches_transformers(llama_ckpt, hf):
    """Greedy output through the Triton kernels equals transformers; a small prefill budget makes
    chunks extend cached prefixes and mixes decode steps between them. On a CPU, decode steps take the
    CUDA-graph path without capture (`cuda_graph` is on by default): static buffers, batches padded to
    a bucket (4 slots -> buckets 1, 2, 4: a step of 3 is padded) with dummy requests on the scratch KV location.
    (Eager Triton decode is covered by test_backend_matches_torch_backend.)"""
    llm = LLM(str(llama_ckpt), attention_backend="triton", max_prefill_tokens=12, page_size=4,
              max_running_requests=4)
    assert isinstance(llm.runner.backend, TritonBackend)
    assert llm.runner.graphs is not None and llm.runner.graphs.buckets == [1, 2, 4]
    assert_matches_hf(llm, llama_ckpt, hf, mixed_prompts(7, seed=5, max_len=20), max_tokens=5)


def test_graph_buckets():
    assert graph_buckets(1) == [1]
    assert graph_buckets(3) == [1, 2, 3]
    assert graph_buckets(8) == [1, 2, 4, 8]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert graph_buckets(64) == [1, 2, 4, *range(8, 65, 8)]
