"""Log-probabilities against transformers: the sampled tokens' and the prompt's (echo, scoring), for
every architecture, through chunked prefill and past a cached prefix, as `log_softmax` of the oracle's
float32 logits."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.outputs import TokenLogprob
from tests.test_engine_correctness import FAMILIES, mixed_prompts

TOP = 4


def assert_logprobs(entries: list[TokenLogprob], expected: torch.Tensor, tokens: list[int], top: int) -> None:
    """`entries[i]` scores `tokens[i]` under the oracle's row `expected[i]`, with its top alternatives."""
    assert len(entries) == len(tokens)
    for entry, row, token in zip(entries, expected, tokens, strict=True):
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(row[token].item(), abs=2e-4)
        values, ids = row.topk(top)
        assert [t for t, _, _ in entry.top] == ids.tolist()
        assert [v for _, _, v in entry.top] == pytest.approx(values.tolist(), abs=2e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_and_prompt_logprobs_equal_transformers(checkpoints, hf, family):
    path = checkpoints[family]
    llm = LLM(str(path))
    prompts = mixed_prompts(3, seed=21, max_len=30)
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=TOP, prompt_logprobs=TOP)
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        expected = hf.log_softmax(path, prompt + out.token_ids)
        assert out.logprobs is not None and out.prompt_logprobs is not None
        assert_logprobs(out.logprobs, expected[len(prompt) - 1 : -1], out.token_ids, TOP)
        first, *rest = out.prompt_logprobs
        assert first.token_id == prompt[0] and first.logprob is None and not first.top
        assert_logprobs(rest, expected[: len(prompt) - 1], prompt[1:], TOP)
        hf.check_greedy(out.token_ids, path, prompt, 6)
    llm.check_integrity()


def test_prompt_logprobs_across_chunks_and_a_cached_prefix(checkpoints, hf):
    """A prompt whose first 48 tokens are cached and whose rest arrives in 7-token chunks is still scored
    whole, and in a mixed batch beside plain requests."""
    path = checkpoints["qwen2"]
    llm = LLM(str(path), max_prefill_tokens=7)
    prompt = mixed_prompts(1, seed=22, max_len=2)[0] + torch.arange(60).tolist()
    llm.generate([prompt[:50]], SamplingParams(max_tokens=2))
    assert llm.stats().pages.cached >= 3
    score = SamplingParams(max_tokens=0, prompt_logprobs=2)
    outs = llm.generate([prompt, *mixed_prompts(3, seed=23, max_len=20)],
                        [score] + [SamplingParams(max_tokens=5)] * 3)
    scored = outs[0]
    assert scored.token_ids == [] and scored.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert scored.prompt_logprobs is not None
    assert_logprobs(scored.prompt_logprobs[1:], hf.log_softmax(path, prompt)[:-1], prompt[1:], 2)
    for prompt_, out in zip(mixed_prompts(3, seed=23, max_len=20), outs[1:], strict=True):
        hf.check_greedy(out.token_ids, path, prompt_, 5, eos=sorted(llm.eos_ids))
    llm.check_integrity()


def test_logprobs_are_raw_whatever_the_sampler_does(checkpoints, hf):
    """Sampled with temperature, top-k and a penalty, the reported numbers are still the model's own."""
    path = checkpoints["llama"]
    llm = LLM(str(path))
    prompt = mixed_prompts(1, seed=24, max_len=20)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=1.3, top_k=5, presence_penalty=1.0,
                                                seed=3, ignore_eos=True, logprobs=0))[0]
    assert out.logprobs is not None and all(not e.top for e in out.logprobs)
    expected = hf.log_softmax(path, prompt + out.token_ids)[len(prompt) - 1 : -1]
    assert [e.logprob for e in out.logprobs] == pytest.approx(
        [row[t].item() for row, t in zip(expected, out.token_ids, strict=True)], abs=2e-4)
