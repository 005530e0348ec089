"""minichat's C kernels for the CPU (kernels/cpu) against transformers' own ops and a naive attention,
and their build: cached once per CPU and compiler, a clear error and the torch paths where no compiler is."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from engine import LLM, SamplingParams
from kernels.cpu import load_cpu_kernels
from kernels.cpu.build import KernelBuildError, load_library

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def kernels():
    return load_cpu_kernels()


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("rows,dim", [(1, 64), (33, 256), (300, 40)])
def test_rms_norm_matches_transformers(kernels, dtype, rows, dim):
    """Same roundings as LlamaRMSNorm; only the sum of squares is added in another order, which can move
    a row's scale by one unit in the last place: within three float32 epsilons, and mostly equal (bf16
    rounds that away)."""
    g = torch.Generator().manual_seed(rows)
    ref = LlamaRMSNorm(dim, eps=1e-6).to(dtype)
    ref.weight.data = torch.randn(dim, generator=g).to(dtype)
    wide = torch.randn(rows, dim + 24, generator=g).to(dtype)
    x = wide[:, 8 : 8 + dim]  # strided rows, as a slice of a wider projection output
    ours = kernels.rms_norm(x, ref.weight.data, 1e-6)
    with torch.no_grad():
        expected = ref(x)
    assert ((ours.float() - expected.float()).abs() <= 3 * torch.finfo(dtype).eps * expected.abs().float()).all()
    assert (ours == expected).float().mean() > 0.8


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_rope_is_bit_identical_to_transformers(kernels, dtype):
    """In place over query and key heads together (a view of the projection output), every product and
    sum rounded as transformers' apply_rotary_pos_emb rounds: bit-identical."""
    g = torch.Generator().manual_seed(0)
    tokens, q_heads, kv_heads, dim, max_pos = 19, 6, 2, 64, 512
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    positions = torch.randint(0, max_pos, (tokens,), generator=g)
    freqs = torch.arange(max_pos).float()[:, None] / (10000 ** (torch.arange(0, dim, 2).float() / dim))[None, :]
    emb = torch.cat((freqs, freqs), -1)
    half = dim // 2
    sin = emb.sin()
    signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), -1).to(dtype)
    cos = emb.cos().to(dtype)
    q = qkv[:, : q_heads * dim].view(tokens, q_heads, dim).transpose(0, 1)[None]
    k = qkv[:, q_heads * dim : (q_heads + kv_heads) * dim].view(tokens, kv_heads, dim).transpose(0, 1)[None]
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos[positions][None], sin.to(dtype)[positions][None])
    qk = qkv[:, : (q_heads + kv_heads) * dim].view(tokens, q_heads + kv_heads, dim)
    kernels.rope_(qk, positions, cos, signed_sin)
    assert torch.equal(qk[:, :q_heads], q_ref[0].transpose(0, 1))
    assert torch.equal(qk[:, q_heads:], k_ref[0].transpose(0, 1))


def test_silu_mul_rounds_as_transformers_bf16_mlp(kernels):
    """From the float32 gate/up GEMM output: bf16 rounding of it, SiLU, the product, as transformers'
    bf16 MLP rounds. SiLU's float32 value may differ from torch's by an ulp, which rounding to bf16
    hides unless it lands on a tie."""
    g = torch.Generator().manual_seed(1)
    gate_up = torch.randn(37, 2 * 300, generator=g) * 4
    gate, up = gate_up.to(torch.bfloat16).chunk(2, dim=-1)
    expected = (torch.nn.functional.silu(gate) * up).float()
    ours = kernels.silu_mul(gate_up, torch.bfloat16)
    assert (ours == expected).float().mean() > 0.999
    assert ((ours - expected).abs() <= torch.finfo(torch.bfloat16).eps * expected.abs()).all()
    assert torch.equal(ours, ours.to(torch.bfloat16).float())  # bf16 values, in float32


def test_silu_mul_float32_within_an_ulp_of_torch(kernels):
    """A float32 model's activation: torch's silu(gate) * up to within SiLU's own ulp (vector expf),
    on rows large enough to run on several threads."""
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(300, 2 * 344, generator=g) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    ours = kernels.silu_mul(gate_up, torch.float32)
    assert ((ours - expected).abs() <= 4 * torch.finfo(torch.float32).eps * expected.abs()).all()
    assert (ours == expected).float().mean() > 0.5
    with pytest.raises(ValueError, match="model dtype must be float32 or bfloat16"):
        kernels.silu_mul(gate_up, torch.float16)
    reused = torch.full((300, 344), float("nan"))  # a buffer the model reuses gets exactly the same values
    assert kernels.silu_mul(gate_up, torch.float32, out=reused) is reused and torch.equal(reused, ours)
    with pytest.raises(ValueError, match=r"out must be contiguous float32 \(300, 344\)"):
        kernels.silu_mul(gate_up, torch.float32, out=torch.empty(300, 343))


def naive_paged(q, k_cache, v_cache, table, rows, kv_lens, scale):
    out = []
    for b, row in enumerate(rows.tolist()):
        slots = table[row, : kv_lens[b]]
        k, v = k_cache[slots].float(), v_cache[slots].float()  # [n, Hkv, D]
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 32), (8, 2, 64), (14, 2, 64), (6, 3, 40)],
                         ids=["mha", "gqa4", "gqa7", "dim40"])
def test_paged_attention_matches_naive(kernels, dtype, heads, kv_heads, dim):
    """One query per request over permuted pool slots, lengths from 1 past one key block (128), q a
    strided view of the projection output; float32 accumulation in any dtype."""
    g = torch.Generator().manual_seed(heads * dim)
    slots, max_len = 2048, 320
    k_cache = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    table = torch.randperm(slots, generator=g)[: 6 * max_len].view(6, max_len)
    rows = torch.tensor([4, 0, 5, 2])
    kv_lens = torch.tensor([1, 37, 129, 300])
    qkv = torch.randn(4, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    q = qkv[:, : heads * dim].view(4, heads, dim)
    ours = kernels.paged_attention(q, k_cache, v_cache, table, rows, kv_lens, dim**-0.5)
    expected = naive_paged(q, k_cache, v_cache, table, rows, kv_lens, dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("pool", ["f32", "bf16", "int8"])
@pytest.mark.parametrize("heads,kv_heads,dim,window", [(9, 3, 64, None), (4, 1, 256, None), (4, 1, 256, 40),
                                                       (8, 2, 128, 70)], ids=["smollm2", "gemma3", "gemma3-local",
                                                                             "windowed128"])
def test_a_prompts_tokens_together_are_each_token_alone(kernels, pool, heads, kv_heads, dim, window):
    """A prompt's consecutive tokens share each read of a block of keys (runs of them per item) and still give
    bit for bit what each token gives alone, whatever the run lengths: two prompts, a decode token between them,
    lengths across several key blocks, a sliding window that cuts runs short; and they agree with naive attention."""
    from kernels.attention.int8_kv import dequantize_rows, quantize_keys, quantize_rows, rotate_queries

    g = torch.Generator().manual_seed(dim + heads)
    dtype = torch.bfloat16 if pool == "bf16" else torch.float32
    slots = 1024
    k_cache = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    if pool == "int8":
        k_cache, v_cache = quantize_keys(k_cache), quantize_rows(v_cache)
    table = torch.randperm(slots, generator=g)[: 3 * 300].view(3, 300)
    rows = torch.tensor([0] * 45 + [2] + [1] * 20)  # a prompt chunk of 45, a decode token, a chunk of 20
    kv_lens = torch.cat([torch.arange(100, 145), torch.tensor([7]), torch.arange(1, 21)])
    q = torch.randn(len(rows), heads, dim, generator=g).to(dtype)
    together = kernels.paged_attention(q, k_cache, v_cache, table, rows, kv_lens, dim**-0.5, window=window)
    alone = torch.cat([kernels.paged_attention(q[i : i + 1], k_cache, v_cache, table, rows[i : i + 1],
                                               kv_lens[i : i + 1], dim**-0.5, window=window)
                       for i in range(len(rows))])
    assert torch.equal(together, alone)
    if pool == "int8":
        k_cache, v_cache = (dequantize_rows(c, dim).view(slots, kv_heads, dim) for c in (k_cache, v_cache))
    lens = kv_lens if window is None else kv_lens.clamp(max=window)
    starts = kv_lens - lens
    windowed = torch.stack([table[r].roll(-int(s)) for r, s in zip(rows.tolist(), starts.tolist(), strict=True)])
    turned = rotate_queries(q) if pool == "int8" else q  # int8 pages hold the keys rotated
    expected = naive_paged(turned, k_cache, v_cache, windowed, torch.arange(len(rows)), lens, dim**-0.5)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(together.float(), expected, atol=tol, rtol=tol)


def test_layout_errors_are_clear(kernels):
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match=r"expected a CPU torch\.float32 tensor"):
        kernels.rms_norm(x, torch.ones(32, dtype=torch.float64), 1e-6)
    with pytest.raises(ValueError, match="unit-stride rows"):
        kernels.rms_norm(x.t(), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="expected a CPU float32 or bfloat16 tensor"):
        kernels.rms_norm(x.half(), torch.ones(32, dtype=torch.float16), 1e-6)


def test_struct_mirrors_are_checked_against_the_c_side(kernels):
    """The ctypes mirrors of the C structs (attention_call, segment, the fused layers' plans) match their C sizes,
    and a mirror that lost a field is refused naming the struct (a wrong layout would pass wrong pointers)."""
    from kernels.cpu import _Attention
    from kernels.cpu.decode import _Layer, _Model, _Product

    for name, mirror in (("attention_call", _Attention), ("product", _Product), ("layer_plan", _Layer),
                         ("model_plan", _Model)):
        kernels.check_struct(name, mirror)

    class Short(ctypes.Structure):
        _fields_ = _Attention._fields_[:-1]

    with pytest.raises(KernelBuildError, match=r"attention_call is \d+ bytes, its ctypes mirror Short \d+: the two"):
        kernels.check_struct("attention_call", Short)


def test_library_is_built_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MINICHAT_CACHE_DIR", str(tmp_path))
    load_library()
    built = list(tmp_path.glob("cpu_kernels-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    load_library()
    assert [p.stat().st_mtime_ns for p in tmp_path.glob("cpu_kernels-*.so")] == [stamp]


def test_no_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MINICHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-cc")
    with pytest.raises(KernelBuildError, match="no C compiler"):
        load_library()


def test_unwritable_cache_is_a_clear_error(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("MINICHAT_CACHE_DIR", str(blocker / "cache"))
    with pytest.raises(KernelBuildError, match="cannot build into"):
        load_library()


def test_engine_without_a_compiler_runs_the_torch_paths(tmp_path):
    """A machine with no C compiler (and nothing cached) still serves: auto picks the torch backend and
    the model its torch norms, with the same tokens as with the kernels."""
    script = ("import json; from engine import LLM, SamplingParams; llm = LLM(); "
              "out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=12))[0].token_ids; "
              "print(json.dumps([type(llm.runner.backend).__name__, llm.model.kernels is None, out]))")
    env = {**os.environ, "MINICHAT_CACHE_DIR": str(tmp_path), "CC": "no-such-cc"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    backend, no_kernels, tokens = json.loads(done.stdout.strip().splitlines()[-1])
    assert backend == "TorchRefBackend" and no_kernels
    assert "CPU kernels are unavailable" in done.stderr
    llm = LLM()
    assert type(llm.runner.backend).__name__ == "CpuBackend" and llm.model.kernels is not None
    assert llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=12))[0].token_ids == tokens
