"""The scheduler, step by step, through the public step API."""

from __future__ import annotations

import msgspec
import pytest

from engine import LLM, SamplingParams
from tests.checkpoints import with_eos


@pytest.fixture(scope="module")
def llm(llama_ckpt):
    return LLM(str(llama_ckpt))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


Replay = tuple[LLM, list[tuple[str, list[str], list[str]]], dict[str, list[int]]]


def replay_a_b_c(llama_ckpt, a_tokens: int, mixed: bool = False) -> Replay:
    """The seed's section 5.2 setup: two slots, A needs `a_tokens`, B 5 and C 2 output tokens, C arrives
    after step 0. Returns the engine, each step's (kind, members, finished) until all are done, and
each request's streamed tokens.
    The seed's scheduler never mixes prefill and decode in one step (`mixed_batches=False`) and reserves
    every request's whole output budget (`admission="reserve"`)."""
    llm = LLM(str(llama_ckpt), max_running_requests=2, mixed_batches=mixed, admission="reserve")
    llm.add_request([1, 2, 3], greedy(a_tokens), rid="A")
    llm.add_request([4, 5, 6, 7], greedy(5), rid="B")
    steps = [llm.step()]
    llm.add_request([8, 9], greedy(2), rid="C")
    while llm.has_unfinished():
        steps.append(llm.step())
    outputs = {rid: [t for s in steps for d in s.outputs if d.rid == rid for t in d.token_ids] for rid in "ABC"}
    return llm, [(s.kind, s.rids, s.finished) for s in steps], outputs


def test_seed_worked_example_a_b_c(llama_ckpt):
    """Section 5.2: A/B/C need 2/5/2 tokens; the six steps are exactly the seed's table."""
    llm, table, _ = replay_a_b_c(llama_ckpt, a_tokens=2)
    assert table == [
        ("prefill", ["A", "B"], []),
        ("decode", ["A", "B"], ["A"]),
        ("prefill", ["C"], []),
        ("decode", ["B", "C"], ["C"]),
        ("decode", ["B"], []),
        ("decode", ["B"], ["B"]),
    ]
    llm.check_integrity()


def test_mixed_batches_let_b_decode_while_c_prefills(llama_ckpt):
    """The same arrivals with mixed batches (the default): C's prefill carries B's decode token, so B
    never waits a step for it and the work takes five steps instead of six; outputs are unchanged."""
    llm, table, outputs = replay_a_b_c(llama_ckpt, a_tokens=2, mixed=True)
    assert table == [
        ("prefill", ["A", "B"], []),
        ("decode", ["A", "B"], ["A"]),
        ("mixed", ["B", "C"], []),
        ("decode", ["B", "C"], ["C"]),
        ("decode", ["B"], ["B"]),
    ]
    llm.check_integrity()
    counters = llm.stats().counters
    assert counters.prefill_tokens == 3 + 4 + 2 and counters.decode_tokens == 2 + 1 + 2 + 1
    assert outputs == replay_a_b_c(llama_ckpt, a_tokens=2, mixed=False)[2]


def test_seed_exercise_4_one_token_a_frees_its_slot_at_step_0(llama_ckpt):
    llm, table, _ = replay_a_b_c(llama_ckpt, a_tokens=1)
    assert table[:3] == [
        ("prefill", ["A", "B"], ["A"]),
        ("prefill", ["C"], []),
        ("decode", ["B", "C"], ["C"]),
    ]
    llm.check_integrity()


def test_admission_stops_at_first_request_that_does_not_fit(llama_ckpt):
    """A big request at the head of the queue blocks a small one behind it (no skipping ahead), and the
    scheduler says why each waits."""
    llm = LLM(str(llama_ckpt), page_size=4, num_pages=8, admission="reserve")
    running = llm.add_request([1] * 4, greedy(12))  # reserves 4 of 8 pages
    llm.step()
    big = llm.add_request([2] * 10, greedy(8))  # needs 5 pages: does not fit next to `running`
    small = llm.add_request([3], greedy(2))  # needs 1 page: would fit, but waits its turn
    res = llm.step()
    assert res.kind == "decode" and res.rids == [running]
    assert [r.rid for r in llm.scheduler.prefill_manager.waiting] == [big, small]
    assert [(w.rid, w.reason) for w in llm.stats().waiting] == [(big, "kv_pages"), (small, "queue")]
    while llm.has_unfinished():
        llm.step()
    llm.check_integrity()


def test_chunked_request_continues_first_and_commits_no_token(llama_ckpt):
    llm = LLM(str(llama_ckpt), max_prefill_tokens=8)
    long = llm.add_request(list(range(1, 21)), greedy(3))
    res = llm.step()
    assert res.kind == "prefill" and res.rids == [long] and res.num_tokens == 8
    assert llm.request(long).output_ids == [] and not res.outputs
    assert long not in llm.scheduler.decode_manager.running
    short = llm.add_request([5, 6], greedy(3))
    res = llm.step()  # the chunked request goes first, the newcomer takes what budget is left
    assert res.rids == [long] and res.num_tokens == 8
    res = llm.step()
    assert res.rids == [long, short] and res.num_tokens == 4 + 2
    assert [d.rid for d in res.outputs] == [long, short]
    assert llm.request(long).cached_len == 20  # positions 0..19 all in the cache


@pytest.mark.parametrize("state", ["waiting", "chunked", "running"])
def test_abort_in_every_state_frees_slot_and_pages(llama_ckpt, state):
    llm = LLM(str(llama_ckpt), max_prefill_tokens=6, max_running_requests=1)
    first = llm.add_request(list(range(1, 15)), greedy(50))
    second = llm.add_request([7, 8, 9], greedy(5))
    llm.step()  # `first` is now mid-chunk; `second` is waiting (one slot only)
    if state == "running":
        llm.step()
        llm.step()
        assert first in llm.scheduler.decode_manager.running
    target = second if state == "waiting" else first
    if state == "chunked":
        assert llm.scheduler.prefill_manager.chunked is llm.request(first)
    llm.abort(target)
    res = llm.step()
    assert target in res.finished
    final = next(d for d in res.outputs if d.rid == target)
    assert final.finish_reason == "abort"
    llm.cache.check_integrity()
    assert target not in llm.table.holder
    assert target not in llm.cache.allocator.owner.values()
    while llm.has_unfinished():
        llm.step()
    llm.check_integrity()
    pages = llm.stats().pages
    assert pages.held == pages.locked == 0 and pages.free + pages.cached == llm.num_pages
    with pytest.raises(ValueError, match="unknown request id"):
        llm.abort(target)


def test_eos_stops_unless_ignore_eos(llama_ckpt, tmp_path, hf):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    free_run = LLM(str(llama_ckpt)).generate([prompt], greedy(12))[0].token_ids
    eos = free_run[4]
    stop_at = free_run.index(eos)
    llm = LLM(str(with_eos(llama_ckpt, tmp_path / "eos", [eos])))
    assert eos in llm.eos_ids  # read from generation_config.json
    stopped = llm.generate([prompt], SamplingParams(max_tokens=12))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == free_run[: stop_at + 1]
    hf.check_greedy(stopped.token_ids, llama_ckpt, prompt, 12, eos=sorted(llm.eos_ids))
    ignored = llm.generate([prompt], greedy(12))[0]
    assert ignored.finish_reason == "length" and ignored.token_ids == free_run
    llm.check_integrity()


def test_stop_strings_truncate_text_and_finish(llm):
    prompt = "To be, or not to be"
    full = llm.generate([prompt], greedy(20))[0].text
    assert len(full) > 6
    stop = full[3:6]
    out = llm.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full[: full.index(stop)]
    assert len(out.token_ids) < 20


def test_streamed_text_never_shows_a_stop_string(llm):
    prompt = "The quick brown fox"
    full = llm.generate([prompt], greedy(20))[0].text
    stop = full[5:9]
    rid = llm.add_request(prompt, SamplingParams(max_tokens=20, ignore_eos=True, stop=[stop]))
    pieces = []
    while llm.has_unfinished():
        pieces += [d.text for d in llm.step().outputs if d.rid == rid]
    assert "".join(pieces) == full[: full.index(stop)]


def test_sampling_with_seed_is_reproducible(llm):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    alone = llm.generate(prompts[:1], params)[0].token_ids
    batched = llm.generate(prompts, params)
    assert batched[0].token_ids == alone  # same seed, same output, whatever else is in the batch
    other = llm.generate(prompts[:1], msgspec.structs.replace(params, seed=99))[0].token_ids
    greedy_out = llm.generate(prompts[:1], greedy(12))[0].token_ids
    assert alone != other or alone != greedy_out


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_tokens": -1}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logit_bias": {3: 150.0}}, "logit_bias"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"n": 65}, "n must"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"stop": [""]}, "stop"),
])
def test_impossible_sampling_params_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_invalid_requests_raise_and_leak_nothing(llama_ckpt):
    llm = LLM(str(llama_ckpt), page_size=4, num_pages=16)
    with pytest.raises(ValueError, match="prompt has 80 tokens"):
        llm.add_request([1] * 80)  # the pool holds 64 tokens
    with pytest.raises(ValueError, match="empty"):
        llm.add_request([])
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 384\)"):
        llm.add_request([1, 384])
    with pytest.raises(ValueError, match="unknown request id"):
        llm.abort("nope")
    llm.add_request([1, 2], rid="dup")
    with pytest.raises(ValueError, match="already in use"):
        llm.add_request([1, 2], rid="dup")
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM(str(llama_ckpt), flavour="strawberry")
    while llm.has_unfinished():
        llm.step()
    llm.check_integrity()
    assert not llm.stats().waiting and all(s is None for s in llm.stats().slots)


def test_output_budget_is_clamped_to_the_context(llama_ckpt):
    llm = LLM(str(llama_ckpt), max_model_len=32)
    out = llm.generate([[1] * 30], greedy(100))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 2


def test_chat_messages_use_the_chat_template(llm):
    msgs = [{"role": "user", "content": "hello"}]
    ids = llm.encode_prompt(msgs)
    assert ids == llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert llm.generate([msgs], greedy(3))[0].prompt_token_ids == ids


def test_configuration_is_frozen_parts_built_from_flat_options():
    """Each option lands in the part that owns it; parts are frozen and check themselves without changing a field
    (a draft model implies the draft proposer by reading, not by rewriting `speculative`); the flat options round-
    trip, which is how a launcher passes a configuration on; every option carries the help `--help` prints."""
    import dataclasses

    from engine.config import PARTS, EngineConfig, SchedulerConfig, option_fields

    cfg = EngineConfig.of(model="m", max_prefill_tokens=64, page_size=8, speculative_model="draft",
                          tensor_parallel_size=2, dtype="bfloat16", seed=3)
    assert (cfg.scheduler.max_prefill_tokens, cfg.kv.page_size, cfg.parallel.tensor_parallel_size,
            cfg.execution.dtype, cfg.seed) == (64, 8, 2, "bfloat16", 3)
    assert cfg.speculation.speculative is None and cfg.speculation.method == "draft"
    assert EngineConfig.of(**cfg.options()) == cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.scheduler.max_prefill_tokens = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="unknown engine option"):
        EngineConfig.of(flavour="strawberry")
    with pytest.raises(ValueError, match="max_prefill_tokens must be at least 1"):
        SchedulerConfig(max_prefill_tokens=0)
    with pytest.raises(ValueError, match="kv_host_gib: the KV tiers go under the radix prefix cache"):
        EngineConfig.of(kv_host_gib=1, prefix_cache="naive")
    fields = option_fields()
    assert {owner for _, _, owner in fields.values()} == {"", *PARTS}
    assert all(f.metadata["help"].endswith(".") or f.metadata["help"].endswith(")") for f, _, _ in fields.values())


def test_request_slots_and_graph_buckets_suit_the_device(llama_ckpt):
    """32 slots on a CPU, 256 on a GPU (a batch of 32 leaves one mostly idle); graphs cover every decode
    batch the slots allow, up to 256; what they resolved to is reported. Asked-for values win."""
    from engine.config import EngineConfig

    assert (EngineConfig().request_slots, EngineConfig.of(device="cuda").request_slots) == (32, 256)
    assert EngineConfig.of(device="cuda").graph_max_bs == 256
    assert EngineConfig.of(device="cuda", max_running_requests=48).graph_max_bs == 48
    assert EngineConfig.of(device="cuda", cuda_graph_max_bs=64).graph_max_bs == 64
    llm = LLM(str(llama_ckpt))
    assert llm.table.num_slots == 32 and llm.execution["request_slots"] == "32"
