"""The GPU path's fused Triton kernels (residual add + RMSNorm, q/k norm + RoPE + KV store, SiLU or GELU * up)
under the interpreter (TRITON_INTERPRET=1, set in conftest) against transformers' own ops, and the engine
on the Triton backend, which runs them, token-identical to transformers.

Odd tiny shapes keep the interpreter fast and catch kernels that assume powers of two. Products and sums
that both sides round once are compared bit for bit; a norm's sum of squares is added in another order
than torch's, which can move its fp32 scale by an ulp, so normalised values are compared within one ulp
of the dtype (and mostly equal).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm, apply_rotary_pos_emb

from engine import LLM, SamplingParams
from engine.model.executor import LayerByLayer
from engine.model.layer_ops import EagerOps, LayerKernels, TritonOps
from kernels.attention import build_metadata, make_backend
from kernels.attention.base import AttentionShape
from kernels.attention.triton import TritonBackend
from kernels.triton.activation import gated_activation
from kernels.triton.norm import add_rms_norm
from kernels.triton.rope import rope_store_kv
from tests.test_engine_correctness import assert_matches_hf, mixed_prompts

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOKENS = [1, 5, 17]
HEAD_DIM, MAX_POS, EPS = 16, 64, 1e-6


def assert_within_an_ulp(got: torch.Tensor, want: torch.Tensor, of: torch.Tensor | None = None) -> None:
    """Equal to within one unit in the last place of the dtype, at the magnitude `of` (default: each element of
    `want`); in half precision also equal in most elements (rounding one way too often would move half of them)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    magnitude = want.float().abs() if of is None else of
    assert ((got.float() - want.float()).abs() <= torch.finfo(want.dtype).eps * magnitude + 1e-6).all()
    if want.dtype != torch.float32:  # in fp32 an ulp of a row's scale moves the whole row
        assert (got == want).float().mean() > 0.9


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    norm = Gemma3RMSNorm(x.shape[-1], eps=EPS).to(x.dtype)
    norm.weight.data = weight
    with torch.no_grad():
        return norm(x)


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    norm = Qwen2RMSNorm(x.shape[-1], eps=EPS).to(x.dtype)
    norm.weight.data = weight
    with torch.no_grad():
        return norm(x)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", [24, 40])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first_layer"])
def test_add_rms_norm(with_residual, hidden, tokens, dtype):
    """transformers' layer: `residual + x` in the model dtype (bit for bit), then its RMSNorm."""
    g = torch.Generator().manual_seed(hidden + tokens)
    wide = torch.randn(tokens, hidden + 8, generator=g).to(dtype)
    x = wide[:, 3 : 3 + hidden]  # rows with a stride, as a slice of a wider tensor
    residual = torch.randn(tokens, hidden, generator=g).to(dtype) if with_residual else None
    weight = torch.randn(hidden, generator=g).to(dtype)
    out, total = add_rms_norm(x, residual, weight, EPS)
    want_total = x if residual is None else residual + x
    assert torch.equal(total, want_total)
    assert_within_an_ulp(out, hf_rms_norm(want_total, weight))


def rope_table(dtype: torch.dtype, head_dim: int, max_pos: int,
               device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cos and sin as transformers uses them ([positions, D] in the model dtype), and the model's table
    (cos, signed sin) that the kernel reads."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    freqs = torch.arange(max_pos, device=device).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    half = head_dim // 2
    signed_sin = torch.cat((-emb.sin()[:, :half], emb.sin()[:, half:]), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype), torch.stack((emb.cos(), signed_sin)).to(dtype)


def check_rope_store_kv(qkv: torch.Tensor, heads: tuple[int, int], positions: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, out_locs: torch.Tensor,
                        qk_norm: tuple[torch.Tensor, torch.Tensor] | None, max_pos: int, gemma: bool = False) -> None:
    """`rope_store_kv` against transformers (Qwen3's q/k norm when `qk_norm`, Gemma 3's with `gemma`, then
    `apply_rotary_pos_emb`): RoPE alone bit for bit; k and v in the pool at `out_locs` and nothing else there
    touched."""
    (tokens, width), (hq, hkv) = qkv.shape, heads
    dim = width // (hq + 2 * hkv)
    cos, sin, table = rope_table(qkv.dtype, dim, max_pos, qkv.device)
    q_in, k_in, v_in = qkv.split([hq * dim, hkv * dim, hkv * dim], dim=-1)
    q_in, k_in, v_ref = q_in.view(tokens, hq, dim), k_in.view(tokens, hkv, dim), v_in.reshape(tokens, hkv, dim).clone()
    if qk_norm is not None:
        norm = gemma_rms_norm if gemma else hf_rms_norm
        q_in, k_in = norm(q_in, qk_norm[0]), norm(k_in, qk_norm[1])
    # transformers' layout: [batch, heads, tokens, D], cos/sin [batch, tokens, D]
    q_ref, k_ref = apply_rotary_pos_emb(q_in.transpose(0, 1)[None], k_in.transpose(0, 1)[None],
                                        cos[positions][None], sin[positions][None])
    q_ref, k_ref = q_ref[0].transpose(0, 1), k_ref[0].transpose(0, 1)
    kc, vc = k_cache.clone(), v_cache.clone()

    gains = qk_norm if qk_norm is None or not gemma else (1.0 + qk_norm[0].float(), 1.0 + qk_norm[1].float())
    q, k, v = rope_store_kv(qkv, hq, hkv, positions, table, kc, vc, out_locs, gains, EPS, round_normed=not gemma)
    for view in (q, k, v):
        assert view.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()  # rotated in place
    if qk_norm is not None:  # RoPE sums two products of normalised values, each maybe an ulp or two off
        assert_within_an_ulp(q, q_ref, of=4 * q_in.float().abs().amax(-1, keepdim=True))
        assert_within_an_ulp(k, k_ref, of=4 * k_in.float().abs().amax(-1, keepdim=True))
    else:
        assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert torch.equal(v, v_ref)
    assert torch.equal(kc[out_locs], k) and torch.equal(vc[out_locs], v)
    untouched = torch.ones(k_cache.shape[0], dtype=torch.bool, device=k_cache.device)
    untouched[out_locs] = False
    assert torch.equal(kc[untouched], k_cache[untouched]) and torch.equal(vc[untouched], v_cache[untouched])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("heads", [(3, 1), (2, 2)], ids=["gqa3", "mha2"])
@pytest.mark.parametrize("qk_norm", ["rope", "qk_norm", "gemma_qk_norm"])
def test_rope_store_kv(qk_norm, heads, tokens, dtype):
    """At random positions, into permuted slots of a pool a few tokens larger than the step."""
    g = torch.Generator().manual_seed(tokens)
    hq, hkv = heads
    slots = 2 * tokens + 3

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    weights = (rand(HEAD_DIM), rand(HEAD_DIM)) if qk_norm != "rope" else None
    positions = torch.randint(0, MAX_POS, (tokens,), generator=g)
    out_locs = torch.randperm(slots, generator=g)[:tokens]
    check_rope_store_kv(rand(tokens, (hq + 2 * hkv) * HEAD_DIM), heads, positions, rand(slots, hkv, HEAD_DIM),
                        rand(slots, hkv, HEAD_DIM), out_locs, weights, MAX_POS, gemma=qk_norm == "gemma_qk_norm")


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("size", [24, 40])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_activation(activation, size, tokens, dtype):
    """transformers' MLP activations, F.silu(gate) * up and Gemma's F.gelu(gate, approximate="tanh") * up in the
    model dtype: the fp32 activation may differ from torch's by an ulp or two (another exp, tanh from exp), which
    the half-precision rounding hides unless it lands on a tie."""
    g = torch.Generator().manual_seed(size + tokens)
    gate_up = (torch.randn(tokens, 2 * size, generator=g) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    want = (F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")) * up
    got = gated_activation(gate_up, activation)
    if activation == "gelu_tanh":  # for large negative gates 1 + tanh cancels, in torch's GELU as in ours: the
        # tiny values there differ by more than their own ulp, so an ulp of the values' magnitude bounds them
        bound = 8 * torch.finfo(dtype).eps * float(want.float().abs().max())
        assert got.dtype == want.dtype and ((got.float() - want.float()).abs() <= bound).all()
    elif dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=4 * torch.finfo(dtype).eps, atol=1e-6)
    else:
        assert_within_an_ulp(got, want)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_gemma_norm_rounds_once(dtype):
    """Gemma's RMSNorm, normalised and scaled by (1 + weight) in float32 and rounded once (`round_normed` off,
    the weight given as 1 + weight in float32), against transformers' Gemma2RMSNorm, after the residual add."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    g = torch.Generator().manual_seed(7)
    x, residual = (torch.randn(5, 40, generator=g).to(dtype) for _ in range(2))
    weight = (torch.randn(40, generator=g) * 0.5).to(dtype)
    norm = Gemma2RMSNorm(40, eps=EPS).to(dtype)
    norm.weight.data = weight
    with torch.no_grad():
        want = norm(residual + x)
    out, total = add_rms_norm(x, residual, 1.0 + weight.float(), EPS, round_normed=False)
    assert torch.equal(total, residual + x)
    assert_within_an_ulp(out, want)


STEPS = {"decode": ([1, 1], [9, 4]), "mixed": ([1, 4, 3], [9, 7, 3])}  # (q_lens, kv_lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("step", list(STEPS))
def test_backend_attends_over_what_the_fused_kernel_stored(step, dtype):
    """`TritonBackend.attend` (no store) over a pool that `rope_store_kv` filled, with q/k/v as strided views
    of the projection output, equals the torch backend storing and attending itself: a decode step (split-KV
    kernels, reading the pool only) and a mixed one (decode tokens, a chunk over a cached prefix, a fresh
    prompt: the extend kernel, reading the pool and this step's k/v)."""
    g = torch.Generator().manual_seed(0)
    hq, hkv = 4, 2
    q_lens, kv_lens = STEPS[step]
    table = torch.randperm(64, generator=g)[:48].view(4, 12)
    meta = build_metadata(q_lens, kv_lens, torch.tensor([2, 0, 3])[: len(q_lens)], table)
    tokens = sum(q_lens)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * HEAD_DIM, generator=g).to(dtype)
    k_cache = torch.randn(64, hkv, HEAD_DIM, generator=g).to(dtype)
    v_cache = torch.randn(64, hkv, HEAD_DIM, generator=g).to(dtype)
    positions = torch.cat([torch.arange(kv - q, kv) for q, kv in zip(q_lens, kv_lens, strict=True)])
    kc, vc = k_cache.clone(), v_cache.clone()
    q, k, v = rope_store_kv(qkv, hq, hkv, positions, rope_table(dtype, HEAD_DIM, MAX_POS)[2], kc, vc, meta.out_locs)
    scale = HEAD_DIM**-0.5
    shape = AttentionShape(hq, hkv, HEAD_DIM, dtype, scale)
    triton_backend, torch_backend = TritonBackend(), make_backend("torch", "cpu")
    triton_backend.setup(shape, torch.device("cpu"))
    torch_backend.setup(shape, torch.device("cpu"))
    got = triton_backend.attend(q, k, v, kc, vc, triton_backend.prepare(meta), scale)
    want = torch_backend.forward(q.contiguous(), k.contiguous(), v.contiguous(), k_cache, v_cache,
                                 torch_backend.prepare(meta), scale)
    assert torch.equal(kc, k_cache) and torch.equal(vc, v_cache)  # the fused kernel stored what torch stores
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "gemma2", "gemma3", "mistral_window"])
def test_engine_runs_the_fused_kernels_and_matches_transformers(checkpoints, hf, family):
    """On the Triton backend the model takes the fused path (its residual adds inside the next norm, RoPE
    and the KV store in one kernel, the backend attending without storing): greedy output token-identical
    to transformers, with Qwen3's q/k norms, Qwen2's q/k/v bias and tied embeddings, Gemma's (1 + weight) norms
    around both halves, GELU, capped scores (Gemma 2) and two RoPE bases (Gemma 3), sliding windows on some
    layers or all (prompts past the window of 12), chunked prefill over cached prefixes and CUDA-graph-padded
    decode (run without capture on a CPU)."""
    path = checkpoints[family]
    llm = LLM(str(path), attention_backend="triton", max_prefill_tokens=12, page_size=4, max_running_requests=4)
    assert_matches_hf(llm, path, hf, mixed_prompts(5, seed=3, max_len=20), max_tokens=4)
    executor = llm.model.executor
    assert isinstance(executor, LayerByLayer) and isinstance(executor.final, TritonOps)
    assert all(ops is executor.final for ops in executor.ops) and executor.final.backend is llm.runner.backend


def prefill_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    llm.add_request(prompt, SamplingParams(max_tokens=1))
    batch = llm.scheduler.schedule()
    assert batch is not None
    return llm.runner.forward(batch)


def test_fused_path_rounds_as_the_eager_path_in_bf16(checkpoints):
    """bf16 with bf16 GEMMs: a prompt's logits on the fused path equal the eager path's over the same Triton
    attention bit for bit, so every rounding point is where the eager model (transformers') has it. (Only
    the norms' sums of squares are added in another order, which could move a value across a bf16 rounding
    boundary; with this checkpoint and prompt none does. Against transformers itself the attention kernel's
    own summation order differs: test_engine_correctness allows for it.)"""
    path, prompt = checkpoints["qwen3"], mixed_prompts(1, seed=6, max_len=30)[0]
    fused_llm, eager_llm = (LLM(str(path), dtype="bfloat16", linear_dtype="model", attention_backend="triton")
                            for _ in range(2))
    layers = len(eager_llm.model.layers)  # the eager ops over the same backend
    eager_llm.model.executor = LayerByLayer([EagerOps()] * layers, [LayerKernels()] * layers, EagerOps())
    fused = prefill_logits(fused_llm, prompt)
    assert isinstance(fused_llm.model.executor, LayerByLayer) and isinstance(fused_llm.model.executor.final, TritonOps)
    assert torch.equal(fused, prefill_logits(eager_llm, prompt))
