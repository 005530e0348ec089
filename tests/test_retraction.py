"""Scheduler v2: admission by expectation, retraction when the pool runs dry, priorities, lpm, the
starvation and consecutive-prefill bounds. Every retraction test checks that retractions happened,
that greedy output still equals transformers (or sampling equals the run without retraction), and
that every page and slot is free afterwards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from engine import LLM, SamplingParams
from engine.batch import ForwardOutput
from engine.config import SchedulerConfig
from engine.kv import make_cache_manager
from engine.kv.table import RequestTable
from engine.request import Req, ReqState
from engine.scheduler import Scheduler
from engine.scheduler.views import SchedulerView
from tests.checkpoints import make_tokenizer
from tests.test_engine_correctness import FAMILIES, mixed_prompts


def tight(path: Path, **options: object) -> LLM:
    """24 pages of 4 tokens: `crowd()` cannot all fit, and admission's expected output (70% of the budget
    at first) under-promises, so running requests get retracted."""
    return LLM(str(path), page_size=4, num_pages=24, **options)


OUT = 48  # output tokens each crowd request asks for


def crowd(seed: int = 7) -> list[list[int]]:
    """48 prompts of 1-23 tokens, each to generate OUT tokens: the first finishers teach admission that
    requests use their whole budget only after many were admitted on a lower estimate, so the running
    set outgrows the pool several times (7-8 retractions here, on every architecture)."""
    return mixed_prompts(48, seed=seed, max_len=24)


def assert_all_free(llm: LLM) -> None:
    llm.check_integrity()
    snap = llm.stats()
    assert snap.pages.free + snap.pages.held + snap.pages.cached == snap.pages.total
    assert snap.pages.held == snap.pages.locked == 0 and all(h is None for h in snap.slots) and snap.idle


# Every architecture on the default loop (overlapped, mixed batches); the other three loops on llama.
LOOPS = [*((family, True, True) for family in FAMILIES),
         *(("llama", overlap, mixed) for overlap, mixed in ((False, True), (False, False), (True, False)))]
LOOP_IDS = [f"{f}-{'overlap' if o else 'sequential'}-{'mixed' if m else 'unmixed'}" for f, o, m in LOOPS]


@pytest.mark.parametrize(("family", "overlap", "mixed"), LOOPS, ids=LOOP_IDS)
def test_retracted_requests_stay_token_exact(checkpoints, hf, family, overlap, mixed):
    path = checkpoints[family]
    llm = tight(path, overlap=overlap, mixed_batches=mixed)
    prompts = crowd()
    outs = llm.generate(prompts, SamplingParams(max_tokens=OUT))
    retracted = llm.stats().counters.retractions
    assert retracted >= 3, f"only {retracted} retractions: the pool does not bind"
    for prompt, out in zip(prompts, outs, strict=True):
        hf.check_greedy(out.token_ids, path, prompt, OUT, eos=sorted(llm.eos_ids))
    assert_all_free(llm)


def test_seeded_sampling_is_the_same_with_and_without_retraction(llama_ckpt):
    prompts = crowd(8)
    params = [SamplingParams(max_tokens=OUT, temperature=1.0, top_k=50, seed=100 + i) for i in range(len(prompts))]
    roomy = LLM(str(llama_ckpt), page_size=4)
    squeezed = tight(llama_ckpt)
    expected = [o.token_ids for o in roomy.generate(prompts, params)]
    assert [o.token_ids for o in squeezed.generate(prompts, params)] == expected
    assert roomy.stats().counters.retractions == 0 and squeezed.stats().counters.retractions >= 3
    assert_all_free(squeezed)


def test_retraction_under_tensor_parallelism(llama_ckpt, hf):
    prompts = crowd(9)
    with tight(llama_ckpt, tensor_parallel_size=2) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=OUT))
        assert llm.stats().counters.retractions >= 3
        for prompt, out in zip(prompts, outs, strict=True):
            hf.check_greedy(out.token_ids, llama_ckpt, prompt, OUT, eos=sorted(llm.eos_ids))
        assert_all_free(llm)


def finals_of(llm: LLM, overlap: bool, finals: dict, until=None) -> None:
    """Step until `until()` holds (or until nothing is left), collecting every Final."""
    while llm.has_unfinished() and not (until and until()):
        finals.update((o.rid, o) for o in llm.step(overlap).outputs if o.finished)


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
@pytest.mark.parametrize("when", ["same_step", "resumed"])
def test_abort_a_retracted_request(llama_ckpt, overlap, when):
    """Aborted right after the step that retracted it (it waits to resume), or once it runs again: it
    finishes with "abort"; everyone else finishes; every page and slot comes back."""
    llm = tight(llama_ckpt, overlap=overlap)
    rids = [llm.add_request(p, SamplingParams(max_tokens=OUT)) for p in crowd()]
    finals: dict = {}
    finals_of(llm, overlap, finals, until=lambda: llm.stats().counters.retractions > 0)
    victim = next(w for w in llm.stats().waiting if w.retractions)
    if when == "resumed":
        finals_of(llm, overlap, finals, until=lambda: victim.rid in {r.rid for r in llm.stats().running})
    llm.abort(victim.rid)
    finals_of(llm, overlap, finals)
    assert finals.pop(victim.rid).finish_reason == "abort"
    assert {f.finish_reason for f in finals.values()} <= {"length", "stop"} and len(finals) == len(rids) - 1
    assert_all_free(llm)


def test_retraction_waits_for_the_batch_in_flight(llama_ckpt):
    """Overlapped, step N+1 is scheduled while step N runs. When N+1 cannot get its pages, nothing is
    retracted while N still writes the victims' pages: scheduling returns None, N is processed, and the
    retraction happens with nothing in flight. A request aborted at that moment is freed once."""
    llm = tight(llama_ckpt, overlap=True)
    for p in crowd():
        llm.add_request(p, SamplingParams(max_tokens=OUT))
    deferred = 0
    aborted = None
    while llm.has_unfinished():
        had_inflight = llm.loop.has_inflight
        result = llm.step(True)
        if had_inflight and not llm.loop.has_inflight and llm.scheduler.decode_manager.running:
            deferred += 1  # the batch in flight was processed and no next one launched: room is short
            if aborted is None:
                aborted = result.rids[-1]
                llm.abort(aborted)  # one of the requests the coming retraction may pick
        llm.cache.check_integrity()
    assert deferred > 0 and llm.stats().counters.retractions > 0
    assert_all_free(llm)


def test_priority_orders_admission_and_retraction(llama_ckpt):
    llm = LLM(str(llama_ckpt), max_running_requests=1, schedule_policy="priority")
    first = llm.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    order = list(llm.step().rids)
    low = llm.add_request([4, 5], SamplingParams(max_tokens=2, priority=5))
    high = llm.add_request([6, 7], SamplingParams(max_tokens=2, priority=-1))
    while llm.has_unfinished():
        order += [r for r in llm.step().rids if r not in order]
    assert order == [first, high, low]
    squeezed = tight(llama_ckpt, schedule_policy="priority")
    prompts = crowd()
    vip = [squeezed.add_request(p, SamplingParams(max_tokens=30, priority=-1 if i < 2 else 0))
           for i, p in enumerate(prompts)][:2]
    while squeezed.has_unfinished():
        squeezed.step()
        assert not {w.rid for w in squeezed.stats().waiting if w.retractions} & set(vip)
    assert squeezed.stats().counters.retractions > 0
    assert_all_free(squeezed)


def test_lpm_admits_the_longest_cached_prefix_first(llama_ckpt):
    llm = LLM(str(llama_ckpt), page_size=4, max_running_requests=1, schedule_policy="lpm")
    shared = list(range(10, 30))
    llm.generate([shared + [1]], SamplingParams(max_tokens=1))  # leaves `shared` in the prefix cache
    blocker = llm.add_request([5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
    order = list(llm.step().rids)
    cold = llm.add_request([40, 41, 42, 43, 44], SamplingParams(max_tokens=2))
    warm = llm.add_request(shared + [2], SamplingParams(max_tokens=2))
    while llm.has_unfinished():
        order += [r for r in llm.step().rids if r not in order]
    assert order == [blocker, warm, cold]


def test_starvation_bound_admits_the_oldest_next(llama_ckpt):
    """Under priority, a stream of urgent requests would keep a patient one waiting forever; after
    max_wait_steps steps it goes next."""
    llm = LLM(str(llama_ckpt), max_running_requests=1, schedule_policy="priority", max_wait_steps=6)
    patient = llm.add_request([1, 2], SamplingParams(max_tokens=2, priority=10))
    admitted_at = None
    for step in range(40):
        if len(llm.scheduler.prefill_manager.waiting) < 2:
            llm.add_request([3, step % 50 + 4], SamplingParams(max_tokens=2, priority=0))
        if patient in llm.step().rids and admitted_at is None:
            admitted_at = step
    assert admitted_at is not None and 6 <= admitted_at <= 9


def test_consecutive_prefills_are_bounded_without_mixed_batches(llama_ckpt):
    llm = LLM(str(llama_ckpt), mixed_batches=False, max_prefill_tokens=4, max_consecutive_prefills=3)
    llm.add_request([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    llm.step()
    for i in range(12):  # a long prompt keeps the prefill side busy for many steps
        llm.add_request(list(range(5 + i, 25 + i)), SamplingParams(max_tokens=1))
    kinds = [llm.step().kind for _ in range(16)]
    streak = longest = 0
    for kind in kinds:
        streak = streak + 1 if kind == "prefill" else 0
        longest = max(longest, streak)
    assert longest == 3 and "decode" in kinds


def test_fair_budget_counts_decode_tokens(llama_ckpt):
    llm = LLM(str(llama_ckpt), max_prefill_tokens=16)
    for i in range(6):
        llm.add_request([i + 1, i + 2], SamplingParams(max_tokens=40, ignore_eos=True))
    llm.step()
    llm.add_request(list(range(50, 90)), SamplingParams(max_tokens=2))
    result = llm.step()
    assert result.kind == "mixed" and result.num_decode_tokens == 6 and result.num_tokens == 16


def qwen05b_kv_shape(out: Path) -> Path:
    """The Qwen2.5-0.5B KV layout (24 layers, 2 KV heads of 64, a 32k context) with everything else tiny."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=384, hidden_size=128, intermediate_size=64, num_hidden_layers=24,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32768,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    Qwen2ForCausalLM(config).save_pretrained(out)
    make_tokenizer(out)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 24
    return out


@pytest.mark.parametrize(("admission", "expected"), [("optimistic", (28, 32)), ("reserve", (2, 2))])
def test_requests_without_max_tokens_run_together_under_optimistic_admission(tmp_path_factory, admission,
                                                                            expected):
    """32 requests whose budget is the whole context (a client that sent no max_tokens) on the default CPU
    pool of the 0.5B shape (5,461 pages of 16): reserve runs 2 at a time, optimistic at least 28."""
    path = qwen05b_kv_shape(tmp_path_factory.mktemp("kv05b") / "qwen")
    # the pool a CPU gets by default with 1 GiB for the KV cache (less when the machine is short of memory)
    llm = LLM(str(path), dtype="bfloat16", admission=admission, max_prefill_tokens=4096, kv_memory_gb=1.0)
    assert llm.num_pages == 5461
    for i in range(32):
        llm.add_request([i + 1] * 20, SamplingParams(max_tokens=32768, ignore_eos=True))
    for _ in range(3):
        llm.step()
    running = len(llm.stats().running)
    assert expected[0] <= running <= expected[1], running


def test_the_scheduler_schedules_without_a_model():
    """schedule() and process() need no model: tokens come from the test, the batches are the scheduler's."""
    cache = make_cache_manager("radix", num_pages=16, page_size=4)
    table = RequestTable(2, 64, torch.device("cpu"))
    scheduler = Scheduler(None, cache, table, eos_ids={0}, config=SchedulerConfig(max_prefill_tokens=8))
    reqs = [Req(rid=f"r{i}", uid=i, input_ids=[i + 1] * 5, params=SamplingParams(max_tokens=3), max_output=3)
            for i in range(3)]
    for req in reqs:
        scheduler.add_request(req)
    batch = scheduler.schedule()
    assert batch is not None and batch.kind == "prefill" and [r.rid for r in batch.reqs] == ["r0", "r1"]
    assert batch.num_tokens == 8 and reqs[1].extend_len == 3  # the budget chunks r1
    assert [w.reason for w in SchedulerView(scheduler).snapshot().waiting] == ["slot"]

    result = scheduler.process(batch, ForwardOutput(next_tokens=torch.tensor([7] * len(batch.sample_rows))))
    assert [o.rid for o in result.outputs] == ["r0"] and reqs[0].output_ids == [7]
    assert reqs[1].state is ReqState.PREFILLING


def test_every_request_keeps_its_invariant_through_retraction_and_speculation(llama_ckpt):
    """After every step, each live request's lengths and KV agree (the host has seen what it sampled, its pages are
    exactly those its cached tokens need, listed in its table row), through admission, chunking, retraction and the
    rollback of rejected drafts; a request whose pages are tampered with is caught."""
    llm = tight(llama_ckpt, speculative="ngram", max_prefill_tokens=8)
    for p in crowd():
        llm.add_request(p, SamplingParams(max_tokens=OUT))
    checked = 0
    while llm.has_unfinished():
        llm.step()
        llm.check_integrity()
        checked += sum(r.kv.slot is not None for r in llm.scheduler.reqs.values())
    counters = llm.stats().counters
    assert checked > 500 and counters.retractions > 0 and counters.spec_draft_tokens > counters.spec_accepted_tokens
    rid = llm.add_request(list(range(2, 30)), SamplingParams(max_tokens=4))
    llm.step()
    llm.request(rid).kv.pages.append(llm.request(rid).kv.pages[0])
    with pytest.raises(AssertionError, match="pages for"):
        llm.check_integrity()
