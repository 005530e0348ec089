"""GPU-only checks (run by scripts/gpu_check.sh): compiled Triton kernels and FlashInfer against the
naive reference at real head sizes, and token-exact greedy output on CUDA with every backend, CUDA
graphs on and off. Skipped with a reason where there is no CUDA device."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from kernels.attention import build_metadata, make_backend
from kernels.triton.activation import gated_activation
from kernels.triton.decode import decode_attention
from kernels.triton.extend import extend_attention
from kernels.triton.kv_store import store_kv
from kernels.triton.moe import fused_moe
from kernels.triton.norm import add_rms_norm
from tests.test_attention import naive_attention
from tests.test_engine_correctness import assert_matches_hf, mixed_prompts
from tests.test_moe import reference_moe
from tests.test_triton_fused import EPS, assert_within_an_ulp, check_rope_store_kv, hf_rms_norm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="compiled Triton needs TRITON_INTERPRET=0 (scripts/gpu_check.sh sets it)"),
]

try:
    import flashinfer  # noqa: F401

    HAVE_FLASHINFER = True
except ImportError:
    HAVE_FLASHINFER = False
needs_flashinfer = pytest.mark.skipif(not HAVE_FLASHINFER, reason="flashinfer-python is not installed")

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
CASES = {
    "decode": ([1] * 9, [1, 700, 33, 64, 65, 129, 5, 1000, 17]),
    "prefill": ([100, 1, 37, 300], [100, 1, 37, 300]),
    "mixed": ([1, 60, 1, 250, 3], [900, 260, 2, 250, 40]),
}
HEADS = {"mha": (8, 8, 128), "qwen0.5b": (14, 2, 64), "gqa8": (32, 4, 128), "gqa20": (20, 1, 64)}


def make_step(q_lens, kv_lens, heads, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hq, hkv, d = heads
    rows_total, max_len = len(q_lens) + 2, max(kv_lens) + 8
    slots = rows_total * max_len + 64

    def rand(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(dtype)

    table = torch.randperm(slots, generator=g, device="cuda")[: rows_total * max_len].view(rows_total, max_len)
    rows = torch.randperm(rows_total, generator=g, device="cuda")[: len(q_lens)]
    t = sum(q_lens)
    meta = build_metadata(q_lens, kv_lens, rows, table.contiguous())
    return meta, rand(t, hq, d), rand(t, hkv, d), rand(t, hkv, d), rand(slots, hkv, d), rand(slots, hkv, d)


def reference(meta, q, k_cache, v_cache, window=None, softcap=None):
    """The naive per-request attention, in fp32 on the CPU."""
    return naive_attention(q.float().cpu(), k_cache.float().cpu(), v_cache.float().cpu(), meta.table.cpu(),
                           meta.rows.cpu(), meta.q_lens, meta.kv_lens, q.shape[-1] ** -0.5, window, softcap)


def check(got, want, dtype):
    torch.testing.assert_close(got.float().cpu(), want.cpu(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_triton_kernels(case, heads, dtype):
    q_lens, kv_lens = CASES[case]
    meta, q, k, v, k_cache, v_cache = make_step(q_lens, kv_lens, HEADS[heads], dtype)
    store_kv(k, v, k_cache, v_cache, meta.out_locs)
    assert torch.equal(k_cache[meta.out_locs], k)
    want = reference(meta, q, k_cache, v_cache)
    scale = q.shape[-1] ** -0.5
    check(extend_attention(q, k, v, k_cache, v_cache, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                           max(q_lens), scale), want, dtype)
    if case == "decode":
        for grouped in (False, True):
            check(decode_attention(q, k_cache, v_cache, meta.kv_indptr, meta.kv_indices, scale, grouped=grouped),
                  want, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_windows_and_capped_scores(case, dtype):
    """Sliding windows (Mistral's 4096 would not bite here: 96) and Gemma 2's capped scores, compiled."""
    q_lens, kv_lens = CASES[case]
    meta, q, k, v, k_cache, v_cache = make_step(q_lens, kv_lens, HEADS["gqa8"], dtype)
    store_kv(k, v, k_cache, v_cache, meta.out_locs)
    scale = q.shape[-1] ** -0.5
    for window, softcap in ((96, None), (None, 30.0), (40, 20.0)):
        want = reference(meta, q, k_cache, v_cache, window, softcap)
        check(extend_attention(q, k, v, k_cache, v_cache, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                               max(q_lens), scale, window=window, softcap=softcap), want, dtype)
        if case == "decode":
            for grouped in (False, True):
                check(decode_attention(q, k_cache, v_cache, meta.kv_indptr, meta.kv_indices, scale, grouped=grouped,
                                       window=window, softcap=softcap), want, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 32, 700])
def test_compiled_fused_moe(tokens, dtype):
    """The fused MoE at Qwen3-30B-A3B's expert shapes (128 experts of 768 rows over 2048, 8 per token)."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    e, inter, hidden, k = 128, 768, 2048, 8
    h = torch.randn(tokens, hidden, generator=g, device="cuda").to(dtype)
    w1 = (torch.randn(e, 2 * inter, hidden, generator=g, device="cuda") * 0.02).to(dtype)
    w2 = (torch.randn(e, hidden, inter, generator=g, device="cuda") * 0.02).to(dtype)
    weights, experts = torch.topk(torch.softmax(torch.randn(tokens, e, generator=g, device="cuda"), -1), k, -1)
    got = fused_moe(h, w1, w2, weights.to(dtype), experts)
    rows = range(min(tokens, 8))  # the reference is a loop: a few tokens of it
    want = reference_moe(h[rows].float().cpu(), w1.float().cpu(), w2.float().cpu(), weights[rows].cpu(),
                         experts[rows].cpu(), "silu")
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got[rows].double().cpu(), want, atol=tol, rtol=tol)


FUSED_SHAPES = {"qwen0.5b": (896, 4864, 14, 2, 64), "llama8b": (4096, 14336, 32, 8, 128)}
"""hidden size, intermediate size, query heads, KV heads, head_dim"""


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", list(FUSED_SHAPES))
def test_compiled_fused_kernels(shape, dtype):
    """The fused kernels compiled (kernels/triton/norm.py, rope.py, activation.py) against transformers' ops on
    the GPU: the residual sum and RoPE bit for bit (which also shows no multiply-add was contracted into an
    FMA), the stores exact; in fp32 the norms and SiLU within a few ulps (the GPU's rsqrt and exp are not
    torch's), in half precision within an ulp."""
    hidden, inter, hq, hkv, d = FUSED_SHAPES[shape]
    tokens, slots, max_pos = 300, 1000, 4096
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(dtype)

    def check(got, want):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert_within_an_ulp(got, want)

    x, residual, weight = rand(tokens, hidden), rand(tokens, hidden), rand(hidden)
    out, total = add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(total, residual + x)
    check(out, hf_rms_norm(total, weight))
    positions = torch.randint(0, max_pos, (tokens,), generator=g, device="cuda")
    out_locs = torch.randperm(slots, generator=g, device="cuda")[:tokens]
    for qk_norm in (None, (rand(d), rand(d))):
        check_rope_store_kv(rand(tokens, (hq + 2 * hkv) * d), (hq, hkv), positions, rand(slots, hkv, d),
                            rand(slots, hkv, d), out_locs, qk_norm, max_pos)
    gate_up = rand(tokens, 2 * inter) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    check(gated_activation(gate_up), F.silu(gate) * up)


@needs_flashinfer
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", ["qwen0.5b", "gqa8"])
@pytest.mark.parametrize("case", list(CASES))
def test_flashinfer_backend(case, heads, dtype):
    from kernels.attention import AttentionShape

    q_lens, kv_lens = CASES[case]
    meta, q, k, v, k_cache, v_cache = make_step(q_lens, kv_lens, HEADS[heads], dtype)
    hq, hkv, d = HEADS[heads]
    backend = make_backend("flashinfer", "cuda", "bfloat16")
    backend.setup(AttentionShape(hq, hkv, d, dtype, d**-0.5), torch.device("cuda"))
    got = backend.forward(q, k, v, k_cache, v_cache, backend.prepare(meta), d**-0.5)
    # FlashInfer rounds the softmax weights to the storage dtype before multiplying by V.
    torch.testing.assert_close(got.float().cpu(), reference(meta, q, k_cache, v_cache), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sequential"])
@pytest.mark.parametrize("cuda_graph", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_greedy_matches_transformers_on_cuda(checkpoints, hf, backend, cuda_graph, overlap):
    """fp32 on the GPU (Triton's dots in ieee precision, and on that backend the fused kernels) must still
    pick transformers' CPU tokens; 10 slots
    give buckets 1, 2, 4, 8, 10, so decode batches are padded as requests finish; with overlap the next
    step's input ids come from the device token table while the host processes the previous step."""
    path = checkpoints["qwen2"]
    llm = LLM(str(path), device="cuda", attention_backend=backend, cuda_graph=cuda_graph, overlap=overlap,
              max_running_requests=10, max_prefill_tokens=64)
    assert (llm.runner.graphs is not None) == (cuda_graph and backend != "torch")
    assert_matches_hf(llm, path, hf, mixed_prompts(16, seed=7), max_tokens=12)


@pytest.mark.parametrize("cuda_graph", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "gemma2", "gemma3", "mistral_window"])
def test_new_families_on_cuda(checkpoints, hf, family, cuda_graph):
    """The fused MoE (captured in decode graphs), Gemma's norms, GELU and caps, sliding windows with page release,
    fp32 on the Triton backend: transformers' CPU tokens."""
    path = checkpoints[family]
    llm = LLM(str(path), device="cuda", attention_backend="auto", cuda_graph=cuda_graph, max_running_requests=10,
              max_prefill_tokens=64)
    assert llm.runner.backend.name == "triton"
    assert_matches_hf(llm, path, hf, mixed_prompts(16, seed=7), max_tokens=12)


@needs_flashinfer
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sequential"])
def test_flashinfer_engine_graphs_match_eager(checkpoints, overlap):
    """FlashInfer has no fp32 kernels, so transformers' fp32 tokens are out of reach; in bf16 the graphed
    decode (a CUDA-graph wrapper over the static buffers) must pick the same tokens as the eager one."""
    path = checkpoints["qwen2"]
    prompts = mixed_prompts(16, seed=7)
    outputs = []
    for cuda_graph in (True, False):
        llm = LLM(str(path), device="cuda", dtype="bfloat16", attention_backend="flashinfer", cuda_graph=cuda_graph,
                  overlap=overlap, max_running_requests=10, max_prefill_tokens=64)
        outputs.append([o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12))])
        llm.check_integrity()
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gguf_block_weights_on_cuda(tmp_path, dtype):
    """A GGUF file of every format on the GPU: its blocks as int8 + scales through the Triton weight-only kernel,
    against the same file expanded to dense weights (`dequantize`, cuBLAS): the same greedy tokens nearly always
    (the kernel dequantizes exactly and accumulates in float32)."""
    from tests.checkpoints import make_checkpoint
    from tests.gguf_files import write_gguf
    from tests.test_gguf import EVERY_TYPE, SHAPE

    src = make_checkpoint("qwen2", tmp_path / "qwen2", seed=3, **SHAPE)
    path = str(write_gguf(src, tmp_path / "mix.gguf", "qwen2", EVERY_TYPE))
    prompts = mixed_prompts(6, seed=4)
    blocks = LLM(path, device="cuda", dtype=dtype)
    assert "Triton weight-only" in blocks.execution["gemm"]
    ours = [o.token_ids for o in blocks.generate(prompts, SamplingParams(max_tokens=16))]
    dense = [o.token_ids for o in LLM(path, device="cuda", dtype=dtype, dequantize=True).generate(
        prompts, SamplingParams(max_tokens=16))]
    same = sum(a == b for a, b in zip(ours, dense, strict=True))
    assert same >= len(prompts) - 1, (ours, dense)


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
def test_kv_tiers_on_cuda(llama_ckpt, hf, tmp_path, overlap):
    """The pinned host tier and the disk tier: a prefix the pool evicted comes back from host memory, and after a
    restart from disk, with the cold run's tokens (and transformers') and bitwise its KV."""
    from tests.test_kv_tiers import hits, ids, kv_of, run

    prompt = ids(90, 1)
    options = {"device": "cuda", "attention_backend": "triton", "overlap": overlap}
    with LLM(str(llama_ckpt), kv_disk_gib=0, kv_host_gib=0, **options) as cold_engine:
        cold, fresh = run(cold_engine, prompt), kv_of(cold_engine, prompt)
    hf.check_greedy(cold, llama_ckpt, prompt, 8)
    with LLM(str(llama_ckpt), kv_cache_dir=str(tmp_path), kv_host_gib=1 / 1024, num_pages=16, **options) as llm:
        assert [t.name for t in llm.stats().pages.tiers] == ["host", "disk"]
        assert llm.cache.tiers.host.buffer.is_pinned()
        assert run(llm, prompt) == cold
        for seed in range(4):
            run(llm, ids(90, 10 + seed))
        assert run(llm, prompt) == cold and hits(llm).hit_tokens_host == 80
        assert torch.equal(kv_of(llm, prompt), fresh)
        llm.check_integrity()
    with LLM(str(llama_ckpt), kv_cache_dir=str(tmp_path), **options) as restarted:  # a default host tier, empty
        assert [t.name for t in restarted.stats().pages.tiers] == ["host", "disk"]
        assert run(restarted, prompt) == cold and hits(restarted).hit_tokens_disk == 80
        assert torch.equal(kv_of(restarted, prompt), fresh)
        restarted.check_integrity()
