"""Greedy output must equal transformers token for token, however the scheduler slices the work,
with steps run in sequence or overlapped (step N+1 scheduled while step N runs)."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, RequestOutput, SamplingParams
from engine.model.decoder import ROWS_ONE_CALL_CACHED
from engine.model.executor import OneCall
from tests.checkpoints import with_eos

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.fixture(params=[False, True], ids=["sequential", "overlap"])
def overlap(request: pytest.FixtureRequest) -> bool:
    return request.param


def mixed_prompts(n: int, seed: int, max_len: int = 70) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len, (n,), generator=g).tolist()
    return [torch.randint(0, 384, (k,), generator=g).tolist() for k in lengths]


def assert_matches_hf(llm: LLM, path: Path, hf, prompts: list[list[int]], max_tokens: int) -> list[RequestOutput]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens))
    for prompt, out in zip(prompts, outs, strict=True):
        hf.check_greedy(out.token_ids, path, prompt, max_tokens, eos=sorted(llm.eos_ids))
        assert out.finish_reason == ("stop" if out.token_ids[-1] in llm.eos_ids else "length")
    llm.check_integrity()
    pages = llm.stats().pages
    assert pages.held == pages.locked == 0 and pages.free + pages.cached == llm.num_pages
    return outs


@pytest.mark.parametrize("family", FAMILIES)
def test_many_mixed_prompts_at_once(checkpoints, hf, family, overlap):
    path = checkpoints[family]
    llm = LLM(str(path), overlap=overlap)
    assert_matches_hf(llm, path, hf, mixed_prompts(12, seed=1), max_tokens=10)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_prefill_budget_forces_chunking(checkpoints, hf, family, overlap):
    path = checkpoints[family]
    llm = LLM(str(path), max_prefill_tokens=7, overlap=overlap)
    prompts = mixed_prompts(6, seed=2, max_len=60)
    rids = [llm.add_request(p, SamplingParams(max_tokens=8)) for p in prompts]
    chunked_steps = 0
    while llm.has_unfinished():
        res = llm.step(overlap)
        assert res.num_prefill_tokens <= 7  # decode tokens riding along in a mixed step are not prefill budget
        if res.num_prefill_tokens:
            chunked_steps += any(r.state == "prefilling" for r in llm.stats().running)
    assert chunked_steps > 0, "no prompt was ever chunked"
    del rids
    assert_matches_hf(llm, path, hf, prompts, max_tokens=8)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_so_few_pages_that_admission_waits(checkpoints, hf, family, overlap):
    path = checkpoints[family]
    # Each request below needs up to 5 pages of 4 tokens (prompt < 12, 8 outputs): only two fit at once.
    llm = LLM(str(path), page_size=4, num_pages=10, overlap=overlap)
    prompts = mixed_prompts(6, seed=3, max_len=12)
    for p in prompts:
        llm.add_request(p, SamplingParams(max_tokens=8))
    saw_waiting_with_free_slot = False
    while llm.has_unfinished():
        st = llm.stats()
        if st.waiting and None in st.slots and st.running:
            saw_waiting_with_free_slot = True
        llm.step(overlap)
        llm.check_integrity()
    assert saw_waiting_with_free_slot, "KV capacity never held a request back"
    assert_matches_hf(llm, path, hf, prompts, max_tokens=8)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fewer_slots_than_requests(checkpoints, hf, family, overlap):
    path = checkpoints[family]
    llm = LLM(str(path), max_running_requests=3, overlap=overlap)
    prompts = mixed_prompts(8, seed=4)
    for p in prompts:
        llm.add_request(p, SamplingParams(max_tokens=6))
    while llm.has_unfinished():
        res = llm.step(overlap)
        assert len(res.rids) <= 3
    assert_matches_hf(llm, path, hf, prompts, max_tokens=6)


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "unmixed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_batches(checkpoints, hf, family, mixed, overlap):
    """Requests that end at different steps free slots for newcomers while others still decode: with
    mixed batches those decode inside the newcomers' prefill steps; without, such steps are prefill
    only. Every request's tokens equal transformers' either way."""
    path = checkpoints[family]
    llm = LLM(str(path), max_running_requests=3, mixed_batches=mixed, overlap=overlap)
    prompts = mixed_prompts(7, seed=8)
    budgets = {llm.add_request(p, SamplingParams(max_tokens=3 + 2 * i)): (p, 3 + 2 * i)
               for i, p in enumerate(prompts)}
    tokens: dict[str, list[int]] = {rid: [] for rid in budgets}
    kinds = set()
    while llm.has_unfinished():
        res = llm.step(overlap)
        kinds.add(res.kind)
        for d in res.outputs:
            tokens[d.rid] += d.token_ids
    assert ("mixed" in kinds) == mixed and {"prefill", "decode"} <= kinds
    for rid, (prompt, n) in budgets.items():
        hf.check_greedy(tokens[rid], path, prompt, n, eos=sorted(llm.eos_ids))
    llm.check_integrity()


def test_everything_tight_at_once(llama_ckpt, hf, overlap):
    """Small slots, small budget, small pool and pages of 1 token: the scheduler's worst day."""
    llm = LLM(str(llama_ckpt), page_size=1, num_pages=90, max_running_requests=2, max_prefill_tokens=5,
              overlap=overlap)
    assert_matches_hf(llm, llama_ckpt, hf, mixed_prompts(5, seed=5, max_len=40), max_tokens=9)


@pytest.mark.parametrize("family", FAMILIES)
def test_equal_length_fresh_prompts(checkpoints, hf, family, overlap):
    """Fresh prompts of one length take the fast prefill (SDPA's causal mask over the step's own K/V,
    no pool gather, no mask built), then decode steps where every request sees all its keys (no mask)."""
    path = checkpoints[family]
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(0, 384, (5, 9), generator=g).tolist()
    llm = LLM(str(path), prefix_cache="naive", overlap=overlap)
    assert_matches_hf(llm, path, hf, prompts, max_tokens=6)


def test_eos_mid_batch(llama_ckpt, hf, tmp_path, overlap):
    """EOS hits requests at different steps; overlapped, each was already scheduled one step past it."""
    prompts = mixed_prompts(8, seed=7)
    free = LLM(str(llama_ckpt)).generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    eos = Counter(t for out in free for t in out.token_ids[1:-1]).most_common(1)[0][0]
    path = with_eos(llama_ckpt, tmp_path / "eos", [eos])
    outs = assert_matches_hf(LLM(str(path), overlap=overlap), path, hf, prompts, max_tokens=10)
    assert sum(o.finish_reason == "stop" for o in outs) >= 2


@pytest.mark.parametrize("prepack", [True, False], ids=["onednn", "f_linear"])
@pytest.mark.parametrize("family", FAMILIES)
def test_prepacked_weights(checkpoints, hf, family, prepack):
    """Projections on oneDNN-prepacked weights (the CPU default; in float32 both residual adds run
    inside the o and down GEMMs) or through `F.linear`: the same tokens as transformers either way; a
    tied embedding keeps its dense rows for lookups. The MLP's activation runs in C either way."""
    path = checkpoints[family]
    llm = LLM(str(path), prepack_weights=prepack)
    model = llm.model
    assert model.layers[0].qkv_proj.weight.is_mkldnn == prepack and model.lm_head.weight.is_mkldnn == prepack
    assert model.executor is not None
    assert all(k.residual_in_gemm == prepack for k in model.executor.kernels())
    assert all(k.activation is not None for k in model.executor.kernels())
    assert not model.embed_tokens.weight.is_mkldnn
    assert_matches_hf(llm, path, hf, mixed_prompts(6, seed=9), max_tokens=8)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_small_float32_models_decode_few_rows_in_one_c_call(checkpoints, hf, family):
    """A small float32 model keeps its projections' rows (CausalLM.keep_float_rows): steps of up to
    `float_rows_most` rows (ROWS_ONE_CALL_CACHED for a model this small, whose rows stay in cache) run every layer
    in one C call (decode.c over the F32 rows), bigger ones through oneDNN layer by layer. Twelve requests of
    different lengths, also with the limit at 8, make steps of both kinds: transformers' tokens either way, and
    the log-probabilities of the run with the one-call path switched off to float32 summation order."""
    path = checkpoints[family]
    prompts = mixed_prompts(12, seed=13)
    params = [SamplingParams(max_tokens=2 + i, logprobs=0, ignore_eos=True) for i in range(len(prompts))]
    runs = []
    for one_call, most in ((True, None), (True, 8), (False, None)):
        llm = LLM(str(path), one_call=one_call)
        executor = llm.model.executor
        assert llm.model.float_rows_most == ROWS_ONE_CALL_CACHED and llm.model.float_rows is not None
        assert isinstance(executor, OneCall) == one_call
        if isinstance(executor, OneCall):
            assert executor.most_rows == ROWS_ONE_CALL_CACHED
            executor.most_rows = most or executor.most_rows
        outs = llm.generate(prompts, params)
        assert (isinstance(executor, OneCall) and executor.built is not None) == one_call
        runs.append(outs)
    layered = runs[-1]
    for ours in runs[:-1]:
        for prompt, p, one, layer in zip(prompts, params, ours, layered, strict=True):
            hf.check_greedy(one.token_ids, path, prompt, p.max_tokens)
            if one.token_ids == layer.token_ids:
                assert [e.logprob for e in one.logprobs] == pytest.approx([e.logprob for e in layer.logprobs],
                                                                          abs=1e-4)


def as_bfloat16(src: Path, out: Path) -> Path:
    """A copy of the checkpoint `src` stored in bfloat16, as most Hugging Face checkpoints are."""
    shutil.copytree(src, out)
    for file in out.glob("*.safetensors"):
        save_file({name: t.to(torch.bfloat16) for name, t in load_file(file).items()}, file, metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    return out


def test_a_bfloat16_checkpoint_keeps_bfloat16_rows_and_decodes_like_transformers(llama_ckpt, hf, tmp_path):
    """A bf16 checkpoint runs in float32 (transformers' float32 is the reference) and keeps its projections' and
    output head's rows as bfloat16 for the one-call path: half the bytes a decode step reads, the same float32
    products (a bf16 value widens exactly). Steps of one and of many rows (one call; oneDNN above the limit):
    transformers' tokens, and the head's product through the rows equal to oneDNN's within float32 rounding."""
    path = as_bfloat16(llama_ckpt, tmp_path / "llama-bf16")
    llm = LLM(str(path))
    model = llm.model
    assert model.float_rows is not None and {f for ws in model.float_rows for w in ws for f in w.formats} == {"BF16"}
    assert model.head_rows is not None and model.head_rows.formats == ["BF16"]
    assert "(bfloat16 rows kept)" in llm.execution["layers"]
    h = torch.randn(3, model.spec.hidden_size)
    assert torch.allclose(model.head(h), model.lm_head(h), atol=1e-4, rtol=1e-4)
    prompts = mixed_prompts(model.float_rows_most + 4, seed=21)  # a first step too big for one call
    params = [SamplingParams(max_tokens=3 + i % 5, ignore_eos=True) for i in range(len(prompts))]
    for prompt, p, out in zip(prompts, params, llm.generate(prompts, params), strict=True):
        hf.check_greedy(out.token_ids, path, prompt, p.max_tokens)
    assert isinstance(model.executor, OneCall) and model.executor.built is not None  # decode steps ran in one call
    assert LLM(str(llama_ckpt)).model.float_rows[0][0].formats == ["F32"]  # float32 values stay float32 rows


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["c_kernels", "torch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_cpu_kernels(checkpoints, hf, family, cpu_kernels):
    """RMSNorm, RoPE, the MLP activation and decode attention in minichat's C kernels (the CPU default)
    or in torch ops: the same tokens as transformers either way, through prefill, mixed and decode steps."""
    path = checkpoints[family]
    llm = LLM(str(path), cpu_kernels=cpu_kernels)
    assert (llm.model.kernels is not None) == cpu_kernels
    assert llm.model.executor is not None
    assert all((k.activation is not None) == cpu_kernels for k in llm.model.executor.kernels())
    assert type(llm.runner.backend).__name__ == ("CpuBackend" if cpu_kernels else "TorchRefBackend")
    assert_matches_hf(llm, path, hf, mixed_prompts(8, seed=11), max_tokens=12)


@pytest.mark.parametrize("linear_dtype", ["model", "float32"])
def test_bfloat16_logprobs_close_to_transformers(llama_ckpt, linear_dtype):
    """bf16 rounds differently from transformers, so compare log-probabilities with a tolerance; with
    either GEMM dtype (float32 is what `auto` picks on a CPU without native bf16)."""
    from transformers import AutoModelForCausalLM

    prompt = mixed_prompts(1, seed=6, max_len=30)[0]
    llm = LLM(str(llama_ckpt), dtype="bfloat16", linear_dtype=linear_dtype)
    weight_dtype = llm.model.layers[0].qkv_proj.weight.dtype
    assert weight_dtype == (torch.bfloat16 if linear_dtype == "model" else torch.float32)
    assert llm.model.executor is not None
    chosen = llm.model.executor.kernels()[0]
    assert not chosen.residual_in_gemm  # bf16 activations round before the residual add
    # with float32 GEMMs the activation between them runs in one C pass (kernels/cpu/activation.c)
    assert (chosen.activation is not None) == (linear_dtype == "float32")
    llm.add_request(prompt, SamplingParams(max_tokens=1))
    ours = torch.log_softmax(llm.runner.forward(llm.scheduler.schedule())[0], -1)
    ref_model = AutoModelForCausalLM.from_pretrained(llama_ckpt, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref = torch.log_softmax(ref_model(torch.tensor([prompt])).logits[0, -1].float(), -1)
    assert (ours - ref).abs().max().item() < 0.1


def test_unknown_linear_dtype_is_refused():
    with pytest.raises(ValueError, match="linear_dtype must be one of"):
        LLM(linear_dtype="int8")
