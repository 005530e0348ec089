"""Sliding-window attention end to end (tiny checkpoints with a window of 12, tests/checkpoints.py): prompts of several
windows equal transformers' greedy tokens on every CPU path; the pages every layer's window has passed leave a
running request early (freed, or handed to the prefix cache) and the radix cache stays correct around them: a match
is always a whole prefix, and a request whose handed pages were evicted while it ran caches nothing after them."""

from __future__ import annotations

import json
import shutil

import pytest

from engine import LLM, SamplingParams
from engine.model.executor import OneCall
from tests.checkpoints import WINDOW
from tests.test_engine_correctness import mixed_prompts
from tests.test_prefix_cache import greedy, ids
from tests.test_retraction import OUT, assert_all_free, crowd, tight

PAGE = 4


def long_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts of 30-69 tokens: three to six windows."""
    return [p for p in mixed_prompts(4 * n, seed=seed) if len(p) >= 30][:n]


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["c_kernels", "torch"])
@pytest.mark.parametrize("family", ["mistral_window", "gemma2", "gemma3", "mixtral_window"])
def test_prompts_of_several_windows_equal_transformers(checkpoints, hf, tmp_path, family, cpu_kernels):
    """Chunked prefill (chunks over cached prefixes cross window edges) and decode, on the C attention kernel and the
    torch reference; without its window the same weights give other tokens, so the window decided them."""
    path = checkpoints[family]
    prompts = long_prompts(5, seed=2)
    llm = LLM(str(path), max_prefill_tokens=16, cpu_kernels=cpu_kernels)
    outs = [o.token_ids for o in llm.generate(prompts, greedy(8))]
    for prompt, out in zip(prompts, outs, strict=True):
        hf.check_greedy(out, path, prompt, 8)
    unwindowed = tmp_path / "full"
    shutil.copytree(path, unwindowed)
    config = json.loads((unwindowed / "config.json").read_text())
    config["sliding_window"] = None
    (unwindowed / "config.json").write_text(json.dumps(config))
    assert [o.token_ids for o in LLM(str(unwindowed)).generate(prompts, greedy(8))] != outs


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
@pytest.mark.parametrize("policy", ["radix", "naive"])
def test_pages_outside_the_window_are_released(checkpoints, hf, policy, overlap):
    """A 60-token prompt and 30 tokens of output on a model windowed on every layer: after the prompt's step the
    request holds only its window's pages (positions from cached_len - 11 on), the rest freed (naive) or handed to
    the prefix cache (radix), whether steps run in sequence or overlapped."""
    path = checkpoints["mistral_window"]
    llm = LLM(str(path), page_size=PAGE, prefix_cache=policy)
    prompt = ids(60, 1)
    llm.add_request(prompt, greedy(30))
    held, gone, tokens = [], [], []
    while llm.has_unfinished():
        tokens += [t for d in llm.step(overlap).outputs for t in d.token_ids]
        pages = llm.stats().pages
        held.append(pages.held)
        gone.append(pages.cached if policy == "radix" else pages.free)
    bound = WINDOW // PAGE + 2  # the window's pages, the next token's, one partly behind the window
    assert held[0] >= 60 // PAGE or overlap, held  # overlapped, the first call already scheduled the next step
    assert max(held[2:-2]) <= bound, held
    assert gone[-3] >= (60 + 25 - WINDOW) // PAGE - 1  # a chat 7 windows long holds 3 pages, not 22
    hf.check_greedy(tokens, path, prompt, 30)
    assert_all_free(llm)


def test_a_model_with_global_layers_keeps_every_page(checkpoints):
    """Gemma's global layers see every position, so no page is outside every window and none leaves early."""
    llm = LLM(str(checkpoints["gemma2"]), page_size=PAGE)
    llm.add_request(ids(60, 1), greedy(12))
    llm.step()
    while llm.has_unfinished():
        running = llm.stats().running
        if running:
            # the pages of every position written: the prompt's and all outputs but the newest
            assert llm.stats().pages.held == running[0].pages == -(-(59 + running[0].generated) // PAGE)
        llm.step()
    assert llm.model.spec.kv_window is None


def test_a_prefix_handed_over_early_is_reused_whole(checkpoints, hf):
    """The pages a request handed to the cache while it ran and those it left at its end form one prefix: a prompt
    continuing its first 44 tokens finds all 44 cached (a match is a whole prefix, so its window is intact)."""
    path = checkpoints["mistral_window"]
    llm = LLM(str(path), page_size=PAGE)
    first = ids(44, 7)
    llm.generate([first], greedy(10))
    follow = first + ids(5, 8)
    out = llm.generate([follow], greedy(8))[0]
    assert out.usage.cached_tokens == 44
    hf.check_greedy(out.token_ids, path, follow, 8)
    assert_all_free(llm)


def test_handed_pages_evicted_while_their_request_runs(checkpoints, hf):
    """A pool of 16 pages: a second request's pages come from evicting the pages the first handed over (unlocked
    leaves). The first then cannot attach its later pages to a prefix that is gone: it frees them, the cache holds
    no pages past a hole, and both requests, and the first prompt again, are transformers' tokens."""
    path = checkpoints["mistral_window"]
    llm = LLM(str(path), page_size=PAGE, num_pages=16)
    first, second = ids(40, 11), ids(36, 12)
    a = llm.add_request(first, greedy(20))
    outs: dict[str, list[int]] = {}
    while llm.stats().pages.cached < 6:  # the window has passed most of the prompt's pages
        for d in llm.step().outputs:
            outs.setdefault(d.rid, []).extend(d.token_ids)
    b = llm.add_request(second, greedy(12))
    evicted = False
    while llm.has_unfinished():
        for d in llm.step().outputs:
            outs.setdefault(d.rid, []).extend(d.token_ids)
        evicted |= len(llm.cache.match_prefix(first).pages) < 6
        llm.check_integrity()
    assert evicted
    assert len(llm.cache.match_prefix(first + outs[a]).pages) < (40 + 20) // PAGE - 1  # nothing after the hole
    hf.check_greedy(outs[a], path, first, 20)
    hf.check_greedy(outs[b], path, second, 12)
    again = llm.generate([first], greedy(20))[0]
    assert again.token_ids == outs[a]
    assert_all_free(llm)


def test_a_windowed_model_does_not_retract_where_full_attention_does(checkpoints, hf):
    """The crowd that retracts the full-attention Mixtral 3+ times in 24 pages (test_model_families) runs through on
    the windowed Mixtral without a retraction: its requests give their pages back as they go. Tokens exact."""
    path = checkpoints["mixtral_window"]
    llm = tight(path)
    prompts = crowd()
    outs = llm.generate(prompts, SamplingParams(max_tokens=OUT))
    assert llm.stats().counters.retractions == 0
    for prompt, out in zip(prompts, outs, strict=True):
        hf.check_greedy(out.token_ids, path, prompt, OUT, eos=sorted(llm.eos_ids))
    assert_all_free(llm)


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
def test_a_windowed_request_retracted_after_giving_pages_back_stays_exact(checkpoints, hf, overlap):
    """Three requests of the lowest priority decode past their window (their early pages given back); then a crowd
    of short prompts of a higher priority arrives, which admission that has learnt to expect little (its ratio at
    the floor) lets in, and which outgrows 16 pages as it grows to its window: the first three are retracted after
    giving pages back, recomputed from prompt and output (a prefill longer than the window, whose early pages go
    back again), and every request finishes with transformers' tokens; everything is freed."""
    from engine.scheduler.admission import FLOOR

    path = checkpoints["mistral_window"]
    llm = LLM(str(path), page_size=PAGE, num_pages=16, overlap=overlap, schedule_policy="priority")
    llm.scheduler.admission.ratio = FLOOR
    prompts = mixed_prompts(13, seed=3, max_len=6)
    tokens: dict[str, list[int]] = {}
    retracted: set[str] = set()  # of the first three, once their window had passed pages

    def step() -> None:
        for out in llm.step(overlap).outputs:
            tokens[out.rid] += out.token_ids
        retracted.update(rid for rid in early if (r := llm.request(rid)) is not None and r.retractions)

    early: list[str] = []
    early += [llm.add_request(p, SamplingParams(max_tokens=60, ignore_eos=True, priority=9)) for p in prompts[:3]]
    tokens |= {rid: [] for rid in early}
    while not all((r := llm.request(rid)) is not None and r.cached_len >= WINDOW + 2 * PAGE for rid in early):
        step()
    assert llm.stats().counters.retractions == 0
    crowd = [llm.add_request(p, SamplingParams(max_tokens=30, ignore_eos=True)) for p in prompts[3:]]
    tokens |= {rid: [] for rid in crowd}
    while llm.has_unfinished():
        step()
    assert retracted, f"none of the first three was retracted ({llm.stats().counters.retractions} retractions)"
    for prompt, rid in zip(prompts, early + crowd, strict=True):
        hf.check_greedy(tokens[rid], path, prompt, len(tokens[rid]))
    assert_all_free(llm)


def test_windows_in_the_one_call_layers(checkpoints):
    """A block-format model windowed on every layer runs all its layers in one C call (kernels/cpu/decode.c, each
    layer's window in its plan): the same log-probabilities as layer by layer, bit for bit, past several windows."""
    results = []
    for one_call in (True, False):
        llm = LLM(str(checkpoints["mistral_window"]), quantization="int8", max_prefill_tokens=16, one_call=one_call)
        assert llm.execution["layers"] == ("one C call a step" if one_call else "one call each")
        prompt = ids(40, 3)
        out = llm.generate([prompt, prompt[:7]], SamplingParams(max_tokens=20, prompt_logprobs=0, logprobs=0))
        assert (isinstance(llm.model.executor, OneCall) and llm.model.executor.built is not None) == one_call
        results.append([(o.token_ids, [p.logprob for p in o.prompt_logprobs[1:]], [p.logprob for p in o.logprobs])
                        for o in out])
    assert results[0] == results[1]
