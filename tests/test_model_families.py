"""The families beyond Llama's (issue 34): Qwen3-MoE, Qwen2-MoE (a shared expert), Mixtral, Gemma 2 and 3, Phi-3, and
Mistral and Mixtral with a sliding window on every layer, each a tiny random checkpoint of transformers' own classes
(tests/checkpoints.py: NEW_FAMILIES). Greedy output equals transformers' in float32 under chunked prefill and mixed
batches, with the prefix cache reusing shared prefixes, under retraction in a tight pool, and (MoE) on two
tensor-parallel ranks; an architecture minichat does not run is refused, naming those it does."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from engine import LLM, SamplingParams
from engine.model.families import SUPPORTED_ARCHITECTURES, read_spec
from tests.checkpoints import NEW_FAMILIES
from tests.test_engine_correctness import mixed_prompts
from tests.test_logprobs import TOP, assert_logprobs
from tests.test_prefix_cache import greedy, ids
from tests.test_retraction import OUT, assert_all_free, crowd, tight

FAMILIES = list(NEW_FAMILIES)
MOE = ["qwen3_moe", "qwen2_moe", "mixtral"]
WINDOWED = ["mistral_window", "mixtral_window"]  # every layer: pages are released as the window passes them


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_under_chunked_prefill_and_mixed_batches(checkpoints, hf, family):
    """Prompts of 1-69 tokens (several windows of 12 for the windowed families) in chunks of at most 16 tokens,
    three requests at a time, so that newcomers' chunks ride beside running requests' decode tokens."""
    path = checkpoints[family]
    llm = LLM(str(path), max_prefill_tokens=16, max_running_requests=3)
    prompts = mixed_prompts(8, seed=34)
    budgets = {llm.add_request(p, SamplingParams(max_tokens=4 + i)): (p, 4 + i) for i, p in enumerate(prompts)}
    tokens: dict[str, list[int]] = {rid: [] for rid in budgets}
    kinds, chunked = set(), False
    while llm.has_unfinished():
        result = llm.step()
        kinds.add(result.kind)
        chunked |= any(r.state == "prefilling" for r in llm.stats().running)
        for delta in result.outputs:
            tokens[delta.rid] += delta.token_ids
    assert "mixed" in kinds and chunked
    for rid, (prompt, n) in budgets.items():
        hf.check_greedy(tokens[rid], path, prompt, n, eos=sorted(llm.eos_ids))
    assert_all_free(llm)


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_prefixes_are_reused_and_stay_exact(checkpoints, hf, family):
    """A 40-token system prompt computed once, then eight requests continuing it at once (chunked): each finds 40
    of its tokens cached (ten pages of 4) and generates transformers' tokens."""
    path = checkpoints[family]
    llm = LLM(str(path), max_prefill_tokens=24, page_size=4)
    system = ids(40, 5)
    llm.generate([system], greedy(1))
    prompts = [system + ids(k, 40 + k) for k in range(1, 9)]
    for prompt, out in zip(prompts, llm.generate(prompts, greedy(6)), strict=True):
        assert out.usage.cached_tokens == 40
        hf.check_greedy(out.token_ids, path, prompt, 6)
    assert_all_free(llm)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in WINDOWED])
def test_retraction_in_a_tight_pool_stays_exact(checkpoints, hf, family):
    """24 pages of 4 tokens for 48 requests of 48 output tokens: running requests are retracted and recomputed
    (their pages through the prefix cache), and every output is still transformers'. (A model windowed on every
    layer gives its pages back as the window passes them and does not retract there: tests/test_sliding_window.py.)"""
    path = checkpoints[family]
    llm = tight(path)
    prompts = crowd()
    outs = llm.generate(prompts, SamplingParams(max_tokens=OUT))
    assert llm.stats().counters.retractions >= 3
    for prompt, out in zip(prompts, outs, strict=True):
        hf.check_greedy(out.token_ids, path, prompt, OUT, eos=sorted(llm.eos_ids))
    assert_all_free(llm)


@pytest.mark.parametrize("family", MOE)
def test_experts_split_over_two_ranks_match_one_rank_and_transformers(checkpoints, hf, family):
    """Tensor parallelism on gloo: every expert's intermediate rows (and the shared expert's) split in two, one
    all-reduce per MoE layer; the same tokens as one rank, under chunked prefill."""
    path = checkpoints[family]
    prompts = mixed_prompts(4, seed=12, max_len=40)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    single = [o.token_ids for o in LLM(str(path), max_prefill_tokens=16).generate(prompts, params)]
    with LLM(str(path), tensor_parallel_size=2, max_prefill_tokens=16) as llm:
        experts = llm.model.layers[0].moe.experts[0]
        assert experts.down_proj.weight.shape[1] * 2 == llm.model.spec.expert_size  # half of each expert here
        assert [o.token_ids for o in llm.generate(prompts, params)] == single
        llm.check_integrity()
    for prompt, out in zip(prompts, single, strict=True):
        hf.check_greedy(out, path, prompt, 6)


def test_gemma_caps_its_logits(checkpoints, hf):
    """Gemma 2's final logits are capped (cap * tanh(x / cap), monotonic, so greedy cannot see it): the sampled and
    prompt tokens' log-probabilities equal transformers' log_softmax of its capped logits."""
    path = checkpoints["gemma2"]
    llm = LLM(str(path))
    prompt = mixed_prompts(1, seed=21, max_len=30)[0] + ids(20, 3)
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=TOP, prompt_logprobs=TOP)
    out = llm.generate([prompt], params)[0]
    expected = hf.log_softmax(path, prompt + out.token_ids)
    assert out.logprobs is not None and out.prompt_logprobs is not None
    assert_logprobs(out.logprobs, expected[len(prompt) - 1 : -1], out.token_ids, TOP)
    assert_logprobs(out.prompt_logprobs[1:], expected[: len(prompt) - 1], prompt[1:], TOP)
    assert expected.exp().max() < 0.5  # the cap (3.0) keeps every logit within 6 of the others: it bites


@pytest.mark.parametrize("family", FAMILIES)
def test_the_engine_says_what_the_model_is(checkpoints, family):
    """Family, experts and windows in the engine's description (the console, `minichat status` and /v1/models
    show it); `execution` says which families' layers run in one C call."""
    llm = LLM(str(checkpoints[family]))
    info = llm.model_info
    assert info["family"] == {"qwen3_moe": "Qwen3-MoE", "qwen2_moe": "Qwen2-MoE", "mixtral": "Mixtral",
                              "gemma2": "Gemma 2", "gemma3": "Gemma 3", "phi3": "Phi-3", "mistral_window": "Mistral",
                              "mixtral_window": "Mixtral"}[family]
    assert ("experts" in info) == (family in (*MOE, "mixtral_window"))
    if family == "qwen3_moe":
        assert info["experts"] == "8, 2 per token (32 rows each), on 2 of 3 layers"
    if family == "qwen2_moe":
        assert info["experts"].endswith("and a shared expert of 64 rows")
    window = {"gemma2": "12 tokens on 1 of 2 layers (the others see everything)", "mistral_window":
              "12 tokens on every layer", "mixtral_window": "12 tokens on every layer"}
    assert info["window"] == window.get(family, "none" if family != "gemma3" else window["gemma2"])
    # Llama-shaped dense layers and Gemma 3's keep their float32 rows for one-call steps of few rows; MoE layers and
    # Gemma 2's capped attention cannot
    assert llm.execution["layers"].startswith("one C call a step") == (family in ("phi3", "mistral_window", "gemma3"))
    if "experts" in info:
        assert llm.execution["experts"] == "grouped by expert, one GEMM per expert over its tokens (float32 prepacked)"
    assert ("activation" in llm.execution) == family.startswith("gemma")  # GELU: where it runs


def test_every_architecture_transformers_names_and_minichat_does_not_run_is_refused():
    """Each causal-LM architecture of transformers' registry that minichat does not run is refused when its config
    is read, with a message that lists what minichat runs (never a model built on the wrong family)."""
    refused = 0
    for model_type, architecture in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if architecture in SUPPORTED_ARCHITECTURES:
            continue
        config = PretrainedConfig(architectures=[architecture])
        config.model_type = model_type
        with pytest.raises(ValueError) as error:
            read_spec(config)
        assert architecture in str(error.value) and all(a in str(error.value) for a in SUPPORTED_ARCHITECTURES)
        refused += 1
    assert refused > 100  # transformers names hundreds; minichat runs ten
    gemma3 = AutoConfig.for_model("gemma3")  # the multimodal Gemma 3: its text model only under its own class
    gemma3.architectures = ["Gemma3ForConditionalGeneration"]
    with pytest.raises(ValueError, match="Gemma3ForCausalLM"):
        read_spec(gemma3)


def test_unsupported_parts_of_a_supported_family_are_refused(checkpoints):
    """A supported architecture with what its kernels do not compute: named, not run wrongly."""
    from transformers import Phi3Config

    config = Phi3Config(partial_rotary_factor=0.75, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    config.architectures = ["Phi3ForCausalLM"]
    with pytest.raises(ValueError, match="partial rotary"):
        read_spec(config)
    config = AutoConfig.from_pretrained(checkpoints["qwen3_moe"])
    config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        read_spec(config)


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_is_close_to_transformers(checkpoints, family):
    """bf16 rounds where transformers' bf16 rounds (Gemma's norms once, after their float32 weight; routing weights
    cast or not as each router does), but sums in other orders: a prompt's next-token log-probabilities within 0.1
    of transformers' bf16 model."""
    from transformers import AutoModelForCausalLM

    path = checkpoints[family]
    prompt = ids(40, 0)
    llm = LLM(str(path), dtype="bfloat16")
    llm.add_request(prompt, SamplingParams(max_tokens=1))
    batch = llm.scheduler.schedule()
    assert batch is not None
    ours = torch.log_softmax(llm.runner.forward(batch)[0], -1)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        theirs = torch.log_softmax(reference(torch.tensor([prompt])).logits[0, -1].float(), -1)
    assert (ours - theirs).abs().max().item() < 0.1
