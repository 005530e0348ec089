"""Mixture-of-experts kernels: the fused Triton MoE (tokens sorted by expert, one launch per projection) under the
interpreter against a per-token torch reference, and on the engine's Triton backend token-exact vs transformers;
experts in block formats (`quantization`, a GGUF file's stacked experts) through the CPU kernels against transformers
on the same rounded weights.
(The CPU's grouped experts, chunked, cached, retracted and on two ranks: tests/test_model_families.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from kernels.quant import BlockMatrix
from kernels.triton.moe import BLOCK_M, fused_moe, sort_by_expert
from tests.checkpoints import make_checkpoint
from tests.gguf_files import write_gguf
from tests.test_engine_correctness import assert_matches_hf, mixed_prompts
from tests.test_gguf import round_tripped, top1_agreement

HIDDEN, INTER = 48, 40  # not powers of two: the kernels' tiles are masked at the edges


def reference_moe(h, w1, w2, weights, experts, activation):
    """Token by token, in float64: sum over its top-k experts of weight * down(act(gate) * up)."""
    out = torch.zeros(h.shape, dtype=torch.float64)
    for t in range(h.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            gate, up = (w1[e].double() @ h[t].double()).chunk(2)
            act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
            out[t] += float(weights[t, j]) * (w2[e].double() @ (act * up))
    return out


def test_sort_by_expert_pads_each_expert_to_whole_blocks():
    experts = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2]])  # expert 3: 4 pairs; 0: 2; 1, 2: one each; 4: none
    rows, block_experts, used = sort_by_expert(experts, 5)
    pairs = experts.numel()
    assert int(used) == 4 * BLOCK_M  # four experts with tokens, a block each
    for b in range(int(used) // BLOCK_M):
        block = rows[b * BLOCK_M : (b + 1) * BLOCK_M]
        real = block[block < pairs]
        assert real.numel() and (experts.flatten()[real] == block_experts[b]).all()  # one expert per block
    assert sorted(rows[rows < pairs].tolist()) == list(range(pairs))  # every pair once


@pytest.mark.parametrize(("tokens", "num_experts", "top_k"), [(1, 8, 2), (13, 4, 2), (6, 6, 3)])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_moe_equals_the_reference(tokens, num_experts, top_k, activation, dtype):
    """Decode-sized (one token: most experts idle) and prefill-sized steps; experts with no tokens, several pairs
    of one expert in a block, a block of one expert's pairs spread over tokens."""
    g = torch.Generator().manual_seed(tokens * 10 + num_experts)
    h = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    w1 = (torch.randn(num_experts, 2 * INTER, HIDDEN, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(num_experts, HIDDEN, INTER, generator=g) * 0.2).to(dtype)
    probs = torch.softmax(torch.randn(tokens, num_experts, generator=g), -1)
    weights, experts = torch.topk(probs, top_k, -1)
    got = fused_moe(h, w1, w2, weights.to(dtype), experts, activation)
    want = reference_moe(h.float(), w1.float(), w2.float(), weights, experts, activation)
    assert got.dtype == dtype and got.shape == h.shape
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_engine_on_the_triton_backend_runs_the_fused_moe(checkpoints, hf, family):
    """The GPU path on a CPU (the interpreter): experts stacked for the fused kernel (float weights, not prepacked),
    the shared expert beside them (Qwen2-MoE), chunked prefill and graph-padded decode; tokens equal transformers'."""
    path = checkpoints[family]
    llm = LLM(str(path), attention_backend="triton", prepack_weights=False, max_prefill_tokens=12, page_size=4,
              max_running_requests=4)
    assert_matches_hf(llm, path, hf, mixed_prompts(4, seed=3, max_len=16), max_tokens=4)
    assert llm.execution["experts"] == "fused Triton MoE kernel, tokens sorted by expert"


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_experts_in_block_formats(checkpoints, hf, tmp_path, family):
    """`quantization="int8"`: every expert (and the shared one) in Q8_0 through the CPU kernels, SiLU * up inside the
    down product, the routers left float; top-1 agreement with transformers on the same Q8_0-rounded weights."""
    llm = LLM(str(checkpoints[family]), quantization="int8", max_prefill_tokens=512)
    moe = llm.model.layers[0].moe
    assert all(isinstance(p.weight, BlockMatrix) for e in moe.all_experts() for p in (e.gate_up_proj, e.down_proj))
    assert llm.model.executor is not None and llm.model.executor.kernels()[0].expert_blocks is not None
    assert isinstance(moe.gate.weight, torch.Tensor)
    assert llm.execution["experts"] == ("grouped by expert, one GEMM per expert over its tokens (Q8_0 blocks, SiLU * "
                                        "up in the down product)")
    ids = torch.randint(0, 384, (300,), generator=torch.Generator().manual_seed(11)).tolist()
    oracle = round_tripped(checkpoints[family], tmp_path / family, "Q8_0", keep_float=("gate.weight",))
    agree, gap = top1_agreement(llm, hf.log_softmax(oracle, ids), ids)
    assert agree >= 0.99 and gap < 0.05, (agree, gap)


def test_a_gguf_mixture_of_experts(hf, tmp_path):
    """A Qwen3-MoE GGUF file (every projection of a layer's experts stacked in one Q8_0 tensor, as llama.cpp writes
    them): each expert read from its stretch of the stack. Expanded to float32, token-exact vs transformers on the same
    values; kept in blocks, the experts' products in the kernels, >= 99% top-1 agreement with them."""
    src = make_checkpoint("qwen3_moe", tmp_path / "src", seed=3, num_hidden_layers=2, mlp_only_layers=[])
    path = write_gguf(src, tmp_path / "tiny-qwen3moe.Q8_0.gguf", "qwen3_moe", "Q8_0")
    oracle = round_tripped(src, tmp_path / "oracle", "Q8_0")  # every matrix through Q8_0 and back, as in the file
    expanded = LLM(str(path), dequantize=True)
    gguf = expanded.checkpoint.gguf
    assert gguf is not None and gguf.tensors["blk.0.ffn_gate_exps.weight"].shape == (8, 32, 64)
    assert expanded.model_info["experts"] == "8, 2 per token (32 rows each)"  # the expert size read from the file
    prompts = mixed_prompts(4, seed=1, max_len=40)
    for prompt, out in zip(prompts, expanded.generate(prompts, SamplingParams(max_tokens=8)), strict=True):
        hf.check_greedy(out.token_ids, oracle, prompt, 8, eos=sorted(expanded.eos_ids))
    blocks = LLM(str(path), max_prefill_tokens=512)
    assert isinstance(blocks.model.layers[1].moe.experts[7].down_proj.weight, BlockMatrix)
    ids = torch.randint(0, 384, (300,), generator=torch.Generator().manual_seed(11)).tolist()
    agree, gap = top1_agreement(blocks, hf.log_softmax(oracle, ids), ids)
    assert agree >= 0.99 and gap < 0.05, (agree, gap)
