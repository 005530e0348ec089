"""Bug classes other engines shipped (vLLM, SGLang, nano-vllm trackers), each driven through the step API on
a real tiny checkpoint: the output stays transformers' greedy output and every page and slot comes back.

- SGLang #34112: aborting the tail request of a chunked-prefill batch with overlap on leaked a token (and
  negative ids) into the stream.
- nano-vllm #211 / #233: a retracted (preempted) request meeting the prefix cache kept a stale cached length.
- SGLang #35270: the radix cache's evictable size counted a page two requests share twice.
- vLLM #53130: admission stopped for good once running + waiting reached the slot count.
"""

from __future__ import annotations

from engine import LLM, SamplingParams
from engine.outputs import Final
from tests.test_engine_correctness import mixed_prompts
from tests.test_retraction import assert_all_free, crowd, tight


def test_aborting_the_tail_of_a_chunked_prefill_batch_with_overlap(llama_ckpt, hf) -> None:
    """The long prompt is cut into chunks (16 tokens a step); it is aborted right after a step that prefilled
    part of it, while the next batch (its next chunk) is already in flight. Its Final carries no token, no id
    anywhere is negative, the others are exact, and everything is freed."""
    llm = LLM(str(llama_ckpt), max_prefill_tokens=16, overlap=True)
    short = mixed_prompts(3, seed=41, max_len=6)
    tail = list(range(10, 74))  # 64 tokens: four chunks
    rids = [llm.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in short]
    victim = llm.add_request(tail, SamplingParams(max_tokens=8, ignore_eos=True))
    outputs, aborted = [], False
    while llm.has_unfinished():
        outputs += llm.step(overlap=True).outputs
        running = {r.rid: r for r in llm.stats().running}
        if not aborted and victim in running and 0 < running[victim].prefilled < running[victim].prompt_tokens:
            llm.abort(victim)  # mid-prefill, with its next chunk scheduled behind this step
            aborted = True
    assert aborted, "the tail request was never caught mid-prefill"
    assert all(t >= 0 for o in outputs for t in o.token_ids)
    finals = {o.rid: o for o in outputs if isinstance(o, Final)}
    assert finals[victim].finish_reason == "abort" and finals[victim].token_ids == []
    assert not [o for o in outputs if o.rid == victim and o.token_ids]  # no token of it ever went out
    tokens = {rid: [t for o in outputs if o.rid == rid for t in o.token_ids] for rid in rids}
    for rid, prompt in zip(rids, short, strict=True):
        hf.check_greedy(tokens[rid], llama_ckpt, prompt, 8)
    assert_all_free(llm)


def test_a_retracted_request_meets_the_prefix_cache_with_a_fresh_cached_length(llama_ckpt, hf) -> None:
    """Prompts sharing a 12-token prefix in a pool that forces retractions: a retracted request's written
    pages go to the radix cache and it is matched against the tree again when it resumes. The cached length it
    resumes with is what the tree holds for its tokens now, and its output stays exact."""
    prefix = list(range(100, 112))
    prompts = [prefix + p for p in crowd(11)]
    llm = tight(llama_ckpt)
    rids = [llm.add_request(p, SamplingParams(max_tokens=48)) for p in prompts]
    resumed_with_cache = 0
    outputs = []
    while llm.has_unfinished():
        outputs += llm.step().outputs
        for entry in llm.stats().running:
            detail = llm.describe(entry.rid)
            if entry.retractions and detail is not None and detail.cached_tokens:
                req = llm.request(entry.rid)
                assert req is not None
                # what admission counted as cached is what its matched pages hold, never more than it has
                assert detail.cached_tokens <= len(req.input_ids) + entry.generated
                assert detail.cached_tokens % llm.config.kv.page_size == 0
                resumed_with_cache += 1
    assert llm.stats().counters.retractions >= 3 and resumed_with_cache > 0
    tokens = {rid: [t for o in outputs if o.rid == rid for t in o.token_ids] for rid in rids}
    for rid, prompt in zip(rids, prompts, strict=True):
        hf.check_greedy(tokens[rid], llama_ckpt, prompt, 48, eos=sorted(llm.eos_ids))
    assert_all_free(llm)


def test_a_page_two_requests_share_is_evictable_once(llama_ckpt) -> None:
    """A finished request leaves four full prompt pages in the radix cache; two requests then match them at
    once, both holding them. At every step the evictable count is the cached pages no request holds, counted
    once each, and at the end eviction frees exactly that many."""
    shared = list(range(5, 21))  # four pages of 4 tokens
    llm = LLM(str(llama_ckpt), page_size=4, num_pages=64)
    llm.generate([shared + [30]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(llm.cache.cached_pages()) >= 4
    for tail in ([40, 41], [50, 51, 52]):
        llm.add_request(shared + tail, SamplingParams(max_tokens=6, ignore_eos=True))
    both_held = False
    while llm.has_unfinished():
        llm.step()
        cached = llm.cache.cached_pages()
        assert llm.cache.evictable_size == sum(not locked for locked in cached.values())
        both_held |= len(llm.stats().running) == 2 and sum(locked for locked in cached.values()) >= 4
    assert both_held
    cached = llm.cache.cached_pages()
    assert llm.cache.evictable_size == len(cached) and llm.cache.available_size == llm.num_pages
    assert llm.cache.evict(len(cached) + 5) == len(cached)  # asking for more frees what there is, once each
    assert llm.cache.evictable_size == 0 and llm.cache.allocator.num_free == llm.num_pages
    assert_all_free(llm)


def test_admission_goes_on_when_running_and_waiting_fill_the_slots(llama_ckpt, hf) -> None:
    """Two request slots, wave after wave of requests: running + waiting reach and pass the slot count again
    and again, requests are aborted waiting and running; every wave is admitted and finishes."""
    llm = LLM(str(llama_ckpt), max_running_requests=2)
    for wave in range(4):
        prompts = mixed_prompts(5, seed=60 + wave, max_len=12)
        rids = [llm.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in prompts]
        outputs = llm.step().outputs
        assert len(llm.stats().running) == 2 and len(llm.stats().waiting) == 3
        llm.abort(rids[4])  # one waiting
        llm.abort(rids[0])  # one running
        for _ in range(100):  # a stalled admission would leave them waiting for ever
            if not llm.has_unfinished():
                break
            outputs += llm.step().outputs
        assert not llm.has_unfinished(), llm.stats().waiting
        finals = {o.rid: o for o in outputs if isinstance(o, Final)}
        assert {finals[r].finish_reason for r in (rids[0], rids[4])} == {"abort"}
        for rid, prompt in zip(rids[1:4], prompts[1:4], strict=True):
            assert finals[rid].finish_reason == "length"
            hf.check_greedy([t for o in outputs if o.rid == rid for t in o.token_ids], llama_ckpt, prompt, 6)
        assert_all_free(llm)
