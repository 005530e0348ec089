"""int8 KV pages (--kv-cache-dtype int8; kernels/attention/int8_kv.py): rows quantized once as they are written, read
as they are by the cpu and torch backends, moved by the prefix cache, retraction and the tiers as bytes.

Quantized pages cannot give transformers' tokens exactly, so what is asserted is what must hold exactly: a row reads
back within half its block's scale; the C store and the torch store write the same rows; every path over int8 pages
(a prefix-cache hit, a page from disk, a retraction, overlap) gives what a cold run over int8 pages gives, because
attention reads what the pool holds everywhere, a prompt's own keys included; a pool of the same bytes holds as many
more pages as the rows are smaller. The quality on the real model is tests/test_real_model.py's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from kernels.attention.int8_kv import (
    BLOCK,
    blocks,
    dequantize_rows,
    key_group,
    quantize_keys,
    quantize_rows,
    rotate,
    rotate_queries,
    row_bytes,
)
from kernels.cpu import load_cpu_kernels
from tests.checkpoints import FAMILIES
from tests.test_kv_tiers import greedy, hits, ids
from tests.test_retraction import OUT, crowd, tight
from tests.test_speculative import prompts as repeating


@pytest.mark.parametrize("head_dim", [8, 64, 96, 128])
def test_a_row_reads_back_within_half_its_blocks_scale(head_dim: int) -> None:
    x = torch.randn(50, 3, head_dim, generator=torch.Generator().manual_seed(head_dim)) * 3
    x[0, 0, 1] = 80.0  # an outlier: only its own block's values lose precision to it
    x[1, 2] = 0.0  # an all-zero row
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, row_bytes(head_dim))
    assert row_bytes(head_dim) == head_dim + 4 * (head_dim // BLOCK if head_dim % BLOCK == 0 else 1)
    back = dequantize_rows(rows, head_dim)
    per = x.reshape(50, 3, blocks(head_dim), -1)
    half_scale = (per.abs().amax(-1, keepdim=True) / 127 / 2).expand_as(per).reshape(x.shape)
    assert ((back - x).abs() <= half_scale * (1 + 1e-6) + 1e-30).all()
    assert torch.equal(back[1, 2], torch.zeros(head_dim))
    if head_dim >= 2 * BLOCK:  # the outlier's block alone is coarse
        assert (back[0, 0, BLOCK:] - x[0, 0, BLOCK:]).abs().max() < 3 * 3 / 127


@pytest.mark.parametrize("head_dim", [16, 64, 96])
def test_the_c_kernel_stores_and_reads_the_rows_the_torch_reference_does(head_dim: int) -> None:
    """paged_attention with new keys and values writes the int8 rows quantize_keys and quantize_rows write, bit for
    bit (the keys rotated by the same butterflies), and attends over them as the reference attends over their
    dequantized values with its queries turned alike."""
    kernels = load_cpu_kernels()
    g = torch.Generator().manual_seed(head_dim)
    tokens, heads, kv_heads, slots = 6, 4, 2, 32
    q, k, v = (torch.randn(tokens, h, head_dim, generator=g) for h in (heads, kv_heads, kv_heads))
    k_cache = torch.zeros(slots, kv_heads, row_bytes(head_dim), dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    out_locs = torch.tensor([3, 9, 10, 11, 20, 21])
    table = torch.tensor([[3, 9, 10, 11, 20, 21]])
    rows, kv_lens = torch.zeros(tokens, dtype=torch.int64), torch.arange(1, tokens + 1)
    out = kernels.paged_attention(q, k_cache, v_cache, table, rows, kv_lens, 0.25, new=(k, v, out_locs))
    assert torch.equal(k_cache[out_locs], quantize_keys(k)) and torch.equal(v_cache[out_locs], quantize_rows(v))
    keys, values = dequantize_rows(k_cache[out_locs], head_dim), dequantize_rows(v_cache[out_locs], head_dim)
    group, turned = heads // kv_heads, rotate_queries(q)
    for t in range(tokens):
        scores = torch.einsum("hd,khd->hk", turned[t], keys[: t + 1].repeat_interleave(group, 1)) * 0.25
        expected_out = torch.einsum("hk,khd->hd", scores.softmax(-1), values[: t + 1].repeat_interleave(group, 1))
        assert torch.allclose(out[t], expected_out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [8, 64, 96, 128])
def test_keys_are_stored_rotated_and_attend_as_the_keys_do(head_dim: int) -> None:
    """A key row is stored times the Walsh-Hadamard matrix of its groups (of the largest power of two dividing
    head_dim), which spreads a large channel over the group: rotated back it is the key within the quantization
    error, and a rotated query's dot product with it is the query's with the key. With an outlier channel, as real
    keys have, the rotated rows read back closer than rows stored as they are."""
    g = torch.Generator().manual_seed(head_dim)
    k, q = torch.randn(200, 2, head_dim, generator=g), torch.randn(200, 2, head_dim, generator=g)
    k[..., 1] *= 30  # one large channel in every key
    size = key_group(head_dim)
    assert size == {8: 8, 64: 64, 96: 32, 128: 128}[head_dim]
    assert torch.allclose(rotate(rotate(k)) / size, k, atol=1e-4)  # H H = size I
    back = rotate(dequantize_rows(quantize_keys(k), head_dim)) / size
    plain = dequantize_rows(quantize_rows(k), head_dim)
    assert (back - k).pow(2).mean() < 0.5 * (plain - k).pow(2).mean()
    exact = (q * k).sum(-1)
    assert torch.allclose((rotate_queries(q) * rotate(k)).sum(-1), exact, atol=1e-3, rtol=1e-4)
    assert (rotate_queries(q) * dequantize_rows(quantize_keys(k), head_dim)).sum(-1).sub(exact).abs().mean() < \
        (q * plain).sum(-1).sub(exact).abs().mean()


def test_the_same_bytes_hold_as_many_more_pages_as_the_rows_are_smaller(llama_ckpt: Path) -> None:
    pools = {kv: LLM(str(llama_ckpt), kv_memory_gb=0.002, max_running_requests=64, kv_cache_dtype=kv, kv_disk_gib=0)
             for kv in ("auto", "int8")}
    head_dim = pools["auto"].model.spec.head_dim
    ratio = head_dim * 4 / row_bytes(head_dim)
    assert pools["int8"].num_pages == int(pools["auto"].num_pages * ratio) or \
        abs(pools["int8"].num_pages / pools["auto"].num_pages - ratio) < 0.01
    assert pools["int8"].kv.page_bytes * ratio == pytest.approx(pools["auto"].kv.page_bytes)
    stats = pools["int8"].stats().pages
    assert (stats.dtype, stats.page_bytes) == ("int8", pools["int8"].kv.page_bytes)
    assert pools["auto"].stats().pages.dtype == "float32"


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_every_path_over_int8_pages_gives_the_cold_runs_tokens(llama_ckpt: Path, tmp_path: Path, backend: str) -> None:
    """A prefix-cache hit, the same prompt after a restart from the disk tier, and a retraction in a tight pool all
    give the tokens a cold int8 run gives; a float32 engine on the same disk directory loads none of the int8 pages
    (the fingerprint names the KV dtype)."""
    prompt = ids(70, 1)
    options = {"attention_backend": backend, "kv_cache_dtype": "int8", "kv_cache_dir": str(tmp_path)}
    with LLM(str(llama_ckpt), **options) as cold:
        first = cold.generate([prompt], greedy(12))[0].token_ids
        again = cold.generate([prompt + first[:4]], greedy(8))[0]
        assert again.usage.cached_tokens > 0
        assert again.token_ids == first[4:]  # over the cached int8 prefix: what the cold run went on with
        cold.check_integrity()
    with LLM(str(llama_ckpt), **options) as restarted:
        from_disk = restarted.generate([prompt], greedy(12))[0]
        assert hits(restarted).hit_tokens_disk > 0 and from_disk.token_ids == first
    with LLM(str(llama_ckpt), attention_backend=backend, kv_cache_dir=str(tmp_path)) as float_pages:
        float_pages.generate([prompt], greedy(2))
        assert hits(float_pages).hit_tokens_disk == 0
    # a crowd in a pool it outgrows: retractions, each request resuming from the tokens it kept
    prompts = crowd()
    with tight(llama_ckpt, attention_backend=backend, kv_cache_dtype="int8", kv_disk_gib=0) as squeezed:
        outs = squeezed.generate(prompts, SamplingParams(max_tokens=OUT))
        assert squeezed.stats().counters.retractions >= 3
        squeezed.check_integrity()
    with LLM(str(llama_ckpt), attention_backend=backend, kv_cache_dtype="int8", page_size=4, kv_disk_gib=0) as roomy:
        assert [o.token_ids for o in outs] == [o.token_ids for o in roomy.generate(prompts, SamplingParams(
            max_tokens=OUT))]


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-4), ("bfloat16", 0.05)])
def test_the_cpu_and_torch_backends_agree_over_int8_pages(llama_ckpt: Path, dtype: str, tolerance: float) -> None:
    """Both read the same stored rows as float32 values: their greedy tokens agree, and their log-probabilities to
    float32 summation. With bfloat16 activations the two round differently elsewhere (a bf16 logit's step here is
    about 0.016), so where they part it is at a near-tie of both runs' top two."""
    prompts = [ids(30, 5), ids(9, 6)]
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2)
    outs = [LLM(str(llama_ckpt), dtype=dtype, attention_backend=b, kv_cache_dtype="int8",
                kv_disk_gib=0).generate(prompts, params) for b in ("cpu", "torch")]
    for a, b in zip(*outs, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y), 10)
        assert [p.logprob for p in a.logprobs[:same]] == pytest.approx([p.logprob for p in b.logprobs[:same]],
                                                                       abs=tolerance)
        if same < 10:
            assert dtype == "bfloat16", (a.token_ids, b.token_ids)
            top = {token: value for token, _, value in a.logprobs[same].top}
            assert top[a.token_ids[same]] - top[b.token_ids[same]] <= tolerance, (same, top)


@pytest.mark.parametrize(("options", "message"), [
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype 'fp8'"),
    ({"kv_cache_dtype": "bfloat16"}, "kv_cache_dtype 'bfloat16' with dtype 'float32'"),
    ({"kv_cache_dtype": "int4"}, "kv_cache_dtype"),
])
def test_what_cannot_be_honoured_is_refused_naming_it(llama_ckpt: Path, options: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(str(llama_ckpt), **options)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_runs_on_int8_pages_alike_on_both_backends(checkpoints, family: str) -> None:
    """Every family (windows, capped scores, per-head norms, experts) on int8 pages: the C kernel and the torch
    reference attend over the same stored rows, so they decode the same tokens, and nothing is left held."""
    prompts = [ids(37, 7), ids(12, 8)]
    outs = []
    for backend in ("cpu", "torch"):
        with LLM(str(checkpoints[family]), attention_backend=backend, kv_cache_dtype="int8", kv_disk_gib=0,
                 max_prefill_tokens=16) as llm:
            assert llm.kv.dtype_name == "int8"
            outs.append([o.token_ids for o in llm.generate(prompts, greedy(10))])
            llm.check_integrity()
    assert outs[0] == outs[1]


def test_the_triton_kernels_decode_what_the_torch_reference_decodes_over_int8_pages(checkpoints) -> None:
    """Triton (under the interpreter here) over int8 pages: the backend quantizes as it stores (the fused RoPE kernel
    stores nothing then), its decode and extend kernels read the rows as stored, and the CUDA-graph decode path
    (padded, uncaptured on a CPU) too: the torch reference's tokens, on a model with query-key norms (Qwen3)."""
    prompts = [ids(21, 3), ids(9, 4)]
    outs = []
    for backend in ("torch", "triton"):
        with LLM(str(checkpoints["qwen3"]), attention_backend=backend, kv_cache_dtype="int8", kv_disk_gib=0,
                 max_prefill_tokens=8, page_size=4, max_running_requests=2) as llm:
            assert llm.kv.dtype_name == "int8"
            outs.append([o.token_ids for o in llm.generate(prompts, greedy(6))])
            llm.check_integrity()
    assert outs[0] == outs[1]


def test_speculation_and_two_ranks_over_int8_pages(llama_ckpt: Path) -> None:
    """Speculative decoding (drafts' rows written, rejected ones rolled back and written again) and two tensor-parallel
    ranks (each quantizing its own KV heads' rows) decode what one plain rank decodes over int8 pages."""
    prompts = repeating()  # phrases repeated, which prompt lookup proposes to continue
    plain = LLM(str(llama_ckpt), kv_cache_dtype="int8", kv_disk_gib=0).generate(prompts, greedy(16))
    expected = [o.token_ids for o in plain]
    with LLM(str(llama_ckpt), kv_cache_dtype="int8", kv_disk_gib=0, speculative="ngram",
             speculative_adaptive=False) as spec:
        assert [o.token_ids for o in spec.generate(prompts, greedy(16))] == expected
        assert spec.stats().counters.spec_drafts > 0
    with LLM(str(llama_ckpt), kv_cache_dtype="int8", tensor_parallel_size=2) as ranks:
        assert ranks.kv.dtype_name == "int8"
        assert [o.token_ids for o in ranks.generate(prompts, greedy(16))] == expected
