"""Radix prefix cache: reuse, the last-token rule, locking, LRU eviction, and exactness throughout."""

from __future__ import annotations

import torch

from engine import LLM, SamplingParams


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_shared_prefix_is_reused_and_output_stays_exact(llama_ckpt, hf):
    llm = LLM(str(llama_ckpt))
    system = ids(40, 1)
    first = llm.generate([system + ids(5, 2)], greedy(6))[0]
    assert first.usage.cached_tokens == 0
    follow = system + ids(9, 3)
    second = llm.generate([follow], greedy(6))[0]
    assert second.usage.cached_tokens == 32  # two full pages of 16 shared tokens
    hf.check_greedy(second.token_ids, llama_ckpt, follow, 6)
    llm.check_integrity()


def test_fully_cached_prompt_still_computes_its_last_token(llama_ckpt, hf):
    llm = LLM(str(llama_ckpt))
    for n, cached in ((33, 32), (32, 16)):
        prompt = ids(n, 10 + n)
        llm.generate([prompt], greedy(4))
        again = llm.generate([prompt], greedy(4))[0]
        assert again.usage.cached_tokens == cached
        hf.check_greedy(again.token_ids, llama_ckpt, prompt, 4)


def test_matched_pages_are_locked_while_the_request_runs(llama_ckpt):
    llm = LLM(str(llama_ckpt))
    prefix = ids(48, 4)
    llm.generate([prefix + [1]], greedy(2))
    assert llm.stats().pages.cached == 3 and llm.stats().pages.locked == 0
    rid = llm.add_request(prefix + [2, 3], greedy(20))
    llm.step()
    assert llm.stats().pages.locked == 3
    assert llm.cache.evict(3) == 0  # locked pages cannot be evicted
    llm.abort(rid)
    llm.step()
    assert llm.stats().pages.locked == 0
    llm.check_integrity()


def test_eviction_makes_room_lru_first(llama_ckpt, hf):
    """A pool of 12 pages: cached prefixes must be evicted for new requests to fit."""
    llm = LLM(str(llama_ckpt), num_pages=12)
    prompts = [ids(40, 20 + i) for i in range(6)]
    for p in prompts:
        out = llm.generate([p], greedy(5))[0]
        hf.check_greedy(out.token_ids, llama_ckpt, p, 5)
        llm.check_integrity()
    # Each finished request leaves 2 full pages; the last one needed a page that only the least
    # recently used leaf (the oldest prompt's second page) could give. Its first page stays.
    cached = [len(llm.cache.match_prefix(p).pages) for p in prompts]
    assert cached == [1, 2, 2, 2, 2, 2]
    pages = llm.stats().pages
    assert pages.free + pages.cached == 12 and pages.held == 0


def test_many_requests_sharing_a_prefix_at_once(checkpoints, hf):
    path = checkpoints["qwen2"]
    llm = LLM(str(path), max_prefill_tokens=24, page_size=4)
    system = ids(30, 5)
    llm.generate([system], greedy(1))
    prompts = [system + ids(k, 40 + k) for k in range(1, 9)]
    outs = llm.generate(prompts, greedy(6))
    for p, o in zip(prompts, outs, strict=True):
        assert o.usage.cached_tokens == 28
        hf.check_greedy(o.token_ids, path, p, 6)
    llm.check_integrity()


def test_naive_policy_caches_nothing(llama_ckpt):
    llm = LLM(str(llama_ckpt), prefix_cache="naive")
    prompt = ids(40, 6)
    llm.generate([prompt], greedy(3))
    assert llm.generate([prompt], greedy(3))[0].usage.cached_tokens == 0
    assert llm.stats().pages.free == llm.num_pages
